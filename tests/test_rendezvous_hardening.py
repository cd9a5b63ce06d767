"""The rendezvous store under hostile and failing peers: floods, slow senders, tampering, a stopped server, fuzz,
and another local user holding its pre-authentication slots while a job starts or an elastic job grows.

Servers that need their own open-file limit run in a subprocess; the others in
this process. The handshake and frames are built here from the protocol as
roundel/authwire.py documents it, so a mistake there cannot hide in a shared helper.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import re
import resource
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest

from elastic_util import ElasticJob, check_training
from launch_util import LAUNCHER, WORKERS_DIR, clean_env
from preauth_attacker import Attacker
from roundel.rendezvous.store import RendezvousClient, RendezvousError, RendezvousServer, new_secret

# The documented bound on noticing a server that stopped answering: GET_POLL_S + RESPONSE_GRACE_S.
DETECTION_BOUND_S = 15.0
HANDSHAKE_DEADLINE_S = 1.0  # rendezvous.FIRST_MESSAGE_S
PENDING_CAP = 64  # rendezvous.MAX_PENDING_HANDSHAKES
FRAME_DEADLINE_S = 10.0  # rendezvous.wire.FRAME_DEADLINE_S: a frame once begun must arrive within this

_SERVER = """
import logging, os, resource, sys, time
from roundel.rendezvous.store import RendezvousServer
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
server = RendezvousServer(bytes.fromhex(os.environ["SECRET"]))
port = server.start()
limit = sys.argv[1]
if limit.startswith("+"):  # this many descriptors beyond those open now
    limit = len(os.listdir("/proc/self/fd")) + int(limit)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(limit), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(port, flush=True)
time.sleep(300)
"""


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
    c = RendezvousClient(server.host, server.port, secret, connect_timeout=10)
    yield c
    c.close()


class ServerProcess:
    """A RendezvousServer in a subprocess with its soft open-file limit set to ``nofile`` ("256", "+6")."""

    def __init__(self, secret: bytes, nofile: str, log_path):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, nofile], stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env={**os.environ, "SECRET": secret.hex()})
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        if not ready:
            self.close()
            pytest.fail("the rendezvous server subprocess did not start within 60 s")
        self.port = int(self.proc.stdout.readline())

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()


def flood(port: int, count: int) -> list[socket.socket]:
    """``count`` idle connections to ``port`` (non-blocking connects: a full backlog does not stall the test)."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < count + 200:
        pytest.skip(f"this test process may open fewer than {count + 200} files (ulimit -n)")
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    return socks


def close_all(socks) -> None:
    for sock in socks:
        sock.close()


def assert_store_serves(port: int, secret: bytes, within: float = 20.0) -> float:
    """A fresh client connects and its requests are answered; returns how long that took."""
    start = time.monotonic()
    c = RendezvousClient("127.0.0.1", port, secret, connect_timeout=within)
    try:
        c.set("after-flood", b"ok")
        assert c.get("after-flood", timeout=5) == b"ok"
        assert c.add("n", 2) == 2
    finally:
        c.close()
    return time.monotonic() - start


def wait_dropped(sock: socket.socket, timeout: float) -> float:
    """Read until the server closes ``sock`` (EOF or reset); returns the seconds that took."""
    start = time.monotonic()
    deadline = start + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the server did not drop the connection within {timeout:g} s")
            sock.settimeout(left)
            if not sock.recv(4096):
                break
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise AssertionError(f"the server did not drop the connection within {timeout:g} s") from None
    return time.monotonic() - start


# ---- the protocol, written out from roundel/authwire.py's docstring (the store's magic: RNDLRDV1) ----

MAGIC = b"RNDLRDV1"


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


class RawSession:
    """A handshake done by hand, and frames built by hand, to send the server anything."""

    def __init__(self, port: int, secret: bytes):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        nonce = os.urandom(32)
        self.sock.sendall(MAGIC + struct.pack("!I", 0) + nonce)
        assert self.recv(8) == MAGIC
        server_nonce = self.recv(32)
        transcript = MAGIC + struct.pack("!I", 0) + nonce + server_nonce
        assert self.recv(32) == _mac(secret, b"roundel-wire/v1 responder proof" + transcript)
        self.sock.sendall(_mac(secret, b"roundel-wire/v1 initiator proof" + transcript))
        session = _mac(secret, b"roundel-wire/v1 session key" + transcript)
        self.c2s = _mac(session, b"roundel-wire/v1 initiator-to-responder")
        self.s2c = _mac(session, b"roundel-wire/v1 responder-to-initiator")
        self.sent = self.received = 0
        assert self.answer() == (None, b"")  # the welcome: an empty frame, the server's frame 0

    def recv(self, n: int) -> bytes:
        data = self.sock.recv(n, socket.MSG_WAITALL)
        assert len(data) == n, f"short read: {len(data)} of {n} bytes"
        return data

    def frame(self, body: bytes, seq: int | None = None) -> bytes:
        """A correctly tagged frame (with the next sequence number unless ``seq`` is given)."""
        seq = self.sent if seq is None else seq
        self.sent = seq + 1
        length = struct.pack("!I", len(body))
        return length + body + _mac(self.c2s, struct.pack("!Q", seq) + length + body)

    def answer(self) -> tuple[int | None, bytes]:
        """The next response (status, payload; None for an empty frame), checking its tag."""
        length = self.recv(4)
        body = self.recv(struct.unpack("!I", length)[0])
        assert self.recv(32) == _mac(self.s2c, struct.pack("!Q", self.received) + length + body)
        self.received += 1
        return (body[0] if body else None), body[1:]


def request(op: int, key: str, value: bytes = b"", wait: float = 0.0) -> bytes:
    raw = key.encode()
    return struct.pack("!BdI", op, wait, len(raw)) + raw + value


SET, GET = 1, 2


# ---- floods and running out of descriptors ----

def test_flood_of_idle_connections_under_a_low_fd_limit(tmp_path, secret):
    srv = ServerProcess(secret, "256", tmp_path / "server.log")
    try:
        socks = flood(srv.port, 1100)
        time.sleep(2)
        close_all(socks)
        took = assert_store_serves(srv.port, secret)
        assert srv.proc.poll() is None, srv.log()
        print(f"a fresh client was served {took:.2f} s after 1,100 idle connections were closed")
    finally:
        srv.close()


def test_accept_survives_running_out_of_descriptors(tmp_path, secret):
    srv = ServerProcess(secret, "+6", tmp_path / "server.log")  # six descriptors to spare: accept hits EMFILE
    try:
        socks = flood(srv.port, 200)
        time.sleep(3)
        close_all(socks)
        assert_store_serves(srv.port, secret, within=30)
        log = srv.log()
        failures = [line for line in log.splitlines() if "accept failed" in line]
        assert failures, f"accept never ran out of descriptors, so this test proved nothing:\n{log}"
        assert "ulimit -n" in failures[0], failures[0]
        assert len(failures) <= 3, f"failed accepts are not rate-limited:\n{log}"
    finally:
        srv.close()


def _generations(lines) -> list[tuple[int, int]]:
    """(line index, size) of every generation the elastic driver announced."""
    return [(i, int(m.group(1))) for i, line in enumerate(lines)
            if (m := re.search(r"generation \d+: (\d+) worker\(s\), ranks ", line))]


def test_elastic_job_recovers_after_its_store_is_flooded(tmp_path):
    stop = tmp_path / "stop"
    job = ElasticJob(tmp_path, "localhost:1\n127.0.0.2:1\n", str(WORKERS_DIR / "elastic_store_port.py"),
                     ["-np", "2", "--blacklist-cooldown-range", "1", "2", "--elastic-timeout", "60"],
                     {"EPOCHS": 1000, "SAMPLES": 96, "BATCH": 4, "STEP_SLEEP": 0.05, "STOP_FILE": stop})
    socks = []
    try:
        job.wait_count("COMMIT", 3, timeout=120)
        port = int(next(m.group(1) for line in job.output() if (m := re.search(r"STORE_PORT (\d+)", line))))
        hard = resource.prlimit(job.process.pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(job.process.pid, resource.RLIMIT_NOFILE, (256, hard))
        socks = flood(port, 1100)
        time.sleep(2)
        before = len(_generations(job.output()))
        job.kill("localhost:0")
        job.wait_count("was killed by signal SIGKILL", 1, timeout=60)
        time.sleep(1)
        close_all(socks)

        def recovered(lines):
            later = _generations(lines)[before:]
            return bool(later) and later[-1][1] == 2 and sum("COMMIT" in line for line in lines[later[-1][0]:]) >= 2

        job.wait_for(recovered, timeout=90, what="a new generation of 2 workers training after the kill")
        stop.touch()
        assert job.finish(timeout=90) == 0, job.describe()
    finally:
        close_all(socks)
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait(10)
    check_training(job.text(), None, 96, 4, 1 * 2 * 4 * 3 + 3 * 3)  # see test_elastic_torch._repeats_allowed


def test_elastic_scale_up_while_another_user_holds_the_stores_pre_auth_slots(tmp_path):
    """Every re-formation needs new store connections: the job grows from 1 to 2 workers while another local
    user holds more silent connections to the store than it has pre-authentication slots."""
    if os.getuid() != 0:
        pytest.skip("needs root to run the attacker as another local user (uid 65534)")
    stop = tmp_path / "stop"
    job = ElasticJob(tmp_path, "localhost:1\n", str(WORKERS_DIR / "elastic_store_port.py"),
                     ["-np", "1", "--elastic-timeout", "30"],
                     {"EPOCHS": 1000, "SAMPLES": 96, "BATCH": 4, "STEP_SLEEP": 0.05, "STOP_FILE": stop})
    attacker = None
    try:
        job.wait_count("COMMIT", 2, timeout=60)
        port = int(next(m.group(1) for line in job.output() if (m := re.search(r"STORE_PORT (\d+)", line))))
        attacker = Attacker("silent", PENDING_CAP + 4, [("127.0.0.1", port)], other_user=True)
        job.set_hosts("localhost:2\n")

        def grown(lines):
            later = [i for i, size in _generations(lines) if size == 2]
            return bool(later) and sum("COMMIT" in line for line in lines[later[-1]:]) >= 4

        job.wait_for(grown, timeout=60, what="a generation of 2 workers training while the store's slots are held")
        stop.touch()
        assert job.finish(timeout=60) == 0, job.describe()
    finally:
        reopened = attacker.stop() if attacker else 0
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait(10)
    assert reopened >= 2, f"the store closed {reopened} of the attacker's connections: the attack was not running"


# ---- slow and silent peers ----

def _slow_sender(port: int, results: list, index: int, max_bytes: int = 15) -> None:
    """Send one byte a second of an opening message; record when the server dropped us."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    start = time.monotonic()
    try:
        opening = MAGIC + struct.pack("!I", 0) + os.urandom(32)
        for i in range(max_bytes):
            sock.sendall(opening[i:i + 1])
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable and not sock.recv(4096):
                break
        else:
            wait_dropped(sock, 30)
        results[index] = time.monotonic() - start
    except (ConnectionResetError, BrokenPipeError):
        results[index] = time.monotonic() - start
    except (OSError, AssertionError):
        results[index] = None
    finally:
        sock.close()


def test_slow_senders_are_dropped_at_the_handshake_deadline(server, secret):
    count = 40  # below the cap on handshakes at once
    results: list = [None] * count
    threads = [threading.Thread(target=_slow_sender, args=(server.port, results, i)) for i in range(count)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    took = assert_store_serves(server.port, secret, within=10)
    assert took < 3, f"a real client needed {took:.1f} s while {count} slow senders were connected"
    for t in threads:
        t.join(45)
    assert None not in results, results
    assert max(results) < HANDSHAKE_DEADLINE_S + 3, f"slow senders held on for up to {max(results):.1f} s"
    assert min(results) > HANDSHAKE_DEADLINE_S - 1, f"a slow sender was dropped early ({min(results):.1f} s)"


def test_beyond_the_cap_the_longest_waiting_connection_is_evicted(server, client, secret):
    socks = []
    try:
        for _ in range(PENDING_CAP + 40):
            socks.append(socket.create_connection((server.host, server.port), timeout=10))
        closed = set()
        deadline = time.monotonic() + HANDSHAKE_DEADLINE_S * 0.8  # before any of them times out
        while len(closed) < 40 and time.monotonic() < deadline:
            readable, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.05)
            for sock in readable:
                try:
                    data = sock.recv(4096)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed.add(sock)
        assert closed == set(socks[:40]), \
            f"closed {len(closed)}, of them {len(closed & set(socks[:40]))} of the 40 that waited longest"
        # the job's own, authenticated connection is not affected
        client.set("during", b"cap")
        assert client.get("during") == b"cap"
    finally:
        close_all(socks)
    assert assert_store_serves(server.port, secret, within=15) < 10


def _listening_port(pid: int, timeout: float) -> int:
    """The one TCP port process ``pid`` listens on (roundelrun's store), once it does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        if ports:
            (port,) = ports
            return port
        time.sleep(0.05)
    raise AssertionError(f"process {pid} listened on no TCP port within {timeout:g} s")


def test_job_starts_while_another_user_holds_the_stores_pre_auth_slots(tmp_path):
    """Another local user holds more silent connections to roundelrun's store than it has pre-authentication
    slots (its port and owner are public in /proc/net/tcp), reopening each as it is closed; a 2-rank job
    still starts."""
    if os.getuid() != 0:
        pytest.skip("needs root to run the attacker as another local user (uid 65534)")
    go = tmp_path / "go"
    code = ("import roundel.torch as hvd, torch; hvd.init(); "
            "print('SUM', hvd.allreduce(torch.ones(1), op=hvd.Sum).item(), flush=True)")
    worker = f"while [ ! -e {go} ]; do sleep 0.05; done; exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    proc = subprocess.Popen([*LAUNCHER, "--start-timeout", "20", "-np", "2", "sh", "-c", worker],
                            env=clean_env({"OMP_NUM_THREADS": 1}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    attacker = None
    try:
        port = _listening_port(proc.pid, 30)
        attacker = Attacker("silent", PENDING_CAP + 4, [("127.0.0.1", port)], other_user=True)
        go.touch()  # the ranks start connecting only now, with every slot taken
        out, err = proc.communicate(timeout=60)
    finally:
        reopened = attacker.stop() if attacker else 0
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out.count("SUM 2.0") == 2, (out, err)
    assert reopened >= 2, f"the store closed {reopened} of the attacker's connections: the attack was not running"


def test_authenticated_client_silent_mid_request_is_dropped(server, client, secret):
    idle = RawSession(server.port, secret)  # says nothing between requests: must stay open
    half = RawSession(server.port, secret)
    frame = half.frame(request(SET, "half", b"value"))
    half.sock.sendall(frame[:7])
    took = wait_dropped(half.sock, FRAME_DEADLINE_S + 10)
    assert took < FRAME_DEADLINE_S + 3, f"a half-sent request held its connection for {took:.1f} s"
    idle.sock.sendall(idle.frame(request(SET, "idle", b"still here")))
    assert idle.answer() == (0, b"")
    assert server.get("idle") == b"still here" and server.get("half") is None
    channel = next(iter(client._all))  # the client's pooled connection has TCP liveness probes
    assert channel.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        assert 0 < channel.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) <= 30000


# ---- integrity of frames ----

def test_tampered_replayed_and_reordered_frames_are_dropped(server, secret):
    session = RawSession(server.port, secret)
    good = session.frame(request(SET, "a", b"1"))
    session.sock.sendall(good)
    assert session.answer() == (0, b"")
    session.sock.sendall(good)  # replayed
    wait_dropped(session.sock, 5)

    tampered = RawSession(server.port, secret)
    frame = bytearray(tampered.frame(request(SET, "a", b"2")))
    frame[-33] ^= 0x01  # the last byte of the value
    tampered.sock.sendall(frame)
    wait_dropped(tampered.sock, 5)

    tag = RawSession(server.port, secret)
    frame = bytearray(tag.frame(request(SET, "a", b"3")))
    frame[-1] ^= 0x80
    tag.sock.sendall(frame)
    wait_dropped(tag.sock, 5)

    reordered = RawSession(server.port, secret)
    reordered.sock.sendall(reordered.frame(request(SET, "a", b"4"), seq=1))
    wait_dropped(reordered.sock, 5)

    other_key = RawSession(server.port, secret)  # a frame tagged for another connection
    other_key.c2s = session.c2s
    other_key.sock.sendall(other_key.frame(request(SET, "a", b"5")))
    wait_dropped(other_key.sock, 5)

    assert server.get("a") == b"1"


class TamperingProxy:
    """Forwards one connection to the server, flipping the byte at ``flip_at`` of the server's stream."""

    def __init__(self, port: int, flip_at: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._target, self._flip_at = port, flip_at
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.listener.settimeout(30)
        downstream, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self._target), timeout=30)
        threading.Thread(target=self._pump, args=(downstream, upstream, None), daemon=True).start()
        self._pump(upstream, downstream, self._flip_at)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        offset = 0
        try:
            src.settimeout(30)
            while data := src.recv(65536):
                data = bytearray(data)
                if flip_at is not None and offset <= flip_at < offset + len(data):
                    data[flip_at - offset] ^= 0x01
                offset += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_client_rejects_a_tampered_answer(server, secret):
    # the server's handshake (its 72-byte answer, the 36-byte welcome), a length, then the status
    proxy = TamperingProxy(server.port, flip_at=72 + 36 + 4)
    try:
        c = RendezvousClient("127.0.0.1", proxy.port, secret, connect_timeout=10)
        with pytest.raises(RendezvousError, match="failed its integrity check"):
            c.set("k", b"v")
        c.close()
    finally:
        proxy.close()


# ---- a stopped server ----

def test_stopped_server_is_reported_within_the_bound(tmp_path, secret):
    srv = ServerProcess(secret, "1024", tmp_path / "server.log")
    c = RendezvousClient("127.0.0.1", srv.port, secret, connect_timeout=10)
    outcomes = {}
    try:
        c.set("before", b"1")
        assert c.get("before") == b"1"
        os.kill(srv.proc.pid, signal.SIGSTOP)
        start = time.monotonic()

        def attempt(name, call):
            try:
                call()
                outcomes[name] = ("returned", time.monotonic() - start)
            except RendezvousError as exc:
                outcomes[name] = (str(exc), time.monotonic() - start)

        calls = {"get": lambda: c.get("never"), "get(timeout=600)": lambda: c.get("never", timeout=600),
                 "set": lambda: c.set("k", b"v")}
        threads = [threading.Thread(target=attempt, args=item, daemon=True) for item in calls.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, start + DETECTION_BOUND_S + 15 - time.monotonic()))
        assert set(outcomes) == set(calls), f"still waiting on a stopped server: {sorted(set(calls) - set(outcomes))}"
        for name, (message, took) in outcomes.items():
            assert took < DETECTION_BOUND_S + 5, f"{name} took {took:.1f} s to notice"
            assert f"127.0.0.1:{srv.port}" in message, f"{name}: {message}"
            assert "still running" in message, f"{name}: {message}"
        print({name: round(took, 1) for name, (_, took) in outcomes.items()})
    finally:
        c.close()
        srv.close()


# ---- fuzz ----

def _fuzz_input(rng: random.Random, port: int, secret: bytes) -> float:
    """Send one malformed input on a new connection; return how long the server took to drop it."""
    kind = rng.randrange(9)
    if kind >= 4:  # past a correct handshake
        session = RawSession(port, secret)
        sock = session.sock
        if kind == 4:  # absurd frame length
            payload = struct.pack("!I", rng.randrange(64 * 1024 * 1024 + 64, 1 << 32))
        elif kind == 5:  # random bytes under a plausible length, random tag
            body = rng.randbytes(rng.randrange(0, 200))
            payload = struct.pack("!I", len(body)) + body + rng.randbytes(32)
        elif kind == 6:  # correctly tagged but not a request: unknown op or short header
            body = rng.randbytes(rng.randrange(0, 13)) if rng.random() < 0.5 else (
                bytes([rng.randrange(7, 256)]) + rng.randbytes(rng.randrange(12, 64)))
            payload = session.frame(body)
        elif kind == 7:  # correctly tagged request with an absurd key length
            payload = session.frame(struct.pack("!BdI", rng.randrange(1, 7), 0.0, rng.randrange(100, 1 << 32)) + b"k")
        else:  # half a frame, then nothing more
            payload = session.frame(request(SET, "x", b"y"))[:rng.randrange(1, 20)]
        start = time.monotonic()
        try:
            sock.sendall(payload)
            if kind == 8:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # already dropped
            pass
    else:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        start = time.monotonic()
        if kind == 0:  # random bytes
            payload = rng.randbytes(rng.randrange(0, 300))
        elif kind == 1:  # a truncated handshake
            payload = rng.randbytes(rng.randrange(0, 64))
        elif kind == 2:  # a proof with the wrong secret
            payload = rng.randbytes(64)
        else:  # an oversized "header" full of absurd lengths
            payload = struct.pack("!BdII", 1, -1.0, 0xFFFFFFFF, 0xFFFFFFFF) * 8
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # already dropped
            pass
    try:
        wait_dropped(sock, 10)
    finally:
        sock.close()
    return time.monotonic() - start


def test_fuzz_while_a_real_client_works(server, client, secret):
    stop = threading.Event()
    done, errors = [0], []

    def work():
        i = 0
        while not stop.is_set() and i < 100_000:
            try:
                client.set(f"k{i % 50}", str(i).encode())
                assert client.get(f"k{i % 50}", timeout=5) == str(i).encode()
                assert client.add("counter", 1) == i + 1
            except Exception as exc:  # reported below
                errors.append(repr(exc))
                return
            i += 1
            done[0] = i

    worker = threading.Thread(target=work)
    worker.start()
    rng = random.Random(1234)
    try:
        times = [_fuzz_input(rng, server.port, secret) for _ in range(1000)]
    finally:
        stop.set()
        worker.join(30)
    assert not errors, errors
    assert done[0] >= 20, f"the real client completed only {done[0]} rounds during the fuzz"
    times.sort()
    print(f"fuzz: 1000 inputs, each dropped in at most {times[-1] * 1000:.0f} ms "
          f"(median {times[500] * 1000:.1f} ms); the real client completed {done[0]} rounds")
    assert times[-1] < 3, f"an input was held for {times[-1]:.2f} s"


def test_accept_survives_failed_thread_starts(server, secret, monkeypatch, caplog):
    """The process cannot start another thread (a fault injected for the first connections only)."""
    failures = [3]
    start = threading.Thread.start

    def failing_start(thread):
        if thread.name == "roundel-rendezvous-conn" and failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("can't start new thread")
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", failing_start)
    with caplog.at_level("WARNING", logger="roundel.rendezvous.store"):
        assert assert_store_serves(server.port, secret, within=10) < 5
    assert failures == [0]
    assert "cannot start a thread" in caplog.text
