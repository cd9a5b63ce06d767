"""The control channel between each rank's engine and the coordinator (issue 10).

Covered (the codec itself is tested in test_control_codec.py): mutual
authentication (a rank refuses a fake coordinator, and never unpickles what
one sends); per-frame integrity (tampered, replayed, reordered and spliced
frames drop the connection); sending without blocking (both ends at
once, a peer that stops reading, the last messages before close); the
coordinator's listener under slow, silent, stalled and over-the-limit connections;
and, under the real launcher, a running job that is flooded with idle
connections while its coordinator runs out of file descriptors, and one
fuzzed with 1,000 junk inputs: results stay exact, a rank-like client still
gets an answer promptly, and the log stays short.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import pickle
import queue
import random
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch_util import LAUNCHER, WORKERS_DIR, clean_env, rank_lines
from preauth_attacker import Attacker
from roundel.common.control import channel as control_channel
from roundel.ops import ReduceOp
from roundel.common.control.records import Batch, Entry, OpKind, Request

SECRET = b"s" * 32
PROTOCOL_MAGIC = b"RNDLCTL1"  # the coordinator's reply starts with it
REQUEST = Request("grad.layer1.weight", OpKind.ALLREDUCE, 0, dtype="float32", shape=(256, 128),
                  reduce_op=ReduceOp.Average)
ENGINE_MESSAGES = [
    ("submit", 4, (1 << 700) | 5, [REQUEST], []),
    ("work", 9, [Batch(OpKind.ALLREDUCE, 0, (Entry(REQUEST.name, REQUEST, cache_bit=12),))], [3], [(8, 1)]),
    ("heartbeat", "node-17.example"),
    ("abort", "rank 2 died"),
    ("bye",),
]


# ------------------------------------------------- a fake coordinator and a rank
def _until_the_peer_closes(sock: socket.socket, seconds: float) -> None:
    """Read (and drop) what the peer sends until it closes its end, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return
        except socket.timeout:
            return


def _serve_once(behaviour) -> tuple[int, threading.Thread]:
    """A one-connection server on 127.0.0.1 running ``behaviour(sock)``; returns its port and thread."""
    server = socket.create_server(("127.0.0.1", 0))

    def run():
        with server:
            server.settimeout(10)
            sock, _ = server.accept()
            with sock:
                sock.settimeout(5)
                try:
                    behaviour(sock)
                    _until_the_peer_closes(sock, 1.0)  # let the rank read everything before the connection closes
                except OSError:
                    pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


def _rank_against(port: int) -> Exception | None:
    """What a rank's engine does: connect to the coordinator, then read and decode frames for 2 s."""
    try:
        connection = control_channel.connect("127.0.0.1", port, SECRET, 1, 3.0)
    except OSError as exc:
        return exc
    try:
        reader = control_channel.FrameReader(connection)
    except TypeError:  # roundel before mutual authentication: FrameReader() took no connection
        reader = control_channel.FrameReader()
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            if select.select([connection], [], [], 0.1)[0]:
                data = connection.recv(65536)
                if not data:
                    break
                reader.feed(data)
    finally:
        connection.close()
    return None


class _CreatesMarker:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


def _pickle_frame(marker) -> bytes:
    payload = pickle.dumps(("work", _CreatesMarker(marker)), protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!I", len(payload)) + payload


def _sends_pickle_at_once(marker):
    def behaviour(sock):
        sock.sendall(_pickle_frame(marker))
    return behaviour


def _fakes_the_old_handshake_then_sends_pickle(marker):
    """Sends a nonce, takes whatever proof comes, says "ok", then sends a pickled frame."""
    def behaviour(sock):
        sock.sendall(os.urandom(32))
        sock.recv(36)
        sock.sendall(b"ok" + _pickle_frame(marker))
    return behaviour


def _forges_a_proof_then_sends_pickle(marker):
    """Speaks the protocol but does not hold the secret: random nonce and proof, then pickle."""
    def behaviour(sock):
        sock.recv(44)
        sock.sendall(PROTOCOL_MAGIC + os.urandom(64))
        sock.recv(32)
        sock.sendall(_pickle_frame(marker))
    return behaviour


@pytest.mark.parametrize("fake", [_sends_pickle_at_once, _fakes_the_old_handshake_then_sends_pickle,
                                  _forges_a_proof_then_sends_pickle])
def test_rank_refuses_a_fake_coordinator_and_never_unpickles(tmp_path, fake):
    marker = tmp_path / "unpickled"
    port, server = _serve_once(fake(marker))
    started = time.monotonic()
    error = _rank_against(port)
    server.join(10)
    assert not marker.exists(), "the rank unpickled what a fake coordinator sent (it ran its code)"
    assert isinstance(error, control_channel.AuthenticationError), repr(error)
    assert ("could not prove it holds this job's secret" in str(error)
            or "does not speak roundel's control protocol" in str(error)), str(error)
    assert time.monotonic() - started < 5


def test_an_authenticated_pickle_frame_is_dropped_not_unpickled(tmp_path, caplog):
    # even a peer holding the secret cannot make a rank unpickle: frames are control_codec data only
    marker = tmp_path / "unpickled"

    def behaviour(sock):
        coordinator = control_channel.handshake(sock, SECRET, time.monotonic() + 3, time.monotonic() + 3)
        payload = pickle.dumps(("work", _CreatesMarker(marker)))
        header = struct.pack("!I", len(payload))
        tag = hmac.new(coordinator._send_key, struct.pack("!Q", 1) + header + payload, hashlib.sha256).digest()
        sock.sendall(header + payload + tag)

    port, server = _serve_once(behaviour)
    assert _rank_against(port) is None
    server.join(10)
    assert not marker.exists()
    assert "is not a valid control message" in caplog.text and "treating that peer as lost" in caplog.text


def test_a_rank_with_another_secret_is_refused_both_ways():
    accepted = queue.SimpleQueue()
    listener = control_channel.Listener("127.0.0.1", SECRET, accepted.put)
    try:
        with pytest.raises(control_channel.AuthenticationError, match="could not prove"):
            control_channel.connect("127.0.0.1", listener.port, b"x" * 32, 1, 5.0)
        # a client that skips checking the coordinator still cannot prove the secret itself
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as sock:
            sock.sendall(PROTOCOL_MAGIC + struct.pack("!I", 1) + os.urandom(32))
            reply = _read_until_closed(sock, 5)
            assert reply.startswith(PROTOCOL_MAGIC) and len(reply) == 72
            sock.sendall(os.urandom(32))
            assert _read_until_closed(sock, 5) == b""  # closed without a welcome
        assert accepted.empty()
    finally:
        listener.close()


def _read_until_closed(sock: socket.socket, timeout: float, limit: int = 72) -> bytes:
    """Bytes until the peer closes, ``limit`` bytes arrive, or ``timeout`` s pass."""
    data = b""
    deadline = time.monotonic() + timeout
    while len(data) < limit and time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(limit - len(data))
        except (socket.timeout, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


# -------------------------------------------------------------- local socket
def test_a_rank_on_the_coordinators_host_joins_over_its_local_socket():
    accepted = queue.SimpleQueue()
    listener = control_channel.Listener("127.0.0.1", SECRET, accepted.put)
    try:
        assert listener.local_name and listener.local_name.startswith("roundel-control-")
        rank_side = control_channel.connect("127.0.0.1", listener.port, SECRET, 2, 5.0,
                                            local_name=listener.local_name)
        coordinator_side = accepted.get(timeout=5)
        assert rank_side._sock.family == socket.AF_UNIX and coordinator_side.rank == 2
        assert coordinator_side.peer == "a local socket"
        for message in ENGINE_MESSAGES:
            rank_side.send(message)
            coordinator_side.send(message)
        for receiver in (coordinator_side, rank_side):
            reader = control_channel.FrameReader(receiver)
            assert reader.feed(b"".join(_raw_frame(receiver) for _ in ENGINE_MESSAGES)) == ENGINE_MESSAGES
        rank_side.close()
        assert select.select([coordinator_side], [], [], 5)[0] and coordinator_side.recv(100) == b""
        coordinator_side.close()
    finally:
        listener.close()
    with pytest.raises(OSError):  # closed with the listener
        control_channel._local_connection(listener.local_name, 1.0)


def test_the_local_socket_demands_the_secret_as_tcp_does():
    accepted = queue.SimpleQueue()
    listener = control_channel.Listener("127.0.0.1", SECRET, accepted.put)
    try:
        with pytest.raises(control_channel.AuthenticationError, match="could not prove"):
            control_channel.connect("127.0.0.1", listener.port, b"x" * 32, 1, 5.0, local_name=listener.local_name)
        with control_channel._local_connection(listener.local_name, 5.0) as sock:  # a wrong proof
            sock.sendall(PROTOCOL_MAGIC + struct.pack("!I", 1) + os.urandom(32))
            assert _read_until_closed(sock, 5).startswith(PROTOCOL_MAGIC)
            sock.sendall(os.urandom(32))
            assert _read_until_closed(sock, 5) == b""  # closed without a welcome
        assert accepted.empty()
    finally:
        listener.close()


def test_a_local_socket_out_of_reach_leaves_the_rank_on_tcp():
    accepted = queue.SimpleQueue()
    listener = control_channel.Listener("127.0.0.1", SECRET, accepted.put)
    try:  # as for a rank in another network namespace of the same host: nothing listens under that name
        rank_side = control_channel.connect("127.0.0.1", listener.port, SECRET, 1, 5.0,
                                            local_name="roundel-control-" + "0" * 32)
        assert rank_side._sock.family == socket.AF_INET and accepted.get(timeout=5).rank == 1
        rank_side.close()
    finally:
        listener.close()


# ----------------------------------------------------------- frame integrity
def _pair(secret=SECRET, rank=1, local=False, send_timeout_s=control_channel.SEND_TIMEOUT_S):
    """A Listener and a rank connected to it (over TCP, or the local socket when ``local``):
    (listener, rank's connection, coordinator's connection)."""
    accepted = queue.SimpleQueue()
    listener = control_channel.Listener("127.0.0.1", secret, accepted.put)
    rank_side = control_channel.connect("127.0.0.1", listener.port, secret, rank, 5.0, send_timeout_s=send_timeout_s,
                                        local_name=listener.local_name if local else None)
    return listener, rank_side, accepted.get(timeout=5)


def _raw(connection, count: int) -> bytes:
    """``count`` bytes as they arrive on ``connection`` (not yet checked)."""
    data = b""
    deadline = time.monotonic() + 5
    while len(data) < count and time.monotonic() < deadline:
        if select.select([connection], [], [], 0.1)[0]:
            data += connection.recv(count - len(data))
    assert len(data) == count
    return data


def _raw_frame(connection) -> bytes:
    """One whole frame (length, payload, MAC) as it arrives on ``connection``."""
    header = _raw(connection, 4)
    return header + _raw(connection, struct.unpack("!I", header)[0] + 32)


def test_messages_flow_both_ways():
    listener, rank_side, coordinator_side = _pair()
    try:
        assert coordinator_side.rank == 1 and rank_side.rank == 0
        for message in ENGINE_MESSAGES:
            rank_side.send(message)
            coordinator_side.send(message)
        for receiver in (coordinator_side, rank_side):
            reader = control_channel.FrameReader(receiver)
            received = b"".join(_raw_frame(receiver) for _ in ENGINE_MESSAGES)
            assert reader.feed(received) == ENGINE_MESSAGES
    finally:
        for item in (rank_side, coordinator_side, listener):
            item.close()


def _tampered(first: bytes, second: bytes, other: bytes) -> dict[str, bytes]:
    flipped = bytearray(first)
    flipped[len(first) // 2] ^= 0x01
    return {"a flipped payload bit": bytes(flipped),
            "a flipped MAC bit": first[:-1] + bytes([first[-1] ^ 0x80]),
            "a replayed frame": first + first,
            "frames out of order": second + first,
            "a frame from another connection": other,
            "a frame cut short and padded": first[:-10] + b"\x00" * 10,
            "a huge length": struct.pack("!I", 0xFFFFFFFF) + first[4:]}


@pytest.mark.parametrize("case", list(_tampered(b"x" * 64, b"y" * 64, b"z" * 64)))
def test_tampered_replayed_reordered_or_spliced_frames_drop_the_connection(case, caplog):
    listener, rank_side, coordinator_side = _pair()
    other_listener, other_rank, other_coordinator = _pair()
    try:
        first, second = ("submit", 1, 5, [REQUEST], []), ("submit", 1, 6, [], [])
        rank_side.send(first)
        rank_side.send(second)
        other_rank.send(first)
        first_raw = _raw_frame(coordinator_side)
        second_raw = _raw_frame(coordinator_side)
        other_raw = _raw_frame(other_coordinator)
        data = _tampered(first_raw, second_raw, other_raw)[case]
        reader = control_channel.FrameReader(coordinator_side)
        messages = reader.feed(data)
        assert messages in ([], [first]), messages  # a replay or reordering may pass only the genuine first
        assert "treating that peer as lost" in caplog.text
        assert reader.feed(first_raw) == []  # nothing more is read from a dropped connection
        assert coordinator_side.recv(100) == b""  # shut down: the engine's select sees a lost peer
        assert select.select([rank_side], [], [], 5)[0] and rank_side.recv(100) == b""  # and so does the rank
    finally:
        for item in (rank_side, coordinator_side, listener, other_rank, other_coordinator, other_listener):
            item.close()


# ------------------------------------------------------- sending never blocks
BIG = ("heartbeat", "x" * 16_000_000)  # more than the kernel's socket buffers hold


def _exchange(connections, expected: list[int], timeout: float = 30) -> list[list]:
    """Serve ``connections`` as the engine does (flush when writable, read when readable) until each
    has received its ``expected`` number of messages; returns what each received."""
    readers = [control_channel.FrameReader(connection) for connection in connections]
    received = [[] for _ in connections]
    deadline = time.monotonic() + timeout
    while any(len(messages) < count for messages, count in zip(received, expected)):
        assert time.monotonic() < deadline, [len(messages) for messages in received]
        writable = [connection for connection in connections if connection.pending]
        readable, writable, _ = select.select(connections, writable, [], 0.5)
        for connection in writable:
            connection.flush()
        for connection in readable:
            index = connections.index(connection)
            received[index] += readers[index].feed(connection.recv(control_channel.RECV_BYTES))
    return received


ON_BOTH_SOCKETS = pytest.mark.parametrize("local", [False, True], ids=["tcp", "local-socket"])


@ON_BOTH_SOCKETS
def test_both_ends_send_megabytes_at_once_without_waiting_for_the_other_to_read(local):
    # each end's engine sends first and reads later, on one thread: a blocking send waited for the
    # other end to read, which was itself blocked in its send (a deadlock until the send timeout)
    listener, rank_side, coordinator_side = _pair(local=local)
    try:
        assert rank_side._sock.family == (socket.AF_UNIX if local else socket.AF_INET)
        rank_side.send(BIG)
        coordinator_side.send(BIG)
        rank_side.send(ENGINE_MESSAGES[0])
        assert rank_side.pending and coordinator_side.pending  # queued, not waited for
        to_coordinator, to_rank = _exchange([coordinator_side, rank_side], [2, 1])
        assert to_rank == [BIG]
        assert to_coordinator == [BIG, ENGINE_MESSAGES[0]]
        assert not rank_side.pending and not coordinator_side.pending
    finally:
        for item in (rank_side, coordinator_side, listener):
            item.close()


@ON_BOTH_SOCKETS
def test_a_peer_that_stops_reading_is_dropped_after_the_send_timeout(local):
    listener, rank_side, coordinator_side = _pair(local=local, send_timeout_s=1.0)  # the coordinator never reads
    try:
        rank_side.send(BIG)
        started = time.monotonic()
        with pytest.raises(OSError, match="took none of .* queued bytes for 1 s"):
            while time.monotonic() - started < 10:
                select.select([], [rank_side], [], 0.2)
                rank_side.flush()
        assert time.monotonic() - started < 5
        assert select.select([rank_side], [], [], 5)[0] and rank_side.recv(100) == b""  # shut down: seen as lost
    finally:
        for item in (rank_side, coordinator_side, listener):
            item.close()


@ON_BOTH_SOCKETS
def test_drain_writes_out_the_last_messages_before_close(local):
    listener, rank_side, coordinator_side = _pair(local=local)
    received = []
    reader = threading.Thread(target=lambda: received.extend(_exchange([coordinator_side], [2])[0]), daemon=True)
    try:
        rank_side.send(BIG)
        rank_side.send(("bye",))
        reader.start()
        assert rank_side.drain(time.monotonic() + 30)
        rank_side.close()
        reader.join(30)
        assert received == [BIG, ("bye",)]
    finally:
        for item in (rank_side, coordinator_side, listener):
            item.close()


# ------------------------------------------------------ the listener's limits
def _closed_while_trickling(sock: socket.socket, data: bytes, started: float) -> float | None:
    """Send ``data`` a byte a second; seconds from ``started`` until the peer closed (None if it never did)."""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return time.monotonic() - started
        if select.select([sock], [], [], 1.0)[0] and _read_until_closed(sock, 0.1) == b"":
            return time.monotonic() - started
    return None


def test_slow_senders_are_dropped_at_the_deadline():
    listener = control_channel.Listener("127.0.0.1", SECRET, lambda connection: None)
    hello = PROTOCOL_MAGIC + struct.pack("!I", 1) + os.urandom(32)
    try:
        # the opening message at one byte a second: dropped after HELLO_DEADLINE_S
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as trickle:
            closed_after = _closed_while_trickling(trickle, hello, time.monotonic())
            assert closed_after is not None and closed_after <= control_channel.HELLO_DEADLINE_S + 1.5, closed_after
        # a quick opening, then the proof at one byte a second: dropped at HANDSHAKE_DEADLINE_S overall
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as trickle:
            started = time.monotonic()
            trickle.sendall(hello)
            assert len(_read_until_closed(trickle, 5)) == 72
            closed_after = _closed_while_trickling(trickle, os.urandom(32), started)
            deadline = control_channel.HANDSHAKE_DEADLINE_S
            assert closed_after is not None and deadline - 0.5 <= closed_after <= deadline + 1.5, closed_after
    finally:
        listener.close()


def test_silent_connections_do_not_delay_a_joining_rank():
    accepted = queue.SimpleQueue()
    listener = control_channel.Listener("127.0.0.1", SECRET, accepted.put)
    silent = []
    try:
        # more silent connections than handshakes may run at once
        for _ in range(control_channel.MAX_HANDSHAKES + 20):
            silent.append(socket.create_connection(("127.0.0.1", listener.port), timeout=5))
        started = time.monotonic()
        rank_side = control_channel.connect("127.0.0.1", listener.port, SECRET, 3, 10.0)
        joined_after = time.monotonic() - started
        assert accepted.get(timeout=5).rank == 3
        rank_side.close()
        assert joined_after < control_channel.HELLO_DEADLINE_S + 2.0, joined_after
    finally:
        for sock in silent:
            sock.close()
        listener.close()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "local-socket"])
def test_handshakes_stalled_after_the_opening_do_not_keep_a_rank_out(local):
    """More connections than handshake slots send an opening message (no secret needed) and stall, and are
    reopened as soon as they are closed; a real rank still joins in about a second."""
    accepted = queue.SimpleQueue()
    listener = control_channel.Listener("127.0.0.1", SECRET, accepted.put)
    target = f"@{listener.local_name}" if local else ("127.0.0.1", listener.port)
    if local and listener.local_name is None:
        listener.close()
        pytest.skip("no abstract Unix socket on this platform")
    attacker = Attacker("opening", control_channel.MAX_HANDSHAKES + 8, [target], other_user=False)
    try:
        time.sleep(0.5)
        started = time.monotonic()
        rank_side = control_channel.connect("127.0.0.1", listener.port, SECRET, 1, 10.0,
                                            local_name=listener.local_name if local else None)
        joined_after = time.monotonic() - started
        assert accepted.get(timeout=5).rank == 1
        assert rank_side.peer.startswith("local socket") == local, rank_side.peer
        rank_side.close()
    finally:
        reopened = attacker.stop()
        listener.close()
    assert joined_after < control_channel.HELLO_DEADLINE_S + 1.5, joined_after
    assert reopened >= 1, "the coordinator dropped none of the stalled connections: the attack was not running"


# --------------------------------------------------- a running job, attacked
class _RunningJob:
    """``roundelrun -np 2 python control_loop.py`` in the background, its output collected as it comes."""

    def __init__(self, tmp_path, *worker_args):
        self.stop_file = tmp_path / "stop"
        command = [*LAUNCHER, "-np", "2", sys.executable, str(WORKERS_DIR / "control_loop.py"), str(self.stop_file),
                   "90", *map(str, worker_args)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=clean_env())
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def control_port(self, timeout: float = 90) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in rank_lines(self.text, 0, "stdout"):
                if line.startswith("CONTROL PORT "):
                    return int(line.split()[2])
            assert self.process.poll() is None, f"the job ended early:\n{self.text}"
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"rank 0 printed no CONTROL PORT within {timeout} s:\n{self.text}")

    def finish(self, timeout: float = 60) -> str:
        self.stop_file.touch()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not finish within {timeout} s of being told to stop:\n{self.text}")
        self._reader.join(10)
        return self.text

    def kill(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # roundelrun stops its ranks on SIGTERM
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _assert_exact_results(job: _RunningJob, text: str) -> None:
    assert job.process.returncode == 0, text
    for rank in (0, 1):
        lines = rank_lines(text, rank, "stdout")
        assert lines.count("CHECKS PASSED loop") == 1, text
        assert any(line.startswith("STEPS ") and int(line.split()[1]) > 0 for line in lines), text


def _coordinator_answers(port: int, within: float) -> float:
    """Seconds until a rank-like client gets the coordinator's reply, retrying when it is turned away."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as probe:
                probe.sendall(PROTOCOL_MAGIC + struct.pack("!I", 1) + os.urandom(32))
                if _read_until_closed(probe, 2, limit=8):
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.1)
    return math.inf


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"this test opens 1,100 sockets; the open-file hard limit is only {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_job_survives_a_flood_of_idle_connections_while_out_of_file_descriptors(tmp_path, many_fds):
    # rank 0 caps its open files at 12 more than it uses, so the flood makes accept() fail with EMFILE
    job = _RunningJob(tmp_path, "--spare-fds", 12)
    flood = []
    try:
        port = job.control_port()
        for _ in range(1100):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            flood.append(sock)
        answered_after = _coordinator_answers(port, within=15)
        assert answered_after < 5, f"no answer from the coordinator during the flood\n{job.text}"
    except BaseException:
        job.kill()
        raise
    finally:
        for sock in flood:
            sock.close()
    text = job.finish()
    _assert_exact_results(job, text)
    rank0 = rank_lines(text, 0)
    assert any("could not accept connections" in line and "Too many open files" in line for line in rank0), text
    assert len([line for line in rank0 if "roundel coordinator" in line]) <= 8, text


def _fuzz_input(index: int, port: int) -> bool:
    """Send junk input number ``index``; True if it reached the coordinator (connected)."""
    kind = index % 8
    rng = random.Random(index)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    except OSError:
        return False
    with sock:
        try:
            _send_junk(sock, kind, rng)
        except OSError:
            pass  # the coordinator may hang up before all of it is sent
    return True


def _send_junk(sock: socket.socket, kind: int, rng: random.Random) -> None:
    hello = PROTOCOL_MAGIC + struct.pack("!I", rng.choice([0, 1, 2, 7, 0xFFFFFFFF])) + rng.randbytes(32)
    if kind == 0:
        sock.sendall(rng.randbytes(rng.randint(1, 300)))
    elif kind == 1:  # a handshake cut short
        sock.sendall(hello[:rng.randint(1, len(hello) - 1)])
    elif kind == 2:  # a wrong proof
        sock.sendall(hello)
        _read_until_closed(sock, 2)
        sock.sendall(rng.randbytes(32))
    elif kind == 3:  # a frame header announcing 4 GiB, in place of the handshake
        sock.sendall(b"\xff\xff\xff\xff" + rng.randbytes(rng.randint(0, 64)))
    elif kind == 4:  # a wrong proof followed by a huge frame
        sock.sendall(hello)
        _read_until_closed(sock, 2)
        sock.sendall(rng.randbytes(32) + struct.pack("!I", 0xFFFFFFF0) + rng.randbytes(100))
    elif kind == 5:  # the right magic, then junk
        sock.sendall(PROTOCOL_MAGIC + rng.randbytes(rng.randint(0, 200)))
    elif kind == 6:  # reset at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # kind 7: connect and close without a word


def test_job_survives_a_fuzz_of_its_control_port_and_logs_little(tmp_path):
    job = _RunningJob(tmp_path)
    try:
        port = job.control_port()
        with ThreadPoolExecutor(8) as pool:
            reached = sum(pool.map(lambda i: _fuzz_input(i, port), range(1000)))
        assert reached > 900, f"only {reached} of 1,000 fuzz inputs could connect"
        assert _coordinator_answers(port, within=10) < 5, job.text
    except BaseException:
        job.kill()
        raise
    text = job.finish()
    refusals = [line for line in rank_lines(text, 0) if "refused" in line]
    assert 1 <= len(refusals) <= 6, f"{len(refusals)} lines about refused connections:\n" + "\n".join(refusals[:20])
    assert len(rank_lines(text, 0, "stderr")) <= 12, text
    _assert_exact_results(job, text)
