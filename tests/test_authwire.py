"""roundel.authwire: the one handshake under the store and the control channel, its frames, and its bounds.

Both roles run over a socketpair. The attacks (a wrong secret, a reflected
proof, a replayed proof, a proof moved to another claim or service) are built
from the layout in authwire's docstring.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time

import pytest

from roundel import authwire

SECRET = b"k" * 32
MAGIC = b"TESTWIR1"


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _in_thread(function, *args):
    """Run ``function(*args)`` on a thread; returns a callable giving its result or raising its exception."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result():
        thread.join(10)
        assert not thread.is_alive()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
    return result


def _respond(sock, secret=SECRET, magic=MAGIC):
    deadline = time.monotonic() + 5
    return authwire.answer(sock, secret, authwire.read_opening(sock, magic, deadline), deadline)


def _initiate(sock, secret=SECRET, claim=7, magic=MAGIC):
    """The initiator's side; on failure it stops sending, as its callers do by closing the socket."""
    try:
        return authwire.initiate(sock, secret, magic, claim, time.monotonic() + 5)
    except BaseException:
        sock.shutdown(socket.SHUT_WR)
        raise


def test_both_roles_agree_on_keys_and_sequences_and_frames_check():
    a, b = socket.socketpair()
    with a, b:
        initiator = _in_thread(_initiate, a)
        responder = _respond(b)
        initiator = initiator()
    assert responder.claim == initiator.claim == 7
    assert initiator.send_key == responder.recv_key and initiator.recv_key == responder.send_key
    assert initiator.send_key != initiator.recv_key  # one key per direction
    assert (initiator.send_sequence, initiator.recv_sequence) == (0, 1)  # the welcome was the responder's 0
    assert (responder.send_sequence, responder.recv_sequence) == (1, 0)
    header = authwire.HEADER.pack(5)
    tag = authwire.frame_tag(initiator.send_key, 0, header, b"hello")
    assert authwire.frame_ok(responder.recv_key, 0, header, b"hello", tag)
    assert not authwire.frame_ok(responder.recv_key, 1, header, b"hello", tag)  # replayed as the next frame
    assert not authwire.frame_ok(responder.recv_key, 0, header, b"hellO", tag)  # altered
    assert not authwire.frame_ok(initiator.recv_key, 0, header, b"hello", tag)  # reflected to its sender


def test_a_session_is_new_each_time():
    keys = set()
    for _ in range(2):
        a, b = socket.socketpair()
        with a, b:
            initiator = _in_thread(_initiate, a)
            keys.add(_respond(b).send_key)
            initiator()
    assert len(keys) == 2


def test_a_wrong_secret_fails_both_sides():
    a, b = socket.socketpair()
    with a, b:
        initiator = _in_thread(_initiate, a, b"w" * 32)
        with pytest.raises(authwire.HandshakeError):  # the initiator gave up without a proof
            _respond(b)
        with pytest.raises(authwire.ProofFailed, match="responder's proof is wrong"):
            initiator()
    # an initiator that ignores the responder's proof and answers anyway is refused, and gets no welcome
    a, b = socket.socketpair()
    with a, b:
        responder = _in_thread(_respond, b)
        a.sendall(MAGIC + struct.pack("!I", 7) + os.urandom(32))
        assert a.recv(authwire.ANSWER_BYTES, socket.MSG_WAITALL)[:8] == MAGIC
        a.sendall(_mac(b"w" * 32, b"anything"))
        with pytest.raises(authwire.ProofFailed, match="failed to prove"):
            responder()
        b.close()
        a.settimeout(5)
        assert a.recv(100) == b""


def _raw_answer(sock, claim=7):
    """Open by hand: (initiator nonce, responder nonce, responder proof)."""
    nonce = os.urandom(32)
    sock.sendall(MAGIC + struct.pack("!I", claim) + nonce)
    reply = sock.recv(authwire.ANSWER_BYTES, socket.MSG_WAITALL)
    assert reply[:8] == MAGIC
    return nonce, reply[8:40], reply[40:]


def test_a_reflected_proof_is_rejected():
    """The responder's own proof sent back as the initiator's: the role labels tell them apart."""
    a, b = socket.socketpair()
    with a, b:
        responder = _in_thread(_respond, b)
        nonce, their_nonce, their_proof = _raw_answer(a)
        transcript = MAGIC + struct.pack("!I", 7) + nonce + their_nonce
        assert their_proof == _mac(SECRET, authwire.RESPONDER_PROOF + transcript)  # the layout as documented
        a.sendall(their_proof)
        with pytest.raises(authwire.ProofFailed):
            responder()


def test_a_fake_responder_reflecting_the_opening_learns_nothing():
    """A peer without the secret echoes the initiator's own nonce back: it cannot make a responder proof,
    and the initiator never sends its own proof."""
    a, b = socket.socketpair()
    with a, b:
        initiator = _in_thread(_initiate, a)
        opening = b.recv(authwire.OPENING_BYTES, socket.MSG_WAITALL)
        b.sendall(MAGIC + opening[-32:] + os.urandom(32))
        with pytest.raises(authwire.ProofFailed):
            initiator()
        b.settimeout(2)
        assert b.recv(100) == b""  # the initiator stopped without sending its proof


def _recorded_handshake() -> tuple[bytes, bytes]:
    """The opening and the proof of a genuine handshake, as one who watched the wire recorded them."""
    initiator_end, relay_in = socket.socketpair()
    relay_out, responder_end = socket.socketpair()
    with initiator_end, relay_in, relay_out, responder_end:
        initiator = _in_thread(_initiate, initiator_end)
        responder = _in_thread(_respond, responder_end)
        opening = relay_in.recv(authwire.OPENING_BYTES, socket.MSG_WAITALL)
        relay_out.sendall(opening)
        relay_in.sendall(relay_out.recv(authwire.ANSWER_BYTES, socket.MSG_WAITALL))
        proof = relay_in.recv(authwire.TAG_BYTES, socket.MSG_WAITALL)
        relay_out.sendall(proof)
        relay_in.sendall(relay_out.recv(authwire.WELCOME_BYTES, socket.MSG_WAITALL))
        initiator()
        responder()
    return opening, proof


def test_a_recorded_handshake_cannot_be_replayed():
    """The responder's fresh nonce makes a recorded proof worthless."""
    opening, proof = _recorded_handshake()
    a, b = socket.socketpair()
    with a, b:
        responder = _in_thread(_respond, b)
        a.sendall(opening)
        assert len(a.recv(authwire.ANSWER_BYTES, socket.MSG_WAITALL)) == authwire.ANSWER_BYTES
        a.sendall(proof)
        with pytest.raises(authwire.ProofFailed):
            responder()


@pytest.mark.parametrize("rewrite", ["claim", "magic"])
def test_a_relay_cannot_move_a_handshake_to_another_claim_or_service(rewrite):
    """A peer in the middle (without the secret) relays a real initiator's handshake to a real responder,
    changing the claimed rank or the service's magic on the way: the initiator refuses the answer."""
    initiator_end, relay_in = socket.socketpair()
    relay_out, responder_end = socket.socketpair()
    other_magic = b"OTHERSV1"

    def responder_side():
        deadline = time.monotonic() + 5
        magic = other_magic if rewrite == "magic" else MAGIC
        return authwire.answer(responder_end, SECRET, authwire.read_opening(responder_end, magic, deadline), deadline)

    with initiator_end, relay_in, relay_out, responder_end:
        initiator = _in_thread(_initiate, initiator_end)
        responder = _in_thread(responder_side)
        opening = bytearray(relay_in.recv(authwire.OPENING_BYTES, socket.MSG_WAITALL))
        if rewrite == "claim":
            opening[8:12] = struct.pack("!I", 8)
        else:
            opening[:8] = other_magic
        relay_out.sendall(opening)
        reply = relay_out.recv(authwire.ANSWER_BYTES, socket.MSG_WAITALL)
        relay_in.sendall(MAGIC + reply[8:])  # the answer, its magic put back
        with pytest.raises(authwire.ProofFailed):
            initiator()
        relay_out.shutdown(socket.SHUT_WR)  # nothing more to relay: the initiator sent no proof
        assert relay_in.recv(100) == b""
        with pytest.raises(authwire.HandshakeError):
            responder()


def test_another_protocol_is_refused_on_its_first_bytes():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"GET / HTTP/1.1\r\n")
        started = time.monotonic()
        with pytest.raises(authwire.NotThisProtocol):
            authwire.read_opening(b, MAGIC, time.monotonic() + 5)
        assert time.monotonic() - started < 1


def test_recv_exact_holds_its_deadline_however_slowly_bytes_trickle_in():
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.1):
            a.sendall(b"x")
    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    started = time.monotonic()
    try:
        with pytest.raises(authwire.TimedOut) as info:
            authwire.recv_exact(b, 100, time.monotonic() + 0.5, "the test's bytes")
        assert 0.4 < time.monotonic() - started < 1.5
        assert 0 < len(info.value.received) < 100 and isinstance(info.value, TimeoutError)
    finally:
        stop.set()
        sender.join(5)  # closing its socket under it would fail its next send
        a.close()
        b.close()


def test_a_closed_responder_is_refused_and_a_close_after_the_proof_is_unwelcome():
    a, b = socket.socketpair()
    b.close()
    with a, pytest.raises(authwire.Refused):
        _initiate(a)
    a, b = socket.socketpair()
    with a, b:
        initiator = _in_thread(_initiate, a)
        opening = b.recv(authwire.OPENING_BYTES, socket.MSG_WAITALL)
        with pytest.raises(authwire.HandshakeError, match="dropped to make room"):
            authwire.answer(b, SECRET, opening, time.monotonic() + 5, proven=lambda: False)
        b.close()
        with pytest.raises(authwire.Unwelcome):
            initiator()


def test_pending_connections_make_way_for_newcomers():
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        pending = authwire.PendingConnections(2, patience_s=60)
        assert pending.admit(pairs[0][0]) == (True, False)
        assert pending.admit(pairs[1][0]) == (True, False)
        assert pending.admit(pairs[2][0], spoke=False) == (False, False)  # silent, and the oldest is young
        assert pending.admit(pairs[3][0], spoke=True) == (True, True)  # the oldest was shut down for it
        pairs[0][1].settimeout(1)
        assert pairs[0][1].recv(1) == b""
        assert not pending.release(pairs[0][0]) and pending.release(pairs[1][0])
        assert pending.displace_oldest() and not pending.displace_oldest()
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()


def test_rate_limited_log_counts_what_it_holds_back(caplog):
    limited = authwire.RateLimitedLog(logging.getLogger("roundel.test"), "the test refused connections", 60)
    with caplog.at_level("WARNING", logger="roundel.test"):
        for i in range(5):
            limited.note("turned away", f"peer {i}")
        limited.note("failed handshakes", "peer 9")
        limited.flush()
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["the test refused connections: 1 turned away (latest: peer 0)",
                     "the test refused connections in the last 0 s: 1 failed handshakes; 4 turned away"]
