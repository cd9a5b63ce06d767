"""Worker for tests/test_secrets.py: ``python secrets_worker.py MODE DIR``.

Modes:
* ``hold``: init, then write ``DIR/ready.<rank>`` (this process's pid) and wait
  for ``DIR/go`` (the test probes the job meanwhile), then check an allreduce.
* ``forge``: rank 0 sends raw pickles that would create ``DIR/pwned``, and a
  forged size record announcing 2**62 bytes, through the low-level
  collectives under the names ``broadcast_object`` and ``allgather_object``
  use, while rank 1 calls those functions; rank 1 must refuse them, and the
  real functions must still work afterwards.
* ``replay``: rank 0 sends again what it sent for an earlier call (and, after
  a new ``init()``, for a call of the last one); rank 1 must refuse it.
"""

import os
import pickle
import resource
import struct
import sys
import time
from pathlib import Path

import torch

import roundel.torch as hvd
from roundel.common import basics, object_auth, objects

MODE, DIR = sys.argv[1], Path(sys.argv[2])
WAIT_S = 90


class CreatesMarker:
    """Unpickling this opens (creates) the marker file: stands for any code an attacker would run."""

    def __reduce__(self):
        return open, (str(DIR / "pwned"), "w")


def raw(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def hold(rank: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"NOFILE {soft} {hard}", flush=True)
    hvd.allreduce(torch.ones(1), name="warmup")
    (DIR / f"ready.{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + WAIT_S
    while not (DIR / "go").exists():
        assert time.monotonic() < deadline, "the test never said go"
        time.sleep(0.05)
    for step in range(20):
        result = hvd.allreduce(torch.arange(1000, dtype=torch.float64) * (rank + 1 + step), op=hvd.Sum,
                               name=f"step{step}")
        expected = torch.arange(1000, dtype=torch.float64) * sum(r + 1 + step for r in range(hvd.size()))
        assert torch.equal(result, expected), (step, result[:5], expected[:5])
    print("CHECKS PASSED hold", flush=True)


def expect_refusal(call, what: str = "failed authentication") -> None:
    try:
        value = call()
    except RuntimeError as exc:
        assert what in str(exc) and "refusing to unpickle" in str(exc), exc
        print("REFUSED", str(exc).splitlines()[0], flush=True)
        return
    raise AssertionError(f"a forged object was accepted: {value!r}")


def seal_for(name: str) -> objects._Seal:
    """The seal of rank 0's next call ``name``, as the real root makes it (counts that call on this rank)."""
    return objects._Seal(basics.runtime(), hvd.global_process_set, name)


def forge(rank: int) -> None:
    evil = pickle.dumps(CreatesMarker())
    wrong_seal = evil + os.urandom(object_auth.SEAL_BYTES)  # the shape of a sealed object, sealed without the key
    for name, payload in (("plain", evil), ("signed", wrong_seal)):
        if rank == 0:  # the root's genuine size record, then an injected payload, as it would arrive over Gloo
            hvd.broadcast_(seal_for(f"broadcast_object.{name}").size_record(0, len(payload)), 0,
                           name=f"broadcast_object.{name}.size")
            hvd.broadcast_(raw(payload), 0, name=f"broadcast_object.{name}.data")
        else:
            expect_refusal(lambda: hvd.broadcast_object(None, root_rank=0, name=name))
    # a forged size record announcing 2**62 bytes: refused before anything is allocated
    forged = raw(struct.pack("!Q", 1 << 62) + os.urandom(object_auth.SEAL_BYTES))
    if rank == 0:
        hvd.broadcast_(forged, 0, name="broadcast_object.huge.size")
        hvd.allgather(forged, name="allgather_object.gathered.size")
    else:
        expect_refusal(lambda: hvd.broadcast_object(None, root_rank=0, name="huge"))
        expect_refusal(lambda: hvd.allgather_object({"rank": rank}, name="gathered"))
    assert not (DIR / "pwned").exists(), "the forged pickle ran"
    real(rank)
    print("CHECKS PASSED forge", flush=True)


def real(rank: int) -> None:
    """The real thing works, in both directions."""
    assert hvd.broadcast_object({"from": rank, "lr": 0.1} if rank == 1 else None, root_rank=1,
                                name="real") == {"from": 1, "lr": 0.1}
    assert hvd.allgather_object(("rank", rank), name="real") == [("rank", r) for r in range(hvd.size())]


def replay(rank: int) -> None:
    """Rank 0 replays what it sent for an earlier call (as an eavesdropper on the network could)."""
    sent = []
    if rank == 0:
        record, message = objects._Seal.size_record, objects._Seal.message
        objects._Seal.size_record = lambda *a: sent.append(record(*a).clone()) or sent[-1].clone()
        objects._Seal.message = lambda *a: sent.append(message(*a).clone()) or sent[-1].clone()
    assert hvd.broadcast_object({"epoch": 1} if rank == 0 else None, name="state") == {"epoch": 1}
    if rank == 0:  # call 2: a genuine size record, then call 1's bytes
        old_record, old_message = sent[1], sent[0]
        hvd.broadcast_(seal_for("broadcast_object.state").size_record(0, old_message.numel()), 0,
                       name="broadcast_object.state.size")
        hvd.broadcast_(old_message.clone(), 0, name="broadcast_object.state.data")
        seal_for("broadcast_object.state")  # call 3: call 1's size record
        hvd.broadcast_(old_record.clone(), 0, name="broadcast_object.state.size")
    else:
        expect_refusal(lambda: hvd.broadcast_object(None, name="state"), "was replayed: it was sent for call 1")
        expect_refusal(lambda: hvd.broadcast_object(None, name="state"), "was replayed: it was sent for call 1")
    hvd.shutdown()
    hvd.init()
    if rank == 0:  # call 1 of the next init(): the last one's call 1, bytes and all
        hvd.broadcast_(old_record.clone(), 0, name="broadcast_object.state.size")
    else:
        expect_refusal(lambda: hvd.broadcast_object(None, name="state"), "replayed from an earlier init()")
    real(rank)
    print("CHECKS PASSED replay", flush=True)


def main() -> None:
    hvd.init()
    {"hold": hold, "forge": forge, "replay": replay}[MODE](hvd.rank())
    hvd.shutdown()


if __name__ == "__main__":
    main()
