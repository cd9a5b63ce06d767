"""CUDA tensors under the real launcher: NCCL, and host staging over Gloo (``HOROVOD_GPU_OPERATIONS=gloo``).

These need a GPU and skip, saying so, on a machine without one. NCCL allows
one rank per GPU, so its two-rank tests need two GPUs; with one GPU, NCCL is
tested in a job of one rank, and two ranks sharing it must fail clearly.
The collectives worker runs its NumPy-checked scenarios with CUDA inputs.
The executor's GPU path is also checked in order without a GPU, with fakes
for torch.cuda's streams and events (``tests/test_executor_streams_unit.py``).
"""

import time

import pytest
import torch

from launch_util import assert_checks_passed, describe, rank_lines, run_job

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NCCL = GPUS > 0 and torch.distributed.is_nccl_available()

needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; this machine has none")
needs_nccl = pytest.mark.skipif(not NCCL, reason="needs a CUDA GPU and torch built with NCCL; this machine has "
                                                 f"{GPUS} GPU(s)")
needs_two_gpus = pytest.mark.skipif(GPUS < 2 or not NCCL, reason="needs 2 CUDA GPUs and NCCL (NCCL allows one "
                                                                 f"rank per GPU); this machine has {GPUS}")

COLLECTIVES = ("allreduce", "allreduce_sizes", "grouped", "allgather", "broadcast", "alltoall", "reducescatter",
               "join", "autograd")
ON_CUDA = {"ROUNDEL_TEST_DEVICE": "cuda"}
THROUGH_HOST = {**ON_CUDA, "HOROVOD_GPU_OPERATIONS": "gloo"}


@needs_gpu
def test_collectives_through_host_memory():
    result = run_job(2, "torch_collectives.py", ",".join(COLLECTIVES), env=THROUGH_HOST, timeout=300)
    assert_checks_passed(result, 2, *COLLECTIVES)


@needs_gpu
def test_devices_and_training_through_host_memory():
    # staged_reuse: the pinned host buffers, reused back to back across sizes and dtypes
    scenarios = ("devices", "side_stream", "training", "staged_reuse")
    result = run_job(2, "torch_cuda.py", ",".join(scenarios), env={"HOROVOD_GPU_OPERATIONS": "gloo"}, timeout=180)
    assert_checks_passed(result, 2, *scenarios)


def _over_nccl(np: int, collectives) -> None:
    result = run_job(np, "torch_collectives.py", ",".join(collectives), env=ON_CUDA, timeout=300)
    assert_checks_passed(result, np, *collectives)
    result = run_job(np, "torch_cuda.py", "devices,side_stream,training", timeout=180)
    assert_checks_passed(result, np, "devices", "side_stream", "training")


@needs_nccl
def test_collectives_over_nccl_in_a_job_of_one():
    _over_nccl(1, [name for name in COLLECTIVES if name not in ("allreduce_sizes", "join")])  # these need peers


@needs_two_gpus
def test_collectives_over_nccl():
    _over_nccl(2, COLLECTIVES)


@needs_nccl
def test_two_ranks_on_one_gpu_fail_clearly_over_nccl():
    result = run_job(2, "torch_cuda.py", "shared_gpu", timeout=120)
    assert_checks_passed(result, 2, "shared_gpu")


@needs_two_gpus
def test_a_rank_that_joins_first_contributes_on_its_own_gpu():
    result = run_job(2, "torch_cuda.py", "join_device", timeout=180)
    assert_checks_passed(result, 2, "join_device")


STREAMS = ("slow_gpu_cpu", "other_stream_reads", "side_stream", "allocator")


@needs_nccl
def test_streams_events_and_the_allocator_with_and_without_its_cache():
    # slow_gpu_cpu: a collective returns without waiting for the GPU, and waiting for its result sleeps;
    # other_stream_reads: a result synchronized on another stream is complete there, and later work on the
    # submitting stream does not delay it; side_stream: an input written on a side stream is reduced as written;
    # allocator: an input dropped right after submission is not reused before the GPU has finished with it
    for env in ({}, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}):
        result = run_job(1, "torch_cuda.py", ",".join(STREAMS), env=env, timeout=180)
        assert_checks_passed(result, 1, *STREAMS)


@needs_nccl
def test_a_model_captured_as_a_cuda_graph_trains_under_distributed_optimizer():
    result = run_job(1, "torch_cuda.py", "graphed", timeout=180)
    assert_checks_passed(result, 1, "graphed")


@needs_nccl
def test_a_collective_submitted_during_cuda_graph_capture_is_refused():
    result = run_job(1, "torch_cuda.py", "graph_capture", timeout=180)
    assert_checks_passed(result, 1, "graph_capture")


# NCCL's own timeout (roundel's collective timeout) is set far above the survivor's bound, so that only roundel's
# abort can end its kernel in time; the job's bound is mostly start-up (CUDA, NCCL's communicator), and the
# launcher's SIGKILL of a survivor 5 s after it stopped the others
KILLED_TIMEOUT_S = 60
KILLED_BOUND_S = 10
KILLED_JOB_BOUND_S = 90


@needs_two_gpus
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_in_the_middle_of_an_nccl_collective_ends_the_job_with_roundels_error(victim):
    # the victim's part of an allreduce waits behind seconds of GPU work while the survivor's NCCL kernel waits
    # for it; the victim is SIGKILLed: the survivor (the coordinator when victim is 1, not when it is 0) gets
    # HorovodInternalError naming it, for the collective cut short too, its GPU freed by the abort, within
    # KILLED_BOUND_S of submitting; the launcher exits non-zero naming the victim
    env = {"ROUNDEL_TEST_VICTIM": str(victim), "HOROVOD_GLOO_TIMEOUT_SECONDS": str(KILLED_TIMEOUT_S)}
    started = time.monotonic()
    result = run_job(2, "torch_cuda.py", "killed_in_nccl", env=env, timeout=180)
    took = time.monotonic() - started
    survivor = 1 - victim
    assert result.returncode == 128 + 9, describe(result)
    assert result.stderr.rstrip().splitlines()[-1] == (
        f"roundelrun: rank {victim} (host localhost) was killed by signal SIGKILL; stopped the other ranks"
    ), describe(result)
    lines = rank_lines(result.stdout, survivor, "stdout")
    assert "CHECKS PASSED killed_in_nccl" in lines, describe(result)
    measured = [float(line.split()[1]) for line in lines if line.startswith("MEASURED ")]
    assert len(measured) == 1 and measured[0] < KILLED_BOUND_S, describe(result)
    assert any("HorovodInternalError" in line and f"rank {victim}" in line for line in lines), describe(result)
    assert took < KILLED_JOB_BOUND_S, f"the job took {took:.0f} s to end\n" + describe(result)


@needs_nccl
def test_a_compiled_model_trains_on_the_gpu_as_its_eager_twin():
    result = run_job(1, "torch_compile.py", "compiled_training", env=ON_CUDA, timeout=600)
    assert_checks_passed(result, 1, "compiled_training")
