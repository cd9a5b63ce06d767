"""Control-message codec benchmark: roundel's data-only codec against pickle, side by side.

    python benchmarks/control_codec.py

For the messages the engine sends, in the steady state of training (the same
names every step, so the coordinator's batches hold the same Request objects,
with fresh Batch and Entry objects around them), it times encode + decode with
``roundel.common.control.codec`` and with pickle (protocol 5), interleaved
round by round, and prints the best round of each as microseconds per message
and their ratio (> 1: the codec is faster). Frames add an HMAC-SHA256 on top
(about 1 µs for small messages), not counted here.
"""

from __future__ import annotations

import pickle
import timeit

from roundel.common.control import codec as control_codec
from roundel.ops import ReduceOp
from roundel.common.control.messages import Dispatch, Heartbeat, Submit
from roundel.common.control.records import Batch, CachedBatch, Entry, OpKind, Request

# the parameter count of ResNet-50: its gradients fused into one batch each step
REQUESTS = [Request(f"grad.layer{i}.weight", OpKind.ALLREDUCE, 0, dtype="float32", shape=(256, 128),
                    reduce_op=int(ReduceOp.Average)) for i in range(161)]


def work(n: int) -> Dispatch:
    """What the coordinator sends each step for ``n`` newly agreed names in one fused batch."""
    entries = tuple(Entry(r.name, r, None, None, i) for i, r in enumerate(REQUESTS[:n]))
    return Dispatch(7, [Batch(OpKind.ALLREDUCE, 0, entries)], [], [])


CASES = [
    ("submit: 161 cache bits", lambda: Submit(7, (1 << 161) - 1, [], {}, [])),
    ("submit: 1 new request", lambda: Submit(7, 0, [REQUESTS[0]._replace(name="fresh")], {}, [None])),
    ("work: 1 entry", lambda: work(1)),
    ("work: 10 entries", lambda: work(10)),
    ("work: 161 entries", lambda: work(161)),
    ("work: 161 cached entries", lambda: Dispatch(7, [CachedBatch(OpKind.ALLREDUCE, 0, (1 << 161) - 1)], [], [])),
    ("heartbeat", lambda: Heartbeat("node-17")),
]


def best_us(function, number: int, rounds: int) -> list[float]:
    return [t / number * 1e6 for t in timeit.repeat(function, number=number, repeat=rounds)]


def main() -> None:
    print("| message | bytes (codec / pickle) | codec µs | pickle µs | ratio |")
    print("|---|---|---|---|---|")
    for name, make in CASES:
        message = make()
        assert control_codec.decode(control_codec.encode(message)) == message
        number = 200 if "161" in name else 2000
        codec, plain, baseline = [], [], []
        for _ in range(7):  # interleaved so that background load hits both alike
            codec += best_us(lambda: control_codec.decode(control_codec.encode(make())), number, 1)
            plain += best_us(lambda: pickle.loads(pickle.dumps(make(), protocol=5)), number, 1)
            baseline += best_us(make, number, 1)
        codec_us, pickle_us = min(codec) - min(baseline), min(plain) - min(baseline)
        sizes = f"{len(control_codec.encode(message))} / {len(pickle.dumps(message, protocol=5))}"
        print(f"| {name} | {sizes} | {codec_us:.1f} | {pickle_us:.1f} | {pickle_us / codec_us:.2f} |")


if __name__ == "__main__":
    main()
