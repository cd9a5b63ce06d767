"""CUDA tensors under the real launcher: NCCL, and host staging over Gloo (``HOROVOD_GPU_OPERATIONS=gloo``).

These need a GPU and skip, saying so, on a machine without one. NCCL allows
one rank per GPU, so its two-rank tests need two GPUs; with one GPU, NCCL is
tested in a job of one rank, and two ranks sharing it must fail clearly.
The collectives worker runs its NumPy-checked scenarios with CUDA inputs.
"""

import pytest
import torch

from launch_util import assert_checks_passed, run_job

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
    result = run_job(2, "torch_cuda.py", "devices,side_stream,training", env={"HOROVOD_GPU_OPERATIONS": "gloo"},
                     timeout=180)
    assert_checks_passed(result, 2, "devices", "side_stream", "training")


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


@needs_nccl
def test_waiting_for_a_slow_gpu_sleeps_and_results_read_on_another_stream():
    # the executor records a blocking event and a finalizer thread waits on it: no core spins for the GPU
    for env in ({}, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}):
        result = run_job(1, "torch_cuda.py", "slow_gpu_cpu,other_stream_reads,side_stream", env=env, timeout=180)
        assert_checks_passed(result, 1, "slow_gpu_cpu", "other_stream_reads", "side_stream")
