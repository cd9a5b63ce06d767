"""The rendezvous store: operations, blocking gets, concurrency and hostile peers."""

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from roundel.errors import RoundelError
from roundel.rendezvous import store as rendezvous
from roundel.rendezvous import wire
from roundel.rendezvous.store import (
    RendezvousClient,
    RendezvousError,
    RendezvousServer,
    RendezvousTimeout,
    new_secret,
)
from roundel.transport.store_adapter import RendezvousStore


@pytest.fixture
def secret():
    return new_secret()


@pytest.fixture
def server(secret):
    srv = RendezvousServer(secret)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server, secret):
    c = RendezvousClient(server.host, server.port, secret, connect_timeout=5)
    yield c
    c.close()


def assert_dropped(sock):
    """The server closes ``sock`` promptly (EOF or reset), whatever it sent."""
    sock.settimeout(5)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


def authenticated_channel(server, secret):
    """A raw connection past the handshake (roundel.authwire's, as the store speaks it), to send hand-made frames."""
    sock = socket.create_connection((server.host, server.port), timeout=5)
    return wire.client_handshake(sock, secret, time.monotonic() + 5)


def test_new_secret():
    a, b = new_secret(), new_secret()
    assert len(a) == 32 and a != b


def test_operations(server, client):
    assert client.num_keys() == 0
    client.set("a", b"1")
    client.set("empty", b"")
    assert client.get("a") == b"1"
    assert client.get("empty") == b""
    assert client.check(["a", "empty"]) and not client.check(["a", "b"]) and client.check([])
    assert client.add("n", 5) == 5
    assert client.add("n", -2) == 3
    assert client.get("n") == b"3"
    assert client.num_keys() == 3
    assert client.delete("a") and not client.delete("a")
    assert not client.check(["a"])
    client.set("k\u00e9y", bytes(range(256)))
    assert client.get("k\u00e9y") == bytes(range(256))
    with pytest.raises(RendezvousError, match="does not hold an integer"):
        client.add("empty", 1)
    # The launcher's in-process view is the same store.
    assert server.get("n") == b"3" and server.get("missing") is None
    server.set("from-launcher", b"x")
    assert client.get("from-launcher") == b"x"


def test_large_value(client):
    value = os.urandom(8 * 1024 * 1024)
    client.set("big", value)
    assert client.get("big") == value


def test_blocking_get_satisfied_by_another_client(server, client, secret):
    other = RendezvousClient(server.host, server.port, secret)
    result = {}

    def waiter():
        start = time.monotonic()
        result["value"] = client.get("later", timeout=10)
        result["waited"] = time.monotonic() - start

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    assert "value" not in result
    other.set("later", b"here")
    t.join(5)
    assert result["value"] == b"here" and 0.25 < result["waited"] < 5
    other.close()


def test_get_timeout_names_the_key(client):
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout, match=r"'rank\.7\.addr'.*0\.3 seconds") as info:
        client.get("rank.7.addr", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RoundelError)
    client.set("x", b"1")  # the connection is still usable
    assert client.get("x", timeout=0) == b"1"


def test_threads_sharing_one_client(client):
    threads, errors = 8, []

    def work(i):
        try:
            for j in range(50):
                client.add("counter", 1)
                client.set(f"t{i}.{j}", f"{i}:{j}".encode())
            # Wait for a key another thread sets: must not block the others.
            peer = (i + 1) % threads
            assert client.get(f"t{peer}.49", timeout=10) == f"{peer}:49".encode()
        except Exception as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(30)
    assert not errors
    assert client.get("counter") == str(threads * 50).encode()
    assert client.num_keys() == threads * 50 + 1


def test_two_processes(server, client, secret):
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "from roundel.rendezvous.store import RendezvousClient\n"
            "c = RendezvousClient(sys.argv[1], int(sys.argv[2]), bytes.fromhex(os.environ['SECRET']))\n"
            "v = c.get('to-child', timeout=20)\n"
            "c.set('to-parent', v + b'!')\n"
            "c.add('count', 10)\n",
            server.host,
            str(server.port),
        ],
        env={**os.environ, "SECRET": secret.hex()},
    )
    try:
        client.add("count", 1)
        client.set("to-child", b"ping")
        assert client.get("to-parent", timeout=20) == b"ping!"
        assert child.wait(20) == 0
        assert client.get("count") == b"11"
    finally:
        child.kill()


def test_wrong_secret_is_refused(server, client):
    with pytest.raises(RendezvousError, match="secret does not match"):
        RendezvousClient(server.host, server.port, b"not the secret", connect_timeout=5)
    # a client that skips checking the server's proof still cannot prove the secret itself
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(wire.MAGIC + struct.pack("!I", 0) + os.urandom(32))
        assert sock.recv(72, socket.MSG_WAITALL).startswith(wire.MAGIC)
        sock.sendall(os.urandom(32))  # a wrong proof
        sock.settimeout(5)
        assert sock.recv(100) == b""  # closed without a welcome
    client.set("still", b"works")
    assert client.get("still") == b"works"


def test_client_refuses_server_without_secret(secret):
    """A listener that cannot prove it holds the secret is not trusted with the job's data."""
    impostor = socket.create_server(("127.0.0.1", 0))

    def serve():  # answers in the protocol's shape, with a random nonce and proof
        conn, _ = impostor.accept()
        conn.recv(44, socket.MSG_WAITALL)
        conn.sendall(wire.MAGIC + os.urandom(64))
        conn.recv(1)
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(RendezvousError, match="does not hold this job's secret"):
        RendezvousClient("127.0.0.1", impostor.getsockname()[1], secret, connect_timeout=5)
    t.join(5)
    impostor.close()


def test_client_refuses_a_server_of_another_protocol(secret):
    """Something else answers at the address (here: an older store that greets with a bare nonce): the
    client says so at once instead of retrying."""
    other = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = other.accept()
        with conn:
            conn.sendall(os.urandom(32))
            conn.settimeout(5)
            conn.recv(100)

    t = threading.Thread(target=serve)
    t.start()
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="does not speak roundel's rendezvous protocol"):
        RendezvousClient("127.0.0.1", other.getsockname()[1], secret, connect_timeout=10)
    assert time.monotonic() - start < 3
    t.join(5)
    other.close()


def test_random_bytes_are_dropped(server, client):
    sock = socket.create_connection((server.host, server.port))
    try:
        sock.sendall(os.urandom(10 * 1024))
    except ConnectionResetError:
        pass
    assert_dropped(sock)
    sock.close()
    client.set("after-random", b"ok")
    assert client.get("after-random") == b"ok"


def test_huge_length_is_dropped(server, client, secret):
    # Before authentication: treated as a failed handshake.
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(struct.pack("!BdII", 1, -1.0, 0xFFFFFFFF, 0xFFFFFFFF) * 4 + b"\0" * 64)
    assert_dropped(sock)
    sock.close()
    # After authentication: a frame over the message size limit is dropped without reading it.
    channel = authenticated_channel(server, secret)
    channel.sock.sendall(struct.pack("!I", 1 << 31))
    assert_dropped(channel.sock)
    channel.close()
    client.set("after-huge", b"ok")
    assert client.get("after-huge") == b"ok"


def test_malformed_requests_are_dropped(server, client, secret):
    """Well-authenticated frames whose contents are malformed: the connection is dropped."""
    for body in (
        struct.pack("!BdI", 99, -1.0, 1) + b"k",  # unknown op
        struct.pack("!BdI", 1, -1.0, 2) + b"\xff\xfe",  # key not UTF-8
        struct.pack("!BdI", 3, -1.0, 1) + b"kabc",  # add with a malformed amount
        struct.pack("!BdI", 1, -1.0, 50) + b"short",  # key longer than the frame
        struct.pack("!Bd", 1, -1.0),  # truncated request header
        b"",  # empty frame
    ):
        channel = authenticated_channel(server, secret)
        channel.send(body)
        assert_dropped(channel.sock)
        channel.close()
    channel = authenticated_channel(server, secret)
    channel.sock.sendall(struct.pack("!I", 10) + b"half")  # half a frame, then half-close
    channel.sock.shutdown(socket.SHUT_WR)
    assert_dropped(channel.sock)
    channel.close()
    assert client.add("after-malformed", 2) == 2


def test_half_closed_and_silent_peers(server, client, monkeypatch):
    sock = socket.create_connection((server.host, server.port))
    sock.shutdown(socket.SHUT_WR)
    assert_dropped(sock)
    sock.close()
    monkeypatch.setattr(rendezvous, "HANDSHAKE_TIMEOUT_S", 0.3)
    silent = socket.create_connection((server.host, server.port))
    start = time.monotonic()
    assert_dropped(silent)
    assert time.monotonic() - start < 3
    silent.close()
    client.set("after-silent", b"ok")
    assert client.get("after-silent") == b"ok"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_timeout_names_the_address(secret):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{port}.*roundelrun is still running"):
        RendezvousClient("127.0.0.1", port, secret, connect_timeout=0.5)
    assert time.monotonic() - start < 3


def test_client_waits_for_a_late_server(secret):
    port = free_port()
    result = {}

    def connect():
        c = RendezvousClient("127.0.0.1", port, secret, connect_timeout=10)
        result["value"] = c.get("k", timeout=10)
        c.close()

    t = threading.Thread(target=connect)
    t.start()
    time.sleep(0.4)
    srv = RendezvousServer(secret, port=port)
    srv.start()
    srv.set("k", b"late")
    t.join(10)
    srv.stop()
    assert result["value"] == b"late"


def test_stop_wakes_blocked_get(secret):
    srv = RendezvousServer(secret)
    srv.start()
    c = RendezvousClient(srv.host, srv.port, secret)
    errors = []

    def waiter():
        try:
            c.get("never")
        except RendezvousError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    srv.stop()
    t.join(5)
    assert not t.is_alive() and errors
    c.close()


def test_closed_client_raises(client):
    client.close()
    with pytest.raises(RendezvousError, match="closed"):
        client.set("a", b"1")


def test_store_adapter_semantics(server, client):
    """What Gloo's bootstrap relies on: c10d's get/wait/check/add, with timeouts bounding the whole call."""
    store = RendezvousStore(client, "p/", timedelta(seconds=1))
    store.set("a", "text")
    store.set("b", b"bytes")
    assert store.get("a") == b"text" and server.get("p/b") == b"bytes"
    assert store.check(["a", "b"]) and not store.check(["a", "missing"])
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2
    store.wait(["a", "b"])
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout):
        store.wait(["missing1", "missing2", "missing3"], timedelta(seconds=0.5))
    assert time.monotonic() - start < 1.4  # one deadline for all keys, not 0.5 s each
    with pytest.raises(RendezvousTimeout):
        store.get("missing")
    threading.Timer(0.5, server.set, ("p/later", b"x")).start()
    store.set_timeout(timedelta(0))  # c10d: zero means no timeout
    assert store.get("later") == b"x"
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == client.num_keys()
