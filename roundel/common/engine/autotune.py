"""Autotune (``HOROVOD_AUTOTUNE=1``, ``roundelrun --autotune``): the coordinator's search for fast settings.

Rank 0's coordinator feeds every batch it dispatches to an :class:`Autotuner`
and applies the :class:`TunedParams` it returns; the engine sends them to the
other ranks. The fusion threshold, cycle time and cache act on the
coordinator alone; the hierarchical switches act on every rank's executor,
which each rank's engine tells between the same two batches of the job (rank
0's right after dispatching them, the others on the ``Tune`` message that
follows those batches), so all ranks switch at the same point.

What is tuned, as in Horovod 0.28.1's ``ParameterManager``:

* the fusion threshold, 0 to 64 MiB (Horovod's range);
* the cycle time, 1 to 100 ms (Horovod's range);
* the response cache, on (the configured ``cache_capacity``) or off; left
  off when the configured capacity is 0;
* hierarchical allreduce and hierarchical allgather, each on or off, when
  the job's communicator can do both (several hosts with the same number of
  ranks, more than one each; see :mod:`roundel.transport.hierarchical`);
* roundel's own: the gradient bucket size of ``roundel.torch``'s
  ``DistributedOptimizer`` (``bucket_cap_mb``), when the job has one. The
  executor stamps each collective with the settings in force when it ran, so
  every rank's optimizer sees the same new size after the same step and
  re-lays its buckets there.

Not tuned: torus allreduce (the log carries its configured value).

A *step* is one reduction of the same tensor name: a window ends when a
name of the global process set is dispatched for the ``steps_per_sample +
1``-th time since the window began, so a window holds ``steps_per_sample``
whole training steps, and its score is the bytes dispatched in it (every
collective of the global process set) per second of wall clock. As in
Horovod, a sample is five windows at the same settings and its score their
median (one slow or fast window does not decide). The first
``warmup_samples`` samples, at the configured settings, are discarded. Then
``bayes_opt_max_samples`` samples are taken: the configured settings,
Horovod's fixed starting points (4 MiB/5 ms, 32/50, 16/25, 8/10), then the
points that maximise the expected improvement of a Gaussian process
(scikit-learn) fitted to the scores so far, all with the on/off settings as
configured. Then each on/off setting that is tuned (hierarchical allreduce,
hierarchical allgather, response cache: Horovod's order) is tried the other
way at the best point so far, one sample each, and kept when it scored
better; with gradient buckets, half and twice the bucket size are tried the
same way. Finally the best point seen is fixed for the rest of the job.
Unlike Horovod, a value set explicitly is the starting point of the search
rather than excluded from it.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings

from roundel.errors import SettingsError
from roundel.common.control.records import TunedParams
from roundel.common.engine.negotiation import entry_bytes
from roundel.common.settings import MIB, Settings

log = logging.getLogger("roundel")

FUSION_MIB_RANGE = (0.0, 64.0)
CYCLE_MS_RANGE = (1.0, 100.0)
START_POINTS = ((4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0))
"""Horovod's first points (fusion MiB, cycle ms) after the configured one."""

LOG_COLUMNS = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
               "cycle_time_ms", "tensor_fusion_threshold", "score", "bucket_cap_mb")
"""Horovod's autotune log columns, then roundel's bucket size (MiB; 0: the optimizer's own);
``tensor_fusion_threshold`` is in MiB, ``score`` in bytes per second."""

BUCKET_MIB_RANGE = (0.25, 256.0)
"""The gradient bucket sizes tried (MiB)."""

WINDOWS_PER_SAMPLE = 5
"""Windows of ``steps_per_sample`` steps whose median score is one sample's (Horovod's ``SAMPLES``)."""

_EI_XI = 0.01  # Horovod's exploration margin of the expected improvement
_CANDIDATES = 2048
_LOCAL_SEARCHES = 5


def initial_params(settings: Settings) -> TunedParams:
    """The configured settings, where tuning starts (and stays, without autotune)."""
    return TunedParams(settings.fusion_threshold, settings.cycle_time_ms, settings.cache_capacity > 0,
                       settings.autotune and settings.autotune_bayes_opt_max_samples > 0,
                       settings.hierarchical_allreduce, settings.hierarchical_allgather)


def require_scikit_learn() -> None:
    """Raise SettingsError saying what to install when scikit-learn is missing."""
    try:
        import sklearn.gaussian_process  # noqa: F401
        import scipy.optimize  # noqa: F401
    except ImportError as exc:
        raise SettingsError(
            f"autotune (HOROVOD_AUTOTUNE=1 / roundelrun --autotune) needs scikit-learn, which cannot be "
            f"imported here ({exc}); install it (pip install 'roundel[autotune]' or pip install scikit-learn) "
            "on every host, or turn autotune off") from None


class BayesianOptimizer:
    """Maximise a noisy function over a box: a Gaussian process and expected improvement.

    ``bounds`` is one (low, high) pair per dimension. ``noise`` is the
    standard deviation of the observation noise on scores standardised to
    unit variance (Horovod's ``gaussian_process_noise``; the GP's ``alpha``
    is its square, as Horovod adds ``alpha**2`` to the kernel's diagonal).
    """

    def __init__(self, bounds, noise: float, seed: int = 0):
        import numpy as np

        self._np = np
        self._low = np.array([b[0] for b in bounds], dtype=float)
        self._span = np.array([b[1] - b[0] for b in bounds], dtype=float)
        self._noise = noise
        self._rng = np.random.default_rng(seed)
        self._x: list = []
        self._y: list[float] = []

    def add_sample(self, point, score: float) -> None:
        """Record ``score`` observed at ``point`` (in the box's own units)."""
        self._x.append((self._np.asarray(point, dtype=float) - self._low) / self._span)
        self._y.append(float(score))

    def next_point(self):
        """The point in the box with the highest expected improvement over the samples so far."""
        from scipy.optimize import minimize

        np = self._np
        dims = len(self._low)
        if not self._x:
            return self._low + self._span * self._rng.random(dims)
        gp, best = self._fit()

        def negative_ei(unit):
            return -_expected_improvement(gp, np.atleast_2d(unit), best)[0]

        candidates = self._rng.random((_CANDIDATES, dims))
        ei = _expected_improvement(gp, candidates, best)
        chosen, chosen_ei = candidates[int(np.argmax(ei))], float(np.max(ei))
        for start in candidates[np.argsort(ei)[-_LOCAL_SEARCHES:]]:
            found = minimize(negative_ei, start, method="L-BFGS-B", bounds=[(0.0, 1.0)] * dims)
            if found.success and -found.fun > chosen_ei:
                chosen, chosen_ei = np.clip(found.x, 0.0, 1.0), -float(found.fun)
        return self._low + self._span * chosen

    def _fit(self):
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import RBF, ConstantKernel

        np = self._np
        y = np.array(self._y)
        mu, sigma = 0.0, 1.0
        if len(y) >= 3 and y.std() > 0:  # standardised once there are enough samples, as Horovod does
            mu, sigma = y.mean(), y.std()
        kernel = ConstantKernel(1.0, (1e-2, 1e2)) * RBF(np.full(len(self._low), 0.3), (5e-2, 1e1))
        gp = GaussianProcessRegressor(kernel, alpha=self._noise ** 2 + 1e-10, n_restarts_optimizer=2,
                                      random_state=int(self._rng.integers(1 << 31)))
        x = np.array(self._x)
        with warnings.catch_warnings():  # a length scale at its bound is expected with few samples
            warnings.simplefilter("ignore", ConvergenceWarning)
            gp.fit(x, (y - mu) / sigma)
        return gp, float(np.max(gp.predict(x)))  # the best mean at a sample: the noisy model's incumbent


def _expected_improvement(gp, points, best: float):
    import numpy as np
    from scipy.stats import norm

    mean, std = gp.predict(points, return_std=True)
    improvement = mean - best - _EI_XI
    with np.errstate(divide="ignore", invalid="ignore"):
        z = improvement / std
        ei = improvement * norm.cdf(z) + std * norm.pdf(z)
    return np.where(std > 0, ei, 0.0)


class Autotuner:
    """Rank 0's tuning loop: windows of dispatched bytes in, new :class:`TunedParams` out.

    Opens the log file (``settings.autotune_log``) at once, truncating it,
    and writes a header and one row per sample; raises SettingsError when it
    cannot be written. ``hierarchical`` says whether the job's communicator can
    switch hierarchical allreduce and allgather (then both are tuned);
    ``bucketed()`` whether the job reduces gradients in buckets (asked once
    the fusion threshold and cycle time are chosen; then the bucket size is
    tuned). ``clock`` gives the time in seconds; the time spent choosing the
    next point is not counted in the next window.
    """

    def __init__(self, settings: Settings, hierarchical: bool = False, bucketed=lambda: False, seed: int = 0,
                 clock=time.monotonic):
        self._settings = settings
        self._clock = clock
        self._steps = settings.autotune_steps_per_sample
        self._warmups_left = settings.autotune_warmup_samples
        self._max_samples = settings.autotune_bayes_opt_max_samples
        # Horovod's order; each is tried the other way once the fusion threshold and cycle time are chosen
        self._switches = (["hierarchical_allreduce", "hierarchical_allgather"] if hierarchical else []) + \
            (["cache_enabled"] if settings.cache_capacity > 0 else [])
        self._bucketed = bucketed
        self._refinements: list | None = None  # once the search is over: the settings to try one at a time
        self._optimizer = BayesianOptimizer([FUSION_MIB_RANGE, CYCLE_MS_RANGE],
                                            settings.autotune_gaussian_process_noise, seed)
        self.params = initial_params(settings)
        self._initial = self.params
        self.samples: list[tuple[TunedParams, float]] = []  # every scored sample, in order
        self._window_start: float | None = None
        self._window_bytes = 0
        self._window_scores: list[float] = []  # of the sample being taken
        self._counts: dict[str, int] = {}
        self._log_file = None
        if settings.autotune_log:
            try:
                self._log_file = open(settings.autotune_log, "w", encoding="utf-8")
            except OSError as exc:
                raise SettingsError(f"cannot write the autotune log HOROVOD_AUTOTUNE_LOG="
                                    f"{settings.autotune_log!r}: {exc}; give a writable file path") from None
            self._log_file.write(",".join(LOG_COLUMNS) + "\n")
            self._log_file.flush()

    @property
    def done(self) -> bool:
        """True once the search has ended and ``params`` are final."""
        return not self.params.tuning

    def observe(self, batches) -> TunedParams | None:
        """Count the dispatched ``(members, Batch)`` pairs; return new params when a sample ends."""
        if self.done:
            return None
        changed = None
        for _, batch in batches:
            if batch.process_set_id != 0 or batch.error is not None:
                continue
            if self._window_start is None:
                self._window_start = self._clock()
            if any(self._counts.get(entry.name, 0) >= self._steps for entry in batch.entries):
                changed = self._end_window() or changed
                if self.done:
                    return changed
            for entry in batch.entries:
                self._counts[entry.name] = self._counts.get(entry.name, 0) + 1
                self._window_bytes += entry_bytes(entry)
        return changed

    def _end_window(self) -> TunedParams | None:
        elapsed = self._clock() - self._window_start
        self._window_scores.append(self._window_bytes / elapsed if elapsed > 0 else 0.0)
        self._window_bytes, self._counts = 0, {}
        self._window_start = self._clock()
        if len(self._window_scores) < WINDOWS_PER_SAMPLE:
            return None
        score = statistics.median(self._window_scores)
        self._window_scores = []
        if self._warmups_left > 0:
            self._warmups_left -= 1
            log.debug("roundel autotune: warm-up sample discarded (%d left): %s", self._warmups_left,
                      _describe(self.params, score))
            params = None
        else:
            params = self.score(score)
        self._window_start = self._clock()  # choosing the next point is not timed
        return params

    def score(self, score: float) -> TunedParams:
        """Record ``score`` for the current params; return the next params (the best, when done)."""
        self.samples.append((self.params, score))
        self._write_row(self.params, score)
        log.debug("roundel autotune: sample %d: %s", len(self.samples), _describe(self.params, score))
        taken = len(self.samples)
        if taken <= self._max_samples:
            self._optimizer.add_sample(self._point(self.params), score)
        if taken < self._max_samples:
            self.params = self._params_at(self._next_point())
            return self.params
        if self._refinements is None:
            self._refinements = [(name, None) for name in self._switches]
            if self._bucketed():
                base = self._settings.bucket_cap_mb or 25.0
                self._refinements += [("bucket_cap_mb", min(max(base * factor, BUCKET_MIB_RANGE[0]),
                                                            BUCKET_MIB_RANGE[1])) for factor in (0.5, 2.0)]
        best, best_score = max(self.samples, key=lambda sample: sample[1])
        trial = taken - self._max_samples  # the refinement to try next, in order
        if trial < len(self._refinements):
            name, value = self._refinements[trial]
            self.params = best._replace(**{name: not getattr(best, name) if value is None else value})
            return self.params
        self.params = best._replace(tuning=False)
        log.info("roundel autotune: done after %d samples; fixed the best: %s", taken,
                 _describe(self.params, best_score))
        if self._log_file is not None:
            self._log_file.close()
        return self.params

    def _next_point(self):
        index = len(self.samples) - 1  # the first sample was the configured point
        if index < len(START_POINTS):
            return list(START_POINTS[index])
        return self._optimizer.next_point()

    @staticmethod
    def _point(params: TunedParams) -> list:
        """``params`` in the box's units; a configured value outside the box counts as its nearest edge."""
        return [min(params.fusion_threshold / MIB, FUSION_MIB_RANGE[1]),
                min(max(params.cycle_time_ms, CYCLE_MS_RANGE[0]), CYCLE_MS_RANGE[1])]

    def _params_at(self, point) -> TunedParams:
        return self._initial._replace(fusion_threshold=int(round(float(point[0]) * MIB)),
                                      cycle_time_ms=round(float(point[1]), 3))

    def _write_row(self, params: TunedParams, score: float) -> None:
        if self._log_file is None:
            return
        s = self._settings
        row = (int(params.hierarchical_allreduce), int(params.hierarchical_allgather), int(s.torus_allreduce),
               int(params.cache_enabled), f"{params.cycle_time_ms:g}", f"{params.fusion_threshold / MIB:g}",
               f"{score:.6g}", f"{params.bucket_cap_mb:g}")
        self._log_file.write(",".join(map(str, row)) + "\n")
        self._log_file.flush()

    def close(self) -> None:
        """Close the log file (the job ended before the search did)."""
        if self._log_file is not None and not self._log_file.closed:
            self._log_file.close()


def _describe(params: TunedParams, score: float) -> str:
    def on(flag: bool) -> str:
        return "on" if flag else "off"

    return (f"fusion threshold {params.fusion_threshold / MIB:.2f} MiB, cycle time {params.cycle_time_ms:g} ms, "
            f"response cache {on(params.cache_enabled)}, hierarchical allreduce "
            f"{on(params.hierarchical_allreduce)}, hierarchical allgather {on(params.hierarchical_allgather)}, "
            f"gradient buckets {f'{params.bucket_cap_mb:g} MiB' if params.bucket_cap_mb else 'as configured'}; "
            f"score {score / 1e6:.3f} MB/s")
