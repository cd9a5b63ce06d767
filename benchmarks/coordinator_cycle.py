"""The coordinator's work per cycle against the number of names in the response cache and of ranks.

In the steady state rank 0 matches each name from every rank's cache bits
(its own included), plans the fused batches and their bit-mask form. This
times that cycle, in one process (no sockets), for a fixed set of hot names
while the cache holds more and more other names (the cost should not grow with
the cache), and while the job has more and more ranks (it should grow no
faster than the ranks: each rank's bit costs the same). Also times encoding
one step's reply for ResNet-50's 161 tensors in full and as a ``CachedBatch``.

    python benchmarks/coordinator_cycle.py [--ranks 2,16,128,1024]
"""

from __future__ import annotations

import argparse
import time

from roundel.common.control import codec as control_codec
from roundel.common.control.messages import Dispatch
from roundel.common.engine.negotiation import Negotiator
from roundel.common.control.records import Batch, CachedBatch, Entry, OpKind, Request


def cycle_us(cached: int, hot: int, reps: int, ranks: int = 2) -> float:
    """Microseconds per cycle in which ``hot`` names arrive as every rank's mask of cache bits."""
    negotiator = Negotiator(ranks, cached + hot)
    requests = [Request(f"grad.{i}", OpKind.ALLREDUCE, 0, "float32", (256,)) for i in range(cached + hot)]
    for request in requests:
        for rank in range(ranks):
            negotiator.submit(rank, request, 0.0)
    bits = {e.name: e.cache_bit for _, batch in negotiator.take(1 << 30) for e in batch.entries}
    negotiator.take_evictions()
    mask = sum(1 << bits[request.name] for request in requests[:hot])
    start = time.perf_counter()
    for _ in range(reps):
        version = negotiator.cache.version
        own = 0  # rank 0's own requests' bits, found as the engine's coordinator finds them
        for request in requests[:hot]:
            own |= 1 << negotiator.cache.bit_of((request.process_set_id, request.name), 0, request)
        negotiator.submit_bits(0, own, version, 1.0)
        for rank in range(1, ranks):  # each rank's frame: one mask of its cached names' bits
            negotiator.submit_bits(rank, mask, version, 1.0)
        for _, batch in negotiator.take(1 << 30):
            negotiator.compact_form(batch)
        negotiator.take_evictions()
    return (time.perf_counter() - start) / reps * 1e6


def encode_us(message, reps: int = 2000) -> tuple[float, int]:
    start = time.perf_counter()
    for _ in range(reps):
        data = control_codec.encode(message)
    return (time.perf_counter() - start) / reps * 1e6, len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hot", type=int, default=10, help="names submitted per cycle (default 10)")
    parser.add_argument("--reps", type=int, default=300, help="cycles timed per cache size (default 300)")
    parser.add_argument("--ranks", default="2,16,128,1024", help="rank counts of the second table")
    args = parser.parse_args()
    print(f"| names in the cache | µs per cycle of {args.hot} names |\n| ---: | ---: |")
    for cached in (10, 1_000, 10_000):
        print(f"| {cached + args.hot:,} | {cycle_us(cached, args.hot, args.reps):.0f} |")
    print(f"\n| ranks | ms per cycle of {args.hot} names | µs per rank |\n| ---: | ---: | ---: |")
    for ranks in (int(n) for n in args.ranks.split(",")):
        micros = cycle_us(0, args.hot, max(3, args.reps * 2 // ranks), ranks)
        print(f"| {ranks:,} | {micros / 1000:.2f} | {micros / ranks:.1f} |")
    requests = [Request(f"allreduce.grad.layer{i}.weight", OpKind.ALLREDUCE, 0, "float32", (256, 256, 3, 3))
                for i in range(161)]
    full = Batch(OpKind.ALLREDUCE, 0, tuple(Entry(r.name, r, cache_bit=i) for i, r in enumerate(requests)))
    compact = CachedBatch(OpKind.ALLREDUCE, 0, (1 << 161) - 1)
    print("\n| one step's reply, 161 tensors | bytes | µs to encode |\n| --- | ---: | ---: |")
    for label, batch in (("in full", full), ("as cache bits", compact)):
        micros, size = encode_us(Dispatch(1, [batch], [], []))
        print(f"| {label} | {size:,} | {micros:.1f} |")


if __name__ == "__main__":
    main()
