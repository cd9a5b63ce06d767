"""Autotune: the Bayesian optimiser and the tuner's sampling as pure logic, then a real 2-rank job."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest

from launch_util import assert_checks_passed, describe, rank_lines, run_job
from roundel.common.engine import autotune
from roundel.common.control import codec as control_codec
from roundel.common.control.records import Batch, Entry, OpKind, Request, TunedParams
from roundel.common.engine.autotune import LOG_COLUMNS, Autotuner, BayesianOptimizer
from roundel.common.control.messages import Tune
from roundel.errors import SettingsError
from roundel.common.engine.negotiation import Negotiator
from roundel.common.settings import MIB, Settings


def smooth(x: float, y: float) -> float:
    """A smooth bump with its maximum 1.0 at (0.3, 0.7) on the unit square."""
    return math.exp(-((x - 0.3) ** 2 + (y - 0.7) ** 2) / 0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimizer_gets_near_the_optimum_of_a_smooth_function(seed):
    optimizer = BayesianOptimizer([(0.0, 1.0), (0.0, 1.0)], noise=0.1, seed=seed)
    for fusion, cycle, *_ in autotune.START_POINTS:  # the tuner's first points, scaled to the unit square
        point = ((fusion - autotune.FUSION_MIB_RANGE[0]) / 64, (cycle - autotune.CYCLE_MS_RANGE[0]) / 99)
        assert smooth(*point) < 0.5
        optimizer.add_sample(point, smooth(*point))
    best = 0.0
    for _ in range(12):
        point = optimizer.next_point()
        assert all(0.0 <= v <= 1.0 for v in point), point
        best = max(best, smooth(*point))
        optimizer.add_sample(point, smooth(*point))
    assert best > 0.95, best


def settings(tmp_path, **changes) -> Settings:
    base = dict(autotune=True, autotune_log=str(tmp_path / "autotune.csv"), autotune_warmup_samples=0,
                autotune_steps_per_sample=2, autotune_bayes_opt_max_samples=16, cache_capacity=0,
                fusion_threshold=1 * MIB, cycle_time_ms=50.0)
    base.update(changes)
    return Settings(**base)


def log_rows(path) -> list[dict]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == LOG_COLUMNS
        return list(reader)


def throughput(params: TunedParams) -> float:
    """A synthetic score in bytes/s, 1e9 at best: a 24 MiB fusion threshold and a 20 ms cycle time."""
    fusion, cycle = params.fusion_threshold / MIB, params.cycle_time_ms
    return 1e9 * math.exp(-((fusion - 24) / 16) ** 2 - ((cycle - 20) / 30) ** 2)


def test_tuner_finds_a_good_point_logs_every_sample_and_fixes_the_best(tmp_path):
    s = settings(tmp_path)
    tuner = Autotuner(s, seed=3)
    assert tuner.params == TunedParams(1 * MIB, 50.0, False, True)
    seen = []
    while not tuner.done:
        seen.append(tuner.params)
        tuner.score(throughput(tuner.params))
    assert len(seen) == s.autotune_bayes_opt_max_samples
    assert seen[0] == TunedParams(1 * MIB, 50.0, False, True)  # the configured point comes first
    assert [(p.fusion_threshold / MIB, p.cycle_time_ms) for p in seen[1:5]] == \
        [(f, c) for f, c, *_ in autotune.START_POINTS]
    best_score = max(throughput(p) for p in seen)
    assert best_score > 0.95e9, [(p, throughput(p)) for p in seen]
    best = max(seen, key=throughput)
    assert tuner.params == best._replace(tuning=False)
    rows = log_rows(s.autotune_log)
    assert len(rows) == s.autotune_bayes_opt_max_samples
    for row, params in zip(rows, seen):
        assert float(row["tensor_fusion_threshold"]) == pytest.approx(params.fusion_threshold / MIB, rel=1e-5)
        assert float(row["cycle_time_ms"]) == pytest.approx(params.cycle_time_ms, rel=1e-5)
        assert float(row["score"]) == pytest.approx(throughput(params), rel=1e-5)
        assert row["hierarchical_allreduce"] == row["torus_allreduce"] == row["cache_enabled"] == "0"


def test_hierarchical_switches_are_tuned_where_the_job_can_switch_them(tmp_path):
    s = settings(tmp_path, autotune_bayes_opt_max_samples=12, hierarchical_allgather=True)

    def score(params: TunedParams) -> float:  # hierarchical allreduce helps, hierarchical allgather hurts
        return throughput(params) * (1.5 if params.hierarchical_allreduce else 1.0) * \
            (0.5 if params.hierarchical_allgather else 1.0)

    tuner = Autotuner(s, hierarchical=True, seed=5)
    assert tuner.params == TunedParams(1 * MIB, 50.0, False, True, False, True)  # as configured
    seen = []
    while not tuner.done:
        seen.append(tuner.params)
        tuner.score(score(tuner.params))
    assert len(seen) == 12 + 2  # the search, then each switch tried the other way at the best point
    assert all((p.hierarchical_allreduce, p.hierarchical_allgather) == (False, True) for p in seen[:12])
    best = max(seen[:12], key=score)
    assert seen[12] == best._replace(hierarchical_allreduce=True)  # better: kept
    assert seen[13] == best._replace(hierarchical_allreduce=True, hierarchical_allgather=False)  # better again
    assert tuner.params == seen[13]._replace(tuning=False)
    rows = log_rows(s.autotune_log)
    assert [(row["hierarchical_allreduce"], row["hierarchical_allgather"]) for row in rows] == \
        [(str(int(p.hierarchical_allreduce)), str(int(p.hierarchical_allgather))) for p in seen]

    fixed = Autotuner(settings(tmp_path, hierarchical_allreduce=True), hierarchical=False, seed=5)
    while not fixed.done:  # a job that cannot switch keeps its configured values throughout
        assert (fixed.params.hierarchical_allreduce, fixed.params.hierarchical_allgather) == (True, False)
        fixed.score(throughput(fixed.params))


def test_bucket_size_is_tried_at_half_and_twice_when_the_job_has_gradient_buckets(tmp_path):
    s = settings(tmp_path, autotune_bayes_opt_max_samples=5, bucket_cap_mb=10.0)
    asked = []

    def bucketed():
        asked.append(len(tuner.samples))
        return True

    tuner = Autotuner(s, bucketed=bucketed, seed=1)
    seen = []
    while not tuner.done:
        seen.append(tuner.params)
        tuner.score(throughput(tuner.params) * (1.2 if tuner.params.bucket_cap_mb == 20.0 else 1.0))
    assert asked == [5]  # once the search is over
    assert [p.bucket_cap_mb for p in seen] == [0.0] * 5 + [5.0, 20.0]  # 0.0: the optimizer's own
    best = max(seen[:5], key=throughput)
    assert seen[5:] == [best._replace(bucket_cap_mb=5.0), best._replace(bucket_cap_mb=20.0)]
    assert tuner.params == seen[6]._replace(tuning=False)
    assert [row["bucket_cap_mb"] for row in log_rows(s.autotune_log)] == ["0", "0", "0", "0", "0", "5", "20"]


def test_two_rank_optimizer_relays_its_buckets_alike_on_every_rank(tmp_path):
    log = tmp_path / "autotune.csv"
    result = run_job(2, "torch_autotune.py", "optimizer", launcher_args=[
        "--autotune", "--autotune-log-file", log, "--autotune-warmup-samples", 0,
        "--autotune-steps-per-sample", 1, "--autotune-bayes-opt-max-samples", 2, "--cache-capacity", 0],
        env={"HOROVOD_BUCKET_CAP_MB": "0.5"}, timeout=240)
    assert_checks_passed(result, 2, "optimizer")
    assert [row["bucket_cap_mb"] for row in log_rows(log)] == ["0", "0", "0.25", "1"], describe(result)
    tuned = [json.loads(next(line for line in rank_lines(result.stdout, rank, "stdout")
                             if line.startswith("TUNED "))[6:]) for rank in (0, 1)]
    assert tuned[0] == {**tuned[1], "weights": tuned[0]["weights"]}, describe(result)
    assert tuned[0]["weights"] == pytest.approx(tuned[1]["weights"], rel=1e-12)  # the same reductions
    final = tuned[0]["params"][6] or 0.5
    assert tuned[0]["bucket_mib"] == final, describe(result)
    assert len(set(tuned[0]["layouts"])) == 3, tuned[0]["layouts"]  # re-laid for each size tried


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batch(*names, elements=1024, process_set_id=0, error=None):
    entries = tuple(Entry(name, Request(name, OpKind.ALLREDUCE, process_set_id, "float32", (elements,)))
                    for name in names)
    return ((0, 1), Batch(OpKind.ALLREDUCE, process_set_id, entries, error=error))


def test_a_sample_is_the_median_of_five_windows_of_steps_and_warmups_are_discarded(tmp_path):
    clock = FakeClock()
    s = settings(tmp_path, autotune_warmup_samples=1, autotune_steps_per_sample=3,
                 autotune_bayes_opt_max_samples=2, cache_capacity=16)
    tuner = Autotuner(s, clock=clock)
    assert tuner.params.cache_enabled
    step_bytes = 3 * 4096

    def train(steps: int, seconds_per_step: float):
        changes = []
        for _ in range(steps):
            for names in (("a", "b"), ("c",)):  # two batches a step: 3 x 4 KiB
                changes.append(tuner.observe([batch(*names), batch("other", process_set_id=1),
                                              batch("failed", error="mismatch")]))
            clock.now += seconds_per_step
        return [c for c in changes if c is not None]

    assert train(3, 0.25) == []  # a window is not over until a name comes back for a fourth step
    assert train(12, 0.25) == []  # steps 1-15: the warm-up sample's five windows, discarded at step 16
    assert tuner.samples == []
    changes = []
    for seconds in (1.0, 0.5, 0.1, 0.5, 2.0):  # the first sample: five windows of 3 steps from step 16
        changes += train(3, seconds)
    changes += train(1, 0.1)  # step 31 ends it; its score is the median window's (3 steps in 1.5 s)
    assert changes == [TunedParams(4 * MIB, 5.0, True, True)], changes
    assert tuner.samples == [(TunedParams(1 * MIB, 50.0, True, True), pytest.approx(3 * step_bytes / 1.5))]
    changes = train(15, 0.1)  # the second sample: steps 31-45, ended by step 46
    assert tuner.samples[1] == (TunedParams(4 * MIB, 5.0, True, True), pytest.approx(3 * step_bytes / 0.3))
    assert changes == [TunedParams(4 * MIB, 5.0, False, True)], changes  # the better point, cache off
    changes = train(15, 0.2)  # slower without the cache: the better point is fixed as it was
    assert tuner.samples[2] == (TunedParams(4 * MIB, 5.0, False, True), pytest.approx(3 * step_bytes / 0.6))
    assert changes == [TunedParams(4 * MIB, 5.0, True, False)], changes
    assert tuner.done and train(5, 0.1) == []
    assert len(log_rows(s.autotune_log)) == 3


def test_no_samples_means_the_configured_settings_stay(tmp_path):
    tuner = Autotuner(settings(tmp_path, autotune_bayes_opt_max_samples=0))
    assert tuner.done and tuner.params == TunedParams(1 * MIB, 50.0, False, False)
    assert tuner.observe([batch("a")] * 10) is None
    assert log_rows(tmp_path / "autotune.csv") == []


def test_an_unwritable_log_is_a_clear_error(tmp_path):
    with pytest.raises(SettingsError, match="cannot write the autotune log.*no-such-dir.*writable file path"):
        Autotuner(settings(tmp_path, autotune_log=str(tmp_path / "no-such-dir" / "log.csv")))


def test_missing_scikit_learn_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.gaussian_process", None)  # makes the import fail
    with pytest.raises(SettingsError, match=r"needs scikit-learn.*pip install 'roundel\[autotune\]'"):
        autotune.require_scikit_learn()


def test_tuned_params_travel_in_the_typed_codec():
    message = Tune(TunedParams(24 * MIB, 12.5, False, True))
    decoded = control_codec.decode(control_codec.encode(message))
    assert decoded == message and type(decoded) is Tune and type(decoded.params) is TunedParams
    bad = control_codec.encode(Tune(TunedParams("24", 12.5, False, True)))
    with pytest.raises(control_codec.DecodeError, match="TunedParams.fusion_threshold"):
        control_codec.decode(bad)


def test_turning_the_response_cache_off_evicts_and_marks_bits_stale():
    negotiator = Negotiator(2, cache_capacity=8)
    request = Request("x", OpKind.ALLREDUCE, 0, "float32", (4,))
    for rank in (0, 1):
        negotiator.submit(rank, request, 0.0)
    (_, agreed), = negotiator.take(1 << 20)
    bit, version = agreed.entries[0].cache_bit, negotiator.cache.version
    assert bit >= 0
    negotiator.set_cache_capacity(0)
    assert negotiator.take_evictions() == [(bit, (0, "x"))]
    assert negotiator.submit_bit(1, bit, version, 1.0) is False  # the rank is asked for the full request
    for rank in (0, 1):
        negotiator.submit(rank, request, 2.0)
    (_, again), = negotiator.take(1 << 20)
    assert again.entries[0].cache_bit == -1  # nothing is cached while the capacity is 0
    negotiator.set_cache_capacity(8)
    for rank in (0, 1):
        negotiator.submit(rank, request, 3.0)
    (_, cached), = negotiator.take(1 << 20)
    assert cached.entries[0].cache_bit >= 0


def test_two_rank_job_tunes_agrees_and_stays_exact(tmp_path):
    log = tmp_path / "autotune.csv"
    result = run_job(2, "torch_autotune.py", launcher_args=[
        "--autotune", "--autotune-log-file", log, "--autotune-warmup-samples", 1,
        "--autotune-steps-per-sample", 2, "--autotune-bayes-opt-max-samples", 6,
        "--fusion-threshold-mb", 1, "--cycle-time-ms", 20, "--verbose"], timeout=240)
    assert_checks_passed(result, 2, "autotune")
    tuned = [json.loads(next(line for line in rank_lines(result.stdout, rank, "stdout")
                             if line.startswith("TUNED "))[6:]) for rank in (0, 1)]
    assert tuned[0]["params"] == tuned[1]["params"], describe(result)
    fusion, cycle, cache, tuning, hierarchical_allreduce, hierarchical_allgather, bucket = tuned[0]["params"]
    assert tuning is False and hierarchical_allreduce is hierarchical_allgather is False  # one host: not tuned
    assert bucket == 0.0  # no gradient buckets in this job: not tuned
    rows = log_rows(log)
    assert len(rows) == 7, describe(result)  # six samples, then the response cache tried off
    assert (float(rows[0]["tensor_fusion_threshold"]), float(rows[0]["cycle_time_ms"])) == (1.0, 20.0)
    best = max(rows, key=lambda row: float(row["score"]))
    assert float(best["tensor_fusion_threshold"]) == pytest.approx(fusion / MIB, rel=1e-5)
    assert float(best["cycle_time_ms"]) == pytest.approx(cycle, rel=1e-5)
    assert best["cache_enabled"] == str(int(cache))
    assert tuned[0]["steps"] >= 8 * 5 * 2  # a warm-up and seven samples, each of five windows of two steps
    debug = rank_lines(result.stderr, 0, "stderr")
    assert sum("roundel autotune: sample " in line for line in debug) == 7, describe(result)
    assert sum("roundel autotune: done after 7 samples" in line for line in debug) == 1, describe(result)
    assert not any("no effect yet" in line and "--autotune" in line for line in result.stderr.splitlines())


def test_a_job_without_scikit_learn_is_refused_on_every_rank():
    result = run_job(2, "torch_autotune.py", "no-sklearn", launcher_args=["--autotune"], timeout=120)
    assert_checks_passed(result, 2, "no-sklearn")
