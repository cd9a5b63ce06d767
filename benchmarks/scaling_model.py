"""Alpha-beta cost models of roundel's allreduce and control plane, fitted to measurements, and what they predict.

    python benchmarks/scaling_model.py             # fit benchmarks/measurements/{2core,16core}.json, predict
    python benchmarks/scaling_model.py --measurements a.json b.json --plot model.png --json model.json
    python benchmarks/scaling_model.py --collect OUT.json    # measure this machine first (minutes)
    python benchmarks/scaling_model.py --gpu                 # ResNet-50 on GPU hosts over NCCL instead

A measurements file is JSON of the form ``benchmarks/scaling.py`` writes::

    {"cores": 2, "copy_bandwidth_bytes_per_s": {"2": ...},
     "allreduce": [{"np": N, "bytes": S, "roundel_s": ..., "raw_s": ...}, ...],
     "training": [{"np": N, "model": "mlp", "roundel_sps": ..., "ddp_sps": ..., "single_sps": ...}, ...]}

and may also hold ``gloo_allreduce`` (the same records with roundel on Gloo,
``ROUNDEL_SHARED_MEMORY=0``), ``control`` (``{"np", "cycle_ms",
"rank0_cpu_ms_per_step"}`` from ``control_scale.py`` without relays, and
``{"np", "relays": true, "coordinator_cpu_ms_per_step"}`` with them), ``hierarchical``
(``{"hosts", "ranks_per_host", "bytes", "link_bits_per_s", "seconds"}``) and,
in a training record, ``ceiling_sps`` and ``batch_size`` (default 32, the
``--quick`` default of ``torch_training.py``). Other fields (``floor_s``,
``copy_bandwidth_bytes_per_s``, ``machine``, ``date``) are carried but not
used. Files of the same core count are one machine; each machine is fitted
on its own.

The models, for N ranks, S bytes per rank, on a machine of C cores, with
``q = max(1, N / C)`` ranks per core, ``p = max(1, 2 N / C)`` Gloo threads per
core and ``m = min(N, C)`` ranks moving bytes at once:

* coordinator-reduced allreduces (S up to ``coordinator_reduce_bytes``, 4 KiB
  by default, in both the shared-memory and the Gloo records):
  ``t = q (k0 + k1 N)``. The data go with the control message: one round trip
  (k0), and rank 0's coordinator takes a request from each rank and sends each
  a reply (k1 N). No transport call.
* shared memory, larger sizes: ``t = q (a0 + w W log2 N + M (b0 + b1 m))``. a0:
  the call's negotiation round trip and hand-off. W waits, each ``log2 N``
  messages per member (``HostBarrier``), w a message. M the bytes a rank reads
  and writes, by the algorithm's two regimes (``shared_memory.py``): up to
  1 MiB every member combines the whole tensor after one wait (W = 1; copy in
  2 S, read the N slots N S, write the result S: M = (N + 3) S); above, a
  reduce-scatter and allgather in pieces of 4 MiB (P pieces, W = P + 1; copy
  in 2 S, reduce its share S + S/N, copy out 2 S: M = (5 + 1/N) S). The cost
  per byte grows as the m ranks moving bytes at once share the memory system
  (b1), fitted only where m varies (not on a 2-core machine measured at 2-4
  ranks). With q ranks per core everything is done q times over.
* Gloo's ring (raw ``torch.distributed``, the same algorithm at every size):
  ``t = p 2(N-1) (alpha + S/N beta)``: 2(N-1) steps, each a latency and a chunk
  of S/N bytes. A Gloo collective keeps two threads of each rank busy (the
  process group's worker runs the algorithm and the reductions, Gloo's event
  loop reads the sockets), so from N = C/2 ranks they wait for cores: p.
* roundel on Gloo, larger sizes: ``t = e + gloo(N, S)``: ``e`` is what roundel
  adds to a call (its negotiation and hand-off), ``gloo`` roundel's Gloo
  transport with the ring's alpha and beta: one allgather, ``p (N-1) (alpha +
  S beta)``, while each member receives at most 256 KiB ((N-1) S <= 256 KiB,
  N <= elements), else the ring.
* control round trip: ``t = c0 + c1 N``, the steady negotiation of 161
  cached names (``control_scale.py``, every rank connected to rank 0);
  rank 0's CPU per step is fitted the same way. From ``relay_from_ranks``
  ranks (the setting's default) jobs run through relays, and the round trip
  is ``t = r0 + r1 N + 2 D h``: ``r0 + r1 N`` is rank 0's coordinator thread's
  CPU per step, fitted to simulations with relays (the serial part: the
  simulated ranks' own work, which a real job spreads over its cores, is
  not in it), D the relay tree's depth for N ranks on hosts of
  ``--ranks-per-host`` (a rank, its host's relay, the relays above at
  ``relay_fanout`` to a level, rank 0's host's relay, rank 0), and h the
  cost of one hop: a relay's handling of the message, fitted as
  ``t = c + 2 D h`` to real jobs whose relays form a chain
  (``relay_hops.py``), plus, for the D - 2 hops between hosts, the hop
  across hosts below. A machine without relayed or chain records borrows
  the fits of one that has them.
* hierarchical (L ranks per host, H hosts): local reduce to the host's leader,
  the leaders' ring across hosts, local broadcast:
  ``t = shm(L, S) + e + 2(H-1) alpha_hop + 2(H-1)/H S / B_link``. Not fitted:
  composed from the fits above (the local reduce and broadcast are costed as
  one shared-memory allreduce of S, which moves the same bytes); checked
  against the file's ``hierarchical`` records, if any, where the cross-host
  cost per byte is the slower of the link and the fitted Gloo.
* training step: ``t = compute + control(N) + comm + copy - hidden``, ``comm``
  the allreduce of the gradients in ``--bucket-mib`` buckets (shared memory
  for roundel, the ring for DDP), ``copy`` the step's copies of its G bytes
  of gradients in memory, 2 G bytes each at the shared-memory fit's cost per
  byte: roundel one (``zero_grad()`` sets ``.grad`` to None, so the
  ``DistributedOptimizer`` copies each new gradient into its bucket), DDP two
  (by default it copies into its buckets and back). ``hidden = min(f comm,
  backward)``: a fraction f (``--overlap``) of it runs during backward, taken
  as 2/3 of the compute. Scaling efficiency is compute / step (each rank
  keeps its batch). Checked against the measured steps with the compute of
  the ``ceiling`` run (N processes training at once, no communication) where
  there is one, else the single process's; with f = 0 (on a CPU the
  reductions share the cores and memory of backward); and without the control
  term (a bucket's negotiation is in a0; DDP negotiates nothing).

The fits are least squares on relative residuals; each prints its
parameters and its largest relative error over the measured points (and
where), against the target of 20 %. Predictions use the fits of the machine
with the most cores, 8 ranks on a host (a core each) joined by 25 and 100
Gbit/s links: cross-host cost per byte 1/B_link (the transport is assumed to
keep up with the link), per hop the fitted Gloo alpha plus
``--hop-latency-us``. Compute per step: ResNet-50 from ``--resnet-step-ms``
(an assumption, see its help), the MLP of ``torch_training.py`` measured
single-rank.

``--gpu`` predicts ResNet-50 on GPU hosts instead (``--gpus-per-host``, 8 by
default): ``t = compute + engine + control(N) + comm - hidden``. ``comm`` is
NCCL's allreduce of the buckets, ``lat + 2 (N-1)/N S / busbw`` per bucket
(nccl-tests' bus bandwidth): on one host the host's NVLink/NVSwitch figure,
across H hosts the smaller of it and the hosts' NICs together (NICs x line
rate x ``--nic-efficiency``), with ``lat = host + 2 log2(H) net`` from NCCL's
own tuning model. ``engine`` is roundel's gradient path per step as measured
on one H100 (roundel against the same training without communication),
``control(N)`` the control round trip of the fits above, paid once a step for
the last bucket. Overlap with backward was not measured on a GPU, so each
step is given at two bounds: none (``hidden = 0``), and every bucket but the
last hidden under backward (``hidden = min((B-1) t_bucket, 2/3 compute)``).
Two hosts are built in, each with the sources of its figures beside
``GPU_HOSTS``: an A100 host (compute from NVIDIA's published ResNet-50 table,
8 x 200 and 1 x 100 Gbit/s) and an H100 host (compute measured here on one
H100, 8 x 400 and 1 x 100 Gbit/s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from roundel.common.settings import Settings
from roundel.transport.gloo import GATHER_BYTES  # one allgather while each member receives at most this
from roundel.transport.shared_memory import DIRECT_BYTES, SLOT_BYTES as PIECE_BYTES  # whole, then in pieces

BENCHMARKS = Path(__file__).resolve().parent
DEFAULT_MEASUREMENTS = [BENCHMARKS / "measurements" / name
                        for name in ("2core.json", "2core-relays.json", "16core.json")]
COORDINATOR_BYTES = Settings().coordinator_reduce_bytes  # reduced by rank 0's coordinator, no transport call
GRADIENT_COPIES = {"roundel": 1, "ddp": 2}  # copies of all the gradients a training step makes in memory
RESNET50_PARAMS = 25_557_032
BACKWARD_SHARE = 2 / 3  # backward's share of a step's compute, the window gradients can reduce in
TARGET_ERROR = 0.20
# "Horovod achieves 90% scaling efficiency for both Inception V3 and ResNet-101" on "128 servers with 4 Pascal GPUs
# each connected by RoCE-capable 25 Gbit/s network" (https://github.com/horovod/horovod#why-horovod)
HOROVOD = {"ranks": 512, "efficiency": 0.90,
           "label": "Horovod's README: ResNet-101 and Inception V3, 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE"}
ALLREDUCE_SIZES = "4K,256K,1M,4M,16M,64M"  # 64 MiB: beyond many machines' L3 caches
RELAY_FROM_RANKS, RELAY_FANOUT = Settings().relay_from_ranks, Settings().relay_fanout


# ---------------------------------------------------------------- fitting
def relative_fit(columns: list, measured, offset=None) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares coefficients c of ``measured ~ offset + sum(c_i * columns_i)``, on relative residuals.

    Returns (c, each point's relative error |model - measured| / measured).
    Raises ValueError when there are fewer points than coefficients.
    """
    measured = np.asarray(measured, dtype=float)
    offset = np.zeros_like(measured) if offset is None else np.asarray(offset, dtype=float)
    design = np.column_stack([np.asarray(c, dtype=float) for c in columns])
    if len(measured) < design.shape[1]:
        raise ValueError(f"{len(measured)} point(s) cannot fit {design.shape[1]} parameter(s)")
    coefficients = np.linalg.lstsq(design / measured[:, None], (measured - offset) / measured, rcond=None)[0]
    return coefficients, np.abs(offset + design @ coefficients - measured) / measured


def per_core(ranks, cores) -> np.ndarray:
    """q = max(1, N / C): ranks sharing each core."""
    return np.maximum(1.0, np.asarray(ranks, dtype=float) / np.asarray(cores, dtype=float))


def gloo_per_core(ranks, cores) -> np.ndarray:
    """p = max(1, 2 N / C): Gloo's busy threads per core, two per rank (the process group's worker, which runs
    the algorithm and the reductions, and Gloo's event loop, which reads the sockets)."""
    return per_core(2 * np.asarray(ranks, dtype=float), cores)


def shm_waits(nbytes) -> np.ndarray:
    """W: waits of a shared-memory allreduce of ``nbytes``: 1 up to ``DIRECT_BYTES``, else one per piece and one
    more (``_reduce_pieces``)."""
    nbytes = np.asarray(nbytes, dtype=float)
    return np.where(nbytes <= DIRECT_BYTES, 1.0, np.ceil(nbytes / PIECE_BYTES) + 1)


def shm_moved(ranks, nbytes) -> np.ndarray:
    """M: bytes one rank reads and writes in a shared-memory allreduce of ``nbytes``.

    Combined whole (up to ``DIRECT_BYTES``): S read and S written copying in, N S read combining the N slots,
    S written (the result): (N + 3) S. In pieces: 2 S copying in, S read and S / N written reducing its share,
    2 S copying out: (5 + 1/N) S.
    """
    n, nbytes = np.asarray(ranks, dtype=float), np.asarray(nbytes, dtype=float)
    return np.where(nbytes <= DIRECT_BYTES, (n + 3) * nbytes, (5 + 1 / n) * nbytes)


def gathered(ranks, nbytes) -> np.ndarray:
    """Whether roundel's Gloo transport runs an allreduce of ``nbytes`` (float32) among ``ranks`` as one
    allgather: (N - 1) S <= ``GATHER_BYTES`` and N <= its elements."""
    n, nbytes = np.asarray(ranks, dtype=float), np.asarray(nbytes, dtype=float)
    return ((n - 1) * nbytes <= GATHER_BYTES) & (n <= nbytes / 4)


def _where(record: dict) -> str:
    """A measured point, for the reader: ``N = 4, 16 MiB`` (``N = 64`` without a size)."""
    if "bytes" not in record:
        return f"N = {record['np']}"
    size = record["bytes"]
    unit = next((u, s) for u, s in (("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)) if size >= s)
    return f"N = {record['np']}, {size / unit[1]:g} {unit[0]}"


def _errors(errors: np.ndarray, records: list) -> dict:
    """The error figures of a fit: largest, where, how many points within the target, of how many."""
    worst = int(np.argmax(errors))
    return {"error": float(errors[worst]), "worst": _where(records[worst]),
            "within_target": int(np.sum(errors <= TARGET_ERROR)), "points": len(records)}


def relay_hops(ranks: int, per_host: int, fanout: int = RELAY_FANOUT) -> int:
    """Hops from the farthest rank to rank 0 in the relay tree of ``ranks`` on hosts of ``per_host``: to its
    host's relay, from host c's relay to host (c - 1) // fanout's until rank 0's host's, then to rank 0
    (as ``relay.parent_key``)."""
    host, hops = max(0, math.ceil(ranks / per_host) - 1), 2  # to the host's relay, and from rank 0's host's up
    while host > 0:
        host, hops = (host - 1) // fanout, hops + 1
    return hops


def _at_once(ranks, cores) -> np.ndarray:
    """m = min(N, C): ranks moving bytes at the same time."""
    return np.minimum(np.asarray(ranks, dtype=float), np.asarray(cores, dtype=float))


class Models:
    """One machine's fitted parameters (seconds, seconds per byte) and the cost of each operation from them."""

    def __init__(self, data: dict):
        """Fit every model ``data`` (one machine's measurements, see ``load``) has points for.

        Raises ValueError when the shared-memory or ring fit has too few points.
        """
        self.cores = data["cores"]
        self.fits = {}
        calls = data["allreduce"] + data["gloo_allreduce"]
        small = [r for r in calls if r["bytes"] <= COORDINATOR_BYTES and r.get("roundel_s")]
        if len(small) >= 2:
            n = np.array([r["np"] for r in small], dtype=float)
            q = per_core(n, self.cores)
            (k0, k1), errors = relative_fit([q, q * n], [r["roundel_s"] for r in small])
            self.fits["coordinator"] = {"k0_s": k0, "k1_s_per_rank": k1, **_errors(errors, small)}
        shm = [r for r in data["allreduce"] if r["bytes"] > COORDINATOR_BYTES and r.get("roundel_s")]
        n, size = np.array([r["np"] for r in shm], dtype=float), np.array([r["bytes"] for r in shm], dtype=float)
        q, m, moved = per_core(n, self.cores), _at_once(n, self.cores), shm_moved(n, size)
        contention = len(set(m)) > 1  # b1 is only told apart from b0 when m varies
        columns = [q, q * shm_waits(size) * np.log2(n), q * moved] + ([q * moved * m] if contention else [])
        values, errors = relative_fit(columns, [r["roundel_s"] for r in shm])
        self.fits["shm"] = {"a0_s": values[0], "wait_s": values[1], "b0_s_per_byte": values[2],
                            "b1_s_per_byte_per_rank": values[3] if contention else 0.0,
                            "contention_fitted": contention, **_errors(errors, shm)}
        raw = [r for r in calls if r.get("raw_s")]
        n, size = np.array([r["np"] for r in raw], dtype=float), np.array([r["bytes"] for r in raw], dtype=float)
        p = gloo_per_core(n, self.cores)
        (alpha, beta), errors = relative_fit([p * 2 * (n - 1), p * 2 * (n - 1) / n * size], [r["raw_s"] for r in raw])
        self.fits["ring"] = {"alpha_s": alpha, "beta_s_per_byte": beta, **_errors(errors, raw)}
        gloo = [r for r in data["gloo_allreduce"] if r["bytes"] > COORDINATOR_BYTES and r.get("roundel_s")]
        if gloo:
            (e,), errors = relative_fit([np.ones(len(gloo))], [r["roundel_s"] for r in gloo],
                                        offset=[self.gloo(r["np"], r["bytes"]) for r in gloo])
            self.fits["roundel_gloo"] = {"e_s": e, **_errors(errors, gloo)}
        for key, field, relays in (("control", "cycle_ms", False), ("control_cpu", "rank0_cpu_ms_per_step", False),
                                   ("control_relayed", "coordinator_cpu_ms_per_step", True)):
            rows = [r for r in data["control"] if r.get(field) and bool(r.get("relays")) == relays]
            if len(rows) >= 2:
                (c0, c1), errors = relative_fit([np.ones(len(rows)), [r["np"] for r in rows]],
                                                [r[field] / 1e3 for r in rows])
                self.fits[key] = {"c0_s": c0, "c1_s_per_rank": c1, **_errors(errors, rows)}
        chains = data.get("relay_chain", [])
        if len(chains) >= 2:
            (c, h), errors = relative_fit([np.ones(len(chains)), [2 * r["depth"] for r in chains]],
                                          [r["chain_ms"] / 1e3 for r in chains])
            self.fits["relay_hop"] = {"c_s": c, "hop_s": h, **_errors(errors, chains)}

    def per_byte(self, ranks: int, cores: float | None = None) -> float:
        """Seconds per byte a rank reads or writes in memory (the shared-memory fit's b0 + b1 m), with
        ``min(ranks, cores)`` ranks doing so at once."""
        f = self.fits["shm"]
        return f["b0_s_per_byte"] + f["b1_s_per_byte_per_rank"] * float(_at_once(ranks, cores or self.cores))

    def shm(self, ranks: int, nbytes: float, cores: float | None = None) -> float:
        """Seconds of a shared-memory allreduce of ``nbytes`` per rank among ``ranks`` on ``cores`` cores
        (default: the measured machine's)."""
        f, cores = self.fits["shm"], cores or self.cores
        waits = float(shm_waits(nbytes)) * math.log2(ranks)
        return float(per_core(ranks, cores)) * (f["a0_s"] + f["wait_s"] * waits
                                                + float(shm_moved(ranks, nbytes)) * self.per_byte(ranks, cores))

    def copy(self, ranks: int, nbytes: float, cores: float | None = None) -> float:
        """Seconds for each of ``ranks`` ranks on ``cores`` cores to copy ``nbytes`` in memory at once (read
        and write them, at ``per_byte``)."""
        cores = cores or self.cores
        return float(per_core(ranks, cores)) * 2 * nbytes * self.per_byte(ranks, cores)

    def ring_per_byte(self, ranks: int, cores: float | None = None) -> float:
        """Gloo's fitted seconds per byte moved, with ``gloo_per_core(ranks, cores)`` of its threads per core."""
        return float(gloo_per_core(ranks, cores or self.cores)) * self.fits["ring"]["beta_s_per_byte"]

    def _gloo_steps(self, ranks: int, steps: int, chunk: float, cores: float | None) -> float:
        """Seconds of ``steps`` Gloo steps of ``chunk`` bytes each among ``ranks`` on ``cores`` cores."""
        f = self.fits["ring"]
        return float(gloo_per_core(ranks, cores or self.cores)) * steps * (f["alpha_s"] + chunk * f["beta_s_per_byte"])

    def ring(self, ranks: int, nbytes: float, cores: float | None = None) -> float:
        """Seconds of Gloo's ring allreduce on one machine of ``cores`` cores (default: the measured one's)."""
        return self._gloo_steps(ranks, 2 * (ranks - 1), nbytes / ranks, cores)

    def gloo(self, ranks: int, nbytes: float, cores: float | None = None) -> float:
        """Seconds of roundel's Gloo transport's allreduce: one allgather (N - 1 steps of S bytes) where
        ``gathered``, else Gloo's ring."""
        if not gathered(ranks, nbytes):
            return self.ring(ranks, nbytes, cores)
        return self._gloo_steps(ranks, ranks - 1, nbytes, cores)

    def engine(self) -> float:
        """Seconds roundel's engine adds to a call on Gloo (0 without ``gloo_allreduce`` measurements)."""
        return self.fits.get("roundel_gloo", {}).get("e_s", 0.0)

    def control(self, ranks: int, hop_s: float = 0.0, per_host: int = 8) -> float:
        """Seconds of the steady negotiation round trip at ``ranks`` (0 without ``control`` measurements):
        through relays from ``RELAY_FROM_RANKS`` where there is a relayed fit, each hop costing a relay's
        handling (the ``relay_hop`` fit, if any) and, between hosts, ``hop_s``."""
        relayed = self.fits.get("control_relayed")
        if relayed is not None and ranks >= RELAY_FROM_RANKS:
            hops = relay_hops(ranks, per_host)
            handling = self.fits.get("relay_hop", {}).get("hop_s", 0.0)
            return (relayed["c0_s"] + relayed["c1_s_per_rank"] * ranks
                    + 2 * (hops * handling + (hops - 2) * hop_s))
        fit = self.fits.get("control")
        return 0.0 if fit is None else fit["c0_s"] + fit["c1_s_per_rank"] * ranks

    def hierarchical(self, hosts: int, per_host: int, nbytes: float, cores: float, link_bytes_per_s: float,
                     hop_s: float, transport_s_per_byte: float = 0.0) -> float:
        """Seconds of the hierarchical allreduce: local reduce + leaders' ring + local broadcast.

        ``cores`` is the cores per host; the cross-host cost per byte is the larger of the link's and
        ``transport_s_per_byte`` (0: the transport keeps up with the link); ``hop_s`` the latency per step.
        """
        cross_per_byte = max(1.0 / link_bytes_per_s, transport_s_per_byte)
        cross = 2 * (hosts - 1) * hop_s + 2 * (hosts - 1) / hosts * nbytes * cross_per_byte
        return self.shm(per_host, nbytes, cores) + self.engine() + cross


# ---------------------------------------------------------------- measurements
def load(paths: list) -> dict:
    """Measurement files grouped by machine (files of the same core count are merged): {cores: data}.

    Raises ValueError for a machine without allreduce records.
    """
    machines = {}
    for path in paths:
        record = json.loads(Path(path).read_text())
        cores = int(record["cores"])
        data = machines.setdefault(cores, {"cores": cores, "allreduce": [], "gloo_allreduce": [], "training": [],
                                           "control": [], "hierarchical": [], "relay_chain": [], "sources": []})
        data["sources"].append(f"{path} ({record.get('machine', 'machine not stated')}; "
                               f"{record.get('date', 'date not stated')})")
        for key in ("allreduce", "gloo_allreduce", "training", "control", "hierarchical", "relay_chain"):
            data[key] += record.get(key, [])
    for cores, data in machines.items():
        if not data["allreduce"]:
            raise ValueError(f"no allreduce records for the {cores}-core machine in " + ", ".join(data["sources"]))
    return machines


def mlp_gradient_bytes() -> int:
    """Bytes of float32 gradients of ``torch_training.py``'s mlp (its ``build``, 1000 classes)."""
    sys.path.insert(0, str(BENCHMARKS))
    from torch_training import build  # imports torch
    model, _ = build("mlp", 1000)
    return 4 * sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- training steps
def step_time(ranks: int, nbytes: float, compute_s: float, overlap: float, bucket_bytes: float, allreduce,
              control_s: float, copy_s: float) -> dict:
    """The step's parts (seconds): compute, control, comm, copy, hidden, step; ``allreduce(ranks, bytes)`` costs
    a bucket, ``control_s`` is the step's negotiation beyond the buckets' own, ``copy_s`` its gradient copies."""
    buckets = max(1, math.ceil(nbytes / bucket_bytes))
    comm = buckets * allreduce(ranks, nbytes / buckets)
    hidden = min(overlap * comm, BACKWARD_SHARE * compute_s)
    return {"compute": compute_s, "control": control_s, "comm": comm, "copy": copy_s, "hidden": hidden,
            "step": compute_s + control_s + comm + copy_s - hidden}


def check_training(models: Models, data: dict, args, mlp_bytes: int) -> list:
    """Predicted against measured step time of each mlp training record (roundel on shm, DDP on the ring).

    The compute per step is the ``ceiling`` run's (N processes training at once, no communication) where
    the record has one, else the single process's. Nothing is hidden: on these CPUs the reductions share the
    cores and the memory of the backward pass. No control term: each bucket's negotiation round trip is in the
    shared-memory fit's a0 (every measured call negotiates too), and DDP negotiates nothing. The step copies
    the gradients ``GRADIENT_COPIES`` times.
    """
    rows = []
    for record in data["training"]:
        if record.get("model") != "mlp" or not record.get("single_sps"):
            continue
        n, batch = record["np"], record.get("batch_size", 32)
        compute = n * batch / record["ceiling_sps"] if record.get("ceiling_sps") else batch / record["single_sps"]
        for kind, cost in (("roundel", models.shm), ("ddp", models.ring)):
            if record.get(f"{kind}_sps"):
                measured = n * batch / record[f"{kind}_sps"]
                predicted = step_time(n, mlp_bytes, compute, 0.0, args.bucket_mib * 2 ** 20, cost, 0.0,
                                      GRADIENT_COPIES[kind] * models.copy(n, mlp_bytes))
                rows.append({"np": n, "kind": kind, "measured_s": measured, "predicted_s": predicted["step"],
                             "error": abs(predicted["step"] - measured) / measured})
    return rows


def check_hierarchical(models: Models, data: dict) -> list:
    """The composed hierarchical model against each measured hierarchical record."""
    rows = []
    for record in data["hierarchical"]:
        # the simulated hosts share the measuring machine: each has its share of the cores
        predicted = models.hierarchical(record["hosts"], record["ranks_per_host"], record["bytes"],
                                        models.cores / record["hosts"], record["link_bits_per_s"] / 8,
                                        models.fits["ring"]["alpha_s"], models.ring_per_byte(2))
        rows.append(dict(record, predicted_s=predicted, error=abs(predicted - record["seconds"]) / record["seconds"]))
    return rows


def predict(models: Models, args, workloads: dict) -> list:
    """Step time and scaling efficiency of each workload at ``args.ranks`` for each of ``args.networks``."""
    rows = []
    per_host = args.ranks_per_host
    hop = models.fits["ring"]["alpha_s"] + args.hop_latency_us * 1e-6
    for name, (nbytes, compute) in workloads.items():
        for gbit in args.networks:
            for n in args.ranks:
                hosts = max(1, n // per_host)

                def allreduce(ranks, size, hosts=hosts, gbit=gbit):
                    if hosts == 1:
                        return models.shm(ranks, size, per_host)
                    return models.hierarchical(hosts, per_host, size, per_host, gbit * 1e9 / 8, hop)

                parts = step_time(n, nbytes, compute, args.overlap, args.bucket_mib * 2 ** 20, allreduce,
                                  models.control(n, hop, per_host),
                                  GRADIENT_COPIES["roundel"] * models.copy(min(n, per_host), nbytes, per_host))
                rows.append(dict(parts, model=name, gbit=gbit, ranks=n, efficiency=compute / parts["step"]))
    return rows


# ---------------------------------------------------------------- report
def _mark(error: float) -> str:
    return "within 20 %" if error <= TARGET_ERROR else "**not within 20 %**"


def _err(fit: dict) -> str:
    return f"{fit['error']:.1%} at {fit['worst']}; {fit['within_target']} of {fit['points']} within 20 %"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs"


def machine_report(models: Models, data: dict, training: list, hierarchical: list) -> str:
    """One machine's Markdown tables: the fits with their errors, and the checks against measured steps."""
    f = models.fits
    shm, ring = f["shm"], f["ring"]
    lines = [f"{models.cores}-core machine: " + "; ".join(data["sources"]), "",
             "| model | fitted parameters | points | largest error | target |", "| --- | --- | ---: | --- | --- |",
             f"| shared memory t = q (a0 + w W log2 N + M (b0 + b1 m)) | a0 = {_us(shm['a0_s'])}, w = "
             f"{_us(shm['wait_s'])} per message of a wait, 1/b0 = {1 / shm['b0_s_per_byte'] / 1e9:.1f} GB/s, b1 = "
             + (f"{shm['b1_s_per_byte_per_rank'] * 1e12:.1f} ps per byte per rank" if shm["contention_fitted"]
                else "not fitted (every run had m = C)")
             + f" | {shm['points']} | {_err(shm)} | {_mark(shm['error'])} |",
             f"| Gloo ring t = p 2(N-1) (alpha + S/N beta) | alpha = {_us(ring['alpha_s'])}, 1/beta = "
             f"{1 / ring['beta_s_per_byte'] / 1e9:.3f} GB/s | {ring['points']} | {_err(ring)} "
             f"| {_mark(ring['error'])} |"]
    if "coordinator" in f:
        small = f["coordinator"]
        lines.append(f"| coordinator-reduced, S <= {COORDINATOR_BYTES / 1024:g} KiB t = q (k0 + k1 N) "
                     f"| k0 = {_us(small['k0_s'])}, k1 = {_us(small['k1_s_per_rank'])} per rank | {small['points']} "
                     f"| {_err(small)} | {_mark(small['error'])} |")
    if "roundel_gloo" in f:
        lines.append(f"| roundel on Gloo t = e + gloo(N, S) | e = {_us(f['roundel_gloo']['e_s'])} "
                     f"| {f['roundel_gloo']['points']} | {_err(f['roundel_gloo'])} "
                     f"| {_mark(f['roundel_gloo']['error'])} |")
    for key, label in (("control", "control round trip"), ("control_cpu", "rank 0 CPU per step"),
                       ("control_relayed", "rank 0's coordinator per step, relays")):
        if key in f:
            lines.append(f"| {label} t = c0 + c1 N | c0 = {f[key]['c0_s'] * 1e3:.2f} ms, c1 = "
                         f"{_us(f[key]['c1_s_per_rank'])} per rank | {f[key]['points']} "
                         f"| {_err(f[key])} | {_mark(f[key]['error'])} |")
    if "relay_hop" in f:
        hop = f["relay_hop"]
        lines.append(f"| relay chain of depth D t = c + 2 D h | c = {hop['c_s'] * 1e3:.2f} ms, h = {_us(hop['hop_s'])} "
                     f"per hop | {hop['points']} | {_err(hop)} | {_mark(hop['error'])} |")
    if training or hierarchical:
        lines += ["", "| measured | ranks | measured | predicted | error | target |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| mlp training step, {r['kind']} | {r['np']} | {r['measured_s'] * 1e3:.1f} ms "
                  f"| {r['predicted_s'] * 1e3:.1f} ms | {r['error']:.1%} | {_mark(r['error'])} |" for r in training]
        lines += [f"| hierarchical allreduce {r['bytes'] / 2 ** 20:g} MiB, {r['hosts']} hosts x "
                  f"{r['ranks_per_host']}, {r['link_bits_per_s'] / 1e9:g} Gbit/s | {r['hosts'] * r['ranks_per_host']} "
                  f"| {r['seconds'] * 1e3:.0f} ms | {r['predicted_s'] * 1e3:.0f} ms | {r['error']:.1%} "
                  f"| {_mark(r['error'])} |" for r in hierarchical]
    return "\n".join(lines)


def prediction_report(models: Models, predictions: list, args, mlp_bytes: int, relayed_from: int | None,
                      hop_from: int | None) -> str:
    """The predicted step times and efficiencies as a Markdown table, with Horovod's published figure;
    ``relayed_from``, ``hop_from``: the machines whose relayed control and relay hop fits were used (None: none)."""
    handling = ("a relay's handling not measured" if hop_from is None else
                f"a relay's handling {_us(models.fits['relay_hop']['hop_s'])} (relay chains on the {hop_from}-core "
                "machine)")
    control = ("control round trip without relays throughout" if relayed_from is None else
               f"control round trip through relays from {RELAY_FROM_RANKS} ranks (fanout {RELAY_FANOUT}), rank 0's "
               f"part fitted on the {relayed_from}-core machine; each hop {handling}, plus the hop across hosts "
               "between hosts")
    lines = [f"Predicted from the {models.cores}-core machine's fits: {args.ranks_per_host} ranks per host, a core "
             f"each; overlap {args.overlap:g}; {args.bucket_mib:g} MiB buckets; per hop across hosts "
             f"{_us(models.fits['ring']['alpha_s'])} (fitted Gloo alpha) + {args.hop_latency_us:g} µs; {control}; "
             f"ResNet-50 "
             f"{RESNET50_PARAMS * 4 / 2 ** 20:.1f} MiB of gradients, {args.resnet_step_ms:g} ms compute; mlp "
             f"{mlp_bytes / 2 ** 20:.1f} MiB, compute as measured single-rank; each step copies its gradients "
             "into their buckets once.", "",
             "| model | network | ranks | compute ms | control ms | allreduce ms | copy ms | hidden ms | step ms "
             "| efficiency |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['gbit']:g} Gbit/s | {r['ranks']:,} | {r['compute'] * 1e3:.1f} | "
              f"{r['control'] * 1e3:.1f} | {r['comm'] * 1e3:.1f} | {r['copy'] * 1e3:.1f} | {r['hidden'] * 1e3:.1f} | "
              f"{r['step'] * 1e3:.1f} | {r['efficiency']:.1%} |" for r in predictions]
    lines += ["", f"For comparison, {HOROVOD['label']}: {HOROVOD['efficiency']:.0%} at {HOROVOD['ranks']} ranks "
              "(a published figure, not modelled here)."]
    return "\n".join(lines)


# ---------------------------------------------------------------- GPU hosts
# The GPU-host form (--gpu): the allreduce is NCCL's, at the bus bandwidth NVIDIA and NCCL's maintainers publish;
# roundel's own costs are those measured (the control round trip fitted above, and one GPU's step with roundel
# against the same step without communication). Every external figure carries its source.
NCCL_TUNING = ("https://github.com/NVIDIA/nccl/blob/b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2/src/graph/tuning.cc")
# A 400 Gbit/s NIC (50 GB/s) gives NCCL 48 GB/s, NCCL's maintainers say: "You should achieve around 48GB/s from
# each CX7 NIC at 400Gbps. Then with NVLink based nodes that can be aggregated to achieve up to ~396GB/s with the
# RING protocol" (https://github.com/NVIDIA/nccl-tests/issues/319); at 200 Gbit/s the same share is 24 GB/s, as
# they give for one HDR NIC (https://github.com/NVIDIA/nccl/issues/412) and 8 x 200 Gbit/s x 0.96 = 192 GB/s, what
# NVIDIA measures on a DGX A100 (https://github.com/NVIDIA/nccl/issues/812). For other speeds the same share is an
# assumption (--nic-efficiency).
NIC_EFFICIENCY = 48 / 50
# roundel's gradient path on one GPU, measured (docs/performance.md, "On a GPU"): ResNet-50, fp32, batch 64 on one
# H100, 1,593.5 images/s with roundel's DistributedOptimizer over NCCL against 1,704.2 without communication
H100_ROUNDEL_IPS, H100_SINGLE_IPS, H100_BATCH = 1593.5, 1704.2, 64
GPU_ENGINE_MS = 1e3 * (H100_BATCH / H100_ROUNDEL_IPS - H100_BATCH / H100_SINGLE_IPS)  # 2.61 ms per step
GPU_HOSTS = {
    # ResNet-50 v1.5 on one A100 80GB: 2,470 img/s with mixed precision, batch 256 (NVIDIA's table and its
    # configs.yml); NCCL's bus bandwidth on one 8-GPU NVSwitch host: NCCL's tuning model caps A100 at 235 GB/s;
    # latency: NCCL's tuning model, one host: ring/Simple 8.4 + 14 x 3.4 us; across hosts: Tree/Simple 28 us per
    # network step
    "a100": {"label": "A100 host", "images_per_s": 2470.0, "batch": 256, "precision": "AMP",
             "compute_source": "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/Classification/"
                               "ConvNets/resnet50v1.5/README.md (batch: ../configs.yml)",
             "local_gbytes": 235.0,
             "local_source": "https://github.com/NVIDIA/nccl/blob/01afd20a77b5804e0ecf1042509dd9d20ebf9e93/"
                             "src/graph/tuning.cc (compCap80 cap)",
             "networks": "8x200,1x100", "host_us": 8.4 + 14 * 3.4, "net_us": 28.0},
    # ResNet-50 on one H100 80GB: roundel's own measurement without communication, fp32, batch 64
    # (docs/performance.md); NCCL on one H100 NVSwitch host with NVLink SHARP: "476GB/s looks to be in the
    # expected range for H100" (https://github.com/NVIDIA/nccl-tests/issues/290); latency: NCCL's tuning model,
    # NVLS/Simple 23 us on the host, NVLSTree/Simple 14 us per network step
    "h100": {"label": "H100 host", "images_per_s": H100_SINGLE_IPS, "batch": H100_BATCH, "precision": "fp32",
             "compute_source": "docs/performance.md#on-a-gpu (measured here, one H100, no communication)",
             "local_gbytes": 476.0, "local_source": "https://github.com/NVIDIA/nccl-tests/issues/290",
             "networks": "8x400,1x100", "host_us": 23.0, "net_us": 14.0},
}


def parse_nics(spec: str) -> list[tuple[int, float]]:
    """``"8x400,1x100"``: [(NICs per host, Gbit/s each), ...]; raises ValueError on another form."""
    nics = []
    for item in filter(None, spec.split(",")):
        count, _, gbit = item.lower().partition("x")
        if not gbit:
            raise ValueError(f"network {item!r} is not NICSxGBIT (e.g. 8x400)")
        nics.append((int(count), float(gbit)))
    return nics


def nccl_allreduce(ranks: int, nbytes: float, per_host: int, local_bytes_per_s: float, nics: int, gbit: float,
                   host_us: float, net_us: float, nic_efficiency: float = NIC_EFFICIENCY) -> float:
    """Seconds of NCCL's allreduce of ``nbytes`` among ``ranks`` GPUs, ``per_host`` to a host.

    ``lat + 2 (N - 1) / N * S / busbw``, nccl-tests' definition of bus bandwidth: on one host ``busbw`` is the
    host's (NVLink/NVSwitch) and ``lat = host_us``; across H hosts ``busbw`` is the smaller of the host's and the
    hosts' NICs together (``nics`` x ``gbit`` x ``nic_efficiency``), and ``lat = host_us + 2 log2(H) net_us`` (a
    tree's way up and down across the hosts). 0 for one rank.
    """
    if ranks <= 1:
        return 0.0
    hosts = math.ceil(ranks / per_host)
    busbw, lat = local_bytes_per_s, host_us
    if hosts > 1:
        busbw = min(local_bytes_per_s, nics * gbit * 1e9 / 8 * nic_efficiency)
        lat += 2 * math.ceil(math.log2(hosts)) * net_us
    return lat * 1e-6 + 2 * (ranks - 1) / ranks * nbytes / busbw


def gpu_step(nbytes: float, compute_s: float, bucket_bytes: float, allreduce, control_s: float,
             engine_s: float) -> dict:
    """A GPU rank's step (seconds) at the two bounds of overlap with backward.

    ``allreduce(bytes)`` costs one bucket (the gradients in equal buckets of at most ``bucket_bytes``);
    ``control_s`` is the round trip that negotiates the last bucket, which starts when backward ends;
    ``engine_s`` roundel's gradient path per step as measured on one GPU. No overlap: every bucket is reduced
    after backward. Full overlap: all but the last bucket are reduced during backward, as far as
    ``BACKWARD_SHARE`` of the compute reaches. Efficiency is compute / step.
    """
    buckets = max(1, math.ceil(nbytes / bucket_bytes))
    per_bucket = allreduce(nbytes / buckets)
    comm = buckets * per_bucket
    hidden = min((buckets - 1) * per_bucket, BACKWARD_SHARE * compute_s)
    serial = compute_s + engine_s + control_s + comm
    return {"compute": compute_s, "engine": engine_s, "control": control_s, "comm": comm,
            "last_bucket": per_bucket, "hidden": hidden, "step_no_overlap": serial,
            "step_full_overlap": serial - hidden, "efficiency_no_overlap": compute_s / serial,
            "efficiency_full_overlap": compute_s / (serial - hidden)}


def gpu_hosts(args) -> list[dict]:
    """The GPU hosts of ``args.gpu_hosts``, with the command line's overrides applied."""
    hosts = []
    for key in args.gpu_hosts:
        host = dict(GPU_HOSTS[key], key=key)
        host["compute_s"] = (args.gpu_step_ms / 1e3 if args.gpu_step_ms is not None
                             else host["batch"] / host["images_per_s"])
        if args.gpu_local_gbytes is not None:
            host["local_gbytes"], host["local_source"] = args.gpu_local_gbytes, "--gpu-local-gbytes"
        for name in ("host_us", "net_us"):
            if getattr(args, f"nccl_{name}") is not None:
                host[name] = getattr(args, f"nccl_{name}")
        host["nics"] = parse_nics(args.gpu_networks or host["networks"])
        hosts.append(host)
    return hosts


def predict_gpu(args, hosts: list, control) -> list:
    """ResNet-50's step and efficiency at ``args.ranks`` GPUs on each host and network, both overlap bounds;
    ``control(ranks)`` is the seconds of roundel's control round trip."""
    rows = []
    per_host, nbytes = args.gpus_per_host, RESNET50_PARAMS * 4
    for host in hosts:
        for nics, gbit in host["nics"]:
            for n in args.ranks:
                def allreduce(size, n=n, nics=nics, gbit=gbit, host=host):
                    return nccl_allreduce(n, size, per_host, host["local_gbytes"] * 1e9, nics, gbit,
                                          host["host_us"], host["net_us"], args.nic_efficiency)

                parts = gpu_step(nbytes, host["compute_s"], args.bucket_mib * 2 ** 20, allreduce, control(n),
                                 args.gpu_engine_ms / 1e3)
                rows.append(dict(parts, host=host["label"], network=f"{nics} x {gbit:g} Gbit/s", ranks=n))
    return rows


def gpu_report(rows: list, hosts: list, args, control_note: str) -> str:
    """The GPU-host predictions as a Markdown table, with their inputs and Horovod's published figure."""
    lines = [f"GPU hosts: ResNet-50, {RESNET50_PARAMS * 4 / 2 ** 20:.1f} MiB of float32 gradients in "
             f"{args.bucket_mib:g} MiB buckets, {args.gpus_per_host} GPUs to a host; NCCL across hosts at "
             f"{args.nic_efficiency:.2f} of each NIC's line rate; roundel's gradient path "
             f"{args.gpu_engine_ms:.2f} ms per step (one H100, measured); {control_note}."]
    for host in hosts:
        lines.append(f"- {host['label']}: compute {host['compute_s'] * 1e3:.1f} ms per step ("
                     + (f"{host['images_per_s']:,g} images/s at batch {host['batch']}, {host['precision']}; "
                        f"{host['compute_source']}" if args.gpu_step_ms is None else "--gpu-step-ms")
                     + f"); NCCL on one host {host['local_gbytes']:g} GB/s ({host['local_source']}); latency "
                     f"{host['host_us']:g} us + 2 log2(hosts) x {host['net_us']:g} us ({NCCL_TUNING})")
    lines += ["", "| host | network | GPUs | NCCL per step ms | last bucket ms | control ms | engine ms "
              "| no overlap: step ms | efficiency | full overlap: step ms | efficiency |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    one_host = set()  # (host, ranks) of the rows within one host: the same on every network, printed once
    for r in rows:
        network = r["network"]
        if r["ranks"] <= args.gpus_per_host:
            if (r["host"], r["ranks"]) in one_host:
                continue
            one_host.add((r["host"], r["ranks"]))
            network = "none (one host)"
        lines.append(f"| {r['host']} | {network} | {r['ranks']:,} | {r['comm'] * 1e3:.2f} | "
                     f"{r['last_bucket'] * 1e3:.2f} | {r['control'] * 1e3:.1f} | {r['engine'] * 1e3:.1f} | "
                     f"{r['step_no_overlap'] * 1e3:.1f} | {r['efficiency_no_overlap']:.1%} | "
                     f"{r['step_full_overlap'] * 1e3:.1f} | {r['efficiency_full_overlap']:.1%} |")
    lines += ["", "Overlap of NCCL with backward was not measured on a GPU: the two bounds are no overlap, and all "
              "but the last bucket hidden under backward (2/3 of the compute). A model, not a measurement: no "
              "multi-GPU run was made.",
              f"For comparison, {HOROVOD['label']}: {HOROVOD['efficiency']:.0%} at {HOROVOD['ranks']} GPUs "
              "(https://github.com/horovod/horovod#why-horovod; a published figure for other models, GPUs and "
              "network, not modelled here)."]
    return "\n".join(lines)


# ---------------------------------------------------------------- collecting
def _run(command: list, env: dict | None = None) -> None:
    """Run a benchmark; raises RuntimeError with its output's tail when it fails."""
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n{(result.stdout + result.stderr)[-3000:]}")


def _allreduce_run(n: int, shm: str, tmp: str) -> dict:
    """One ``allreduce.py`` run at ``n`` ranks with ``ROUNDEL_SHARED_MEMORY=shm``: {bytes: (roundel_s, raw_s)}."""
    path = Path(tmp) / "allreduce.json"
    _run([sys.executable, "-m", "roundel.runner.launch", "-np", n, sys.executable, BENCHMARKS / "allreduce.py", "--quick", "--threads", 1,
          "--sizes", ALLREDUCE_SIZES, "--skip-many", "--json", path, "--plot", Path(tmp) / "a.png"],
         env=dict(os.environ, ROUNDEL_SHARED_MEMORY=shm))
    result = json.loads(path.read_text())
    if (result["transport"] == "shm") != (shm == "1"):
        raise RuntimeError(f"allreduce.py ran on {result['transport']} with ROUNDEL_SHARED_MEMORY={shm}")
    return {s["bytes"]: (s["roundel_s"], s["raw_s"]) for s in result["sizes"]}


def _training_run(n: int, tmp: str) -> dict:
    """One interleaved mlp training run at ``n`` ranks: {kind: samples/sec}, and its batch size."""
    path = Path(tmp) / "training.json"
    _run([sys.executable, BENCHMARKS / "torch_training.py", "--model", "mlp", "--np", n, "--interleaved",
          "--quick", "--threads", 1, "--only", "roundel,ddp,single,ceiling", "--json", path, "--plot", Path(tmp) / "t.png"])
    result = json.loads(path.read_text())
    return {"batch_size": result["batch_size"], **{kind: run["samples_per_s"] for kind, run in result["runs"].items()}}


def _control_run(control_ranks: str, tmp: str, relays: bool) -> dict:
    """One ``control_scale.py`` run, with relays from the default size or without: {ranks: (steady cycle ms,
    rank 0 CPU ms per step, its coordinator thread's)}."""
    path = Path(tmp) / "control.json"
    _run([sys.executable, BENCHMARKS / "control_scale.py", "--ranks", control_ranks, "--steps", 20 if relays else 5,
          "--relay-from-ranks", RELAY_FROM_RANKS if relays else 0, "--json", path, "--plot", Path(tmp) / "c.png"])
    return {r["ranks"]: (r["cycle_ms"], r["rank0_cpu_ms_per_step"], r["coordinator_cpu_ms_per_step"])
            for r in json.loads(path.read_text())["results"]}


def _relay_chain_run(chain_np: str, tmp: str) -> dict:
    """One ``relay_hops.py`` run: {ranks: (chained ms per step, direct ms per step)}."""
    path = Path(tmp) / "hops.json"
    _run([sys.executable, BENCHMARKS / "relay_hops.py", "--np", chain_np, "--json", path])
    return {r["np"]: (r["chain_ms"], r["direct_ms"]) for r in json.loads(path.read_text())["rows"]}


def collect(out: str, nps: list, training_nps: list, control_ranks: str, relayed_ranks: str, chain_np: str,
            repeat: int) -> None:
    """Measure this machine into ``out``: allreduce (shared memory on and off) at ``nps``, mlp training at
    ``training_nps`` ranks and single, ``control_scale.py`` at ``control_ranks`` without relays and at
    ``relayed_ranks`` with them, ``relay_hops.py`` at ``chain_np``; each ``repeat`` times, in
    rounds, keeping the fastest figure of each (the run least disturbed by other work on the machine)."""
    from scaling import copy_bandwidth  # benchmarks/scaling.py, beside this script (it loads torch)
    cores = os.cpu_count()
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    record = {"cores": cores, "machine": f"{platform.node()}: {model}, {platform.system()} {platform.release()}",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "load_average_before": os.getloadavg()[0],
              "note": (f"{cores} cores; runs of more ranks than cores are oversubscribed (each rank waits for a "
                       f"core); other work may have been running; each figure is the fastest of {repeat} runs"),
              "copy_bandwidth_bytes_per_s": {}}
    for k in sorted(set(nps)):
        record["copy_bandwidth_bytes_per_s"][str(k)] = copy_bandwidth(k, 64 * 2 ** 20, 0.5)
    allreduce, training, control, relayed, chains = {}, {}, [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(repeat):
            print(f"round {round_ + 1}/{repeat}: allreduce at {nps} ranks, mlp training at {training_nps}, "
                  "control_scale", flush=True)
            for n in nps:
                for key, shm in (("allreduce", "1"), ("gloo_allreduce", "0")):
                    allreduce.setdefault((key, n), []).append(_allreduce_run(n, shm, tmp))
            for n in training_nps:
                training.setdefault(n, []).append(_training_run(n, tmp))
            control.append(_control_run(control_ranks, tmp, relays=False))
            relayed.append(_control_run(relayed_ranks, tmp, relays=True))
            chains.append(_relay_chain_run(chain_np, tmp))
    for key in ("allreduce", "gloo_allreduce"):
        record[key] = [{"np": n, "bytes": size, "roundel_s": min(run[size][0] for run in runs),
                        "raw_s": min(run[size][1] for run in runs)}
                       for (kind, n), runs in allreduce.items() if kind == key for size in runs[0]]
    record["training"] = [{"np": n, "model": "mlp", "batch_size": runs[0]["batch_size"],
                           **{f"{kind}_sps": max(run[kind] for run in runs) for kind in runs[0] if kind != "batch_size"}}
                          for n, runs in training.items()]
    record["control"] = [{"np": n, "cycle_ms": min(run[n][0] for run in control),
                          "rank0_cpu_ms_per_step": min(run[n][1] for run in control)} for n in control[0]]
    record["control"] += [{"np": n, "relays": True, "cycle_ms": min(run[n][0] for run in relayed),
                           "rank0_cpu_ms_per_step": min(run[n][1] for run in relayed),
                           "coordinator_cpu_ms_per_step": min(run[n][2] for run in relayed)} for n in relayed[0]]
    record["relay_chain"] = [{"np": n, "depth": n - 1, "chain_ms": min(run[n][0] for run in chains),
                              "direct_ms": min(run[n][1] for run in chains)} for n in chains[0]]
    record["load_average_after"] = os.getloadavg()[0]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


# ---------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--measurements", nargs="+", default=[str(p) for p in DEFAULT_MEASUREMENTS], metavar="FILE",
                   help="measurement files to fit (merged)")
    p.add_argument("--collect", metavar="OUT", help="measure this machine into OUT (JSON) instead of fitting")
    p.add_argument("--np", default="2,3,4", help="with --collect: ranks of the allreduce runs")
    p.add_argument("--training-np", default="2", help="with --collect: ranks of the mlp training runs")
    p.add_argument("--control-ranks", default="16,64,256",
                   help="with --collect: control_scale.py's --ranks without relays")
    p.add_argument("--relayed-control-ranks", default="64,256,1024",
                   help="with --collect: control_scale.py's --ranks with relays (from the default size)")
    p.add_argument("--relay-chain-np", default="2,3,4,5,6",
                   help="with --collect: relay_hops.py's --np (relay chains of depth N - 1)")
    p.add_argument("--repeat", type=int, default=3, help="with --collect: runs of each, the fastest kept")
    p.add_argument("--ranks", default="8,64,512,1024", help="rank counts to predict")
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--networks", default="25,100", help="link speeds between hosts, Gbit/s")
    p.add_argument("--hop-latency-us", type=float, default=5.0,
                   help="wire and switch latency per ring step across hosts, added to the fitted Gloo alpha "
                        "(an assumption: a few µs for one switch hop)")
    p.add_argument("--resnet-step-ms", type=float, default=300.0,
                   help="ResNet-50's compute per step on one rank (an assumption of the order of a Pascal P100 "
                        "at batch 64, about 210 images/s; not measured here)")
    p.add_argument("--overlap", type=float, default=0.5,
                   help="share of the allreduce time that runs during backward (an assumption)")
    p.add_argument("--bucket-mib", type=float, default=25.0, help="gradient bucket size (the default's)")
    gpu = p.add_argument_group("GPU hosts (--gpu)", "predict ResNet-50 on GPU hosts over NCCL instead; the "
                               "defaults are published or measured figures (see the module's docstring)")
    gpu.add_argument("--gpu", action="store_true",
                     help="predict GPU hosts: NCCL within and across hosts, roundel's measured engine costs")
    gpu.add_argument("--gpu-hosts", default="a100,h100", help=f"hosts to predict, of {', '.join(GPU_HOSTS)}")
    gpu.add_argument("--gpus-per-host", type=int, default=8)
    gpu.add_argument("--gpu-networks", metavar="NICSxGBIT,...",
                     help="NICs per host x Gbit/s each, e.g. 8x400,8x200,1x100; if not given, per host: "
                          "a100 8x200,1x100, h100 8x400,1x100")
    gpu.add_argument("--nic-efficiency", type=float, default=NIC_EFFICIENCY,
                     help="share of a NIC's line rate NCCL gets (48 GB/s of 50 at 400 Gbit/s, per NCCL's "
                          "maintainers; other speeds: an assumption)")
    gpu.add_argument("--gpu-step-ms", type=float,
                     help="ResNet-50's compute per step on one GPU; if not given, per host: a100 256 / 2,470 "
                          "images/s (published), h100 64 / 1,704.2 images/s (measured here)")
    gpu.add_argument("--gpu-local-gbytes", type=float,
                     help="NCCL's allreduce bus bandwidth on one host, GB/s; if not given, per host: a100 235, "
                          "h100 476")
    gpu.add_argument("--nccl-host-us", type=float, help="NCCL's allreduce latency on one host, µs; if not given, per "
                     "host from NCCL's tuning model: a100 56, h100 23")
    gpu.add_argument("--nccl-net-us", type=float, help="NCCL's latency per network step of a tree across hosts, "
                     "µs; if not given, per host from NCCL's tuning model: a100 28, h100 14")
    gpu.add_argument("--gpu-engine-ms", type=float, default=round(GPU_ENGINE_MS, 2),
                     help="roundel's gradient path per step on a GPU (measured on one H100: 64 / 1,593.5 - "
                          "64 / 1,704.2 images/s)")
    p.add_argument("--plot", default="scaling_model.png", metavar="PATH", help="PNG of efficiency vs ranks")
    p.add_argument("--json", metavar="PATH", help="also write the fits, checks and predictions as JSON")
    args = p.parse_args(argv)
    args.np = [int(n) for n in args.np.split(",") if n]
    args.training_np = [int(n) for n in args.training_np.split(",") if n]
    args.ranks = [int(n) for n in args.ranks.split(",") if n]
    args.networks = [float(g) for g in args.networks.split(",") if g]
    args.gpu_hosts = [h.strip().lower() for h in args.gpu_hosts.split(",") if h.strip()]
    unknown = [h for h in args.gpu_hosts if h not in GPU_HOSTS]
    if unknown:
        p.error(f"--gpu-hosts: unknown {', '.join(unknown)} (known: {', '.join(GPU_HOSTS)})")
    try:
        if args.gpu_networks:
            parse_nics(args.gpu_networks)
    except ValueError as exc:
        p.error(f"--gpu-networks: {exc}")
    return args


def prediction_models(machines: dict, fitted: dict) -> tuple[Models, int | None, int | None]:
    """The fits predictions use: the machine with the most cores (a host with a core per rank), with the relayed
    control and relay hop fits of the machine that measured them. Returns (models, the machine of the relayed
    control fit, that of the relay hop fit; None where none has one)."""
    cores = max(machines)
    models = Models(machines[cores])
    relayed_from = next((c for c in sorted(fitted, key=lambda c: (c != cores, -c))
                         if "control_relayed" in fitted[c].fits), None)
    if relayed_from is not None:  # the serial part at rank 0, from the machine that measured it
        models.fits["control_relayed"] = fitted[relayed_from].fits["control_relayed"]
    hop_from = next((c for c in sorted(fitted, key=lambda c: (c != cores, -c)) if "relay_hop" in fitted[c].fits),
                    None)
    if hop_from is not None:
        models.fits["relay_hop"] = fitted[hop_from].fits["relay_hop"]
    return models, relayed_from, hop_from


def main_gpu(args, machines: dict, plot) -> int:
    """``--gpu``: ResNet-50 on GPU hosts; roundel's control round trip from the fits, NCCL's from its inputs."""
    fitted = {cores: Models(data) for cores, data in machines.items()}
    models, relayed_from, hop_from = prediction_models(machines, fitted)
    hop = models.fits["ring"]["alpha_s"] + args.hop_latency_us * 1e-6
    note = (f"control round trip from the fits of the {max(machines)}-core machine"
            + ("" if relayed_from is None else f", through relays from {RELAY_FROM_RANKS} ranks (rank 0's part "
               f"fitted on the {relayed_from}-core machine, a relay's handling on the {hop_from}-core one)")
            + f", per hop across hosts {_us(hop)}")
    hosts = gpu_hosts(args)
    rows = predict_gpu(args, hosts, lambda n: models.control(n, hop, args.gpus_per_host))
    print(gpu_report(rows, hosts, args, note))
    lines = {f"{r['host']}, {r['network']}, {bound}": [p[f"efficiency_{key}"] for p in rows
                                                       if p["host"] == r["host"] and p["network"] == r["network"]]
             for r in rows if r["ranks"] == args.ranks[0]
             for bound, key in (("no overlap", "no_overlap"), ("full overlap", "full_overlap"))}
    path = plot(args.plot, args.ranks, lines, HOROVOD,
                f"ResNet-50 on GPU hosts of {args.gpus_per_host}: predicted (a model, not a measurement)")
    print(f"\nplot: {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu_hosts": hosts, "gpu_predictions": rows}, indent=1))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.collect:
        collect(args.collect, args.np, args.training_np, args.control_ranks, args.relayed_control_ranks,
                args.relay_chain_np, args.repeat)
        return 0
    from plots import scaling_model_plot  # benchmarks/plots.py, beside this script

    machines = load(args.measurements)
    if args.gpu:
        return main_gpu(args, machines, scaling_model_plot)
    mlp_bytes = mlp_gradient_bytes()
    output, fitted = {"machines": {}}, {}
    for cores in sorted(machines):
        data, models = machines[cores], Models(machines[cores])
        fitted[cores] = models
        training, hierarchical = check_training(models, data, args, mlp_bytes), check_hierarchical(models, data)
        print(machine_report(models, data, training, hierarchical) + "\n")
        output["machines"][cores] = {"fits": models.fits, "training": training, "hierarchical": hierarchical}
    cores = max(machines)  # the machine with the most cores stands for a host with a core per rank
    data = machines[cores]
    models, relayed_from, hop_from = prediction_models(machines, fitted)
    workloads = {"ResNet-50": (RESNET50_PARAMS * 4, args.resnet_step_ms / 1e3)}
    single = [r for r in data["training"] if r.get("model") == "mlp" and r.get("single_sps")]
    if single:
        workloads["mlp"] = (mlp_bytes, single[0].get("batch_size", 32) / single[0]["single_sps"])
    predictions = predict(models, args, workloads)
    print(prediction_report(models, predictions, args, mlp_bytes, relayed_from, hop_from))
    lines = {f"{name}, {gbit:g} Gbit/s": [r["efficiency"] for r in predictions
                                          if r["model"] == name and r["gbit"] == gbit]
             for name in workloads for gbit in args.networks}
    path = scaling_model_plot(args.plot, args.ranks, lines, HOROVOD,
                              f"predicted scaling efficiency, {args.ranks_per_host} ranks per host "
                              f"(alpha-beta model fitted on the {cores}-core machine)")
    print(f"\nplot: {path}")
    if args.json:
        output.update(predicted_from=cores, control_relayed_from=relayed_from, relay_hop_from=hop_from,
                      predictions=predictions)
        Path(args.json).write_text(json.dumps(output, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
