"""Worker for tests/test_secrets.py: ``python secrets_worker.py MODE DIR``.

Modes:
* ``hold``: init, then write ``DIR/ready.<rank>`` (this process's pid) and wait
  for ``DIR/go`` (the test probes the job meanwhile), then check an allreduce.
* ``forge``: rank 0 sends raw pickles that would create ``DIR/pwned`` through
  the low-level collectives under the names ``broadcast_object`` and
  ``allgather_object`` use, while rank 1 calls those functions; rank 1 must
  refuse them, and the real functions must still work afterwards.
"""

import os
import pickle
import resource
import sys
import time
from pathlib import Path

import torch

import roundel.torch as hvd

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


def expect_refusal(call) -> None:
    try:
        value = call()
    except RuntimeError as exc:
        assert "failed authentication" in str(exc) and "refusing to unpickle" in str(exc), exc
        print("REFUSED", str(exc).splitlines()[0], flush=True)
        return
    raise AssertionError(f"a forged object was accepted: {value!r}")


def forge(rank: int) -> None:
    evil = pickle.dumps(CreatesMarker())
    wrong_tag = evil + os.urandom(32)  # the shape of a sealed object, with a tag made without the key
    for name, payload in (("plain", evil), ("signed", wrong_tag)):
        if rank == 0:  # an injected payload, as it would arrive over Gloo
            hvd.broadcast_(torch.tensor([len(payload)], dtype=torch.int64), 0, name=f"broadcast_object.{name}.size")
            hvd.broadcast_(raw(payload), 0, name=f"broadcast_object.{name}.data")
        else:
            expect_refusal(lambda: hvd.broadcast_object(None, root_rank=0, name=name))
    if rank == 0:
        hvd.allgather(torch.tensor([len(evil)], dtype=torch.int64), name="allgather_object.gathered.size")
        hvd.allgather(raw(evil), name="allgather_object.gathered.data")
    else:
        expect_refusal(lambda: hvd.allgather_object({"rank": rank}, name="gathered"))
    assert not (DIR / "pwned").exists(), "the forged pickle ran"
    # the real thing still works, in both directions
    assert hvd.broadcast_object({"from": rank, "lr": 0.1} if rank == 1 else None, root_rank=1,
                                name="real") == {"from": 1, "lr": 0.1}
    assert hvd.allgather_object(("rank", rank), name="real") == [("rank", r) for r in range(hvd.size())]
    print("CHECKS PASSED forge", flush=True)


def main() -> None:
    hvd.init()
    {"hold": hold, "forge": forge}[MODE](hvd.rank())
    hvd.shutdown()


if __name__ == "__main__":
    main()
