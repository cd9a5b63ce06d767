"""A script started with Horovod's own Gloo variables (no roundelrun) joins a job, as under horovodrun."""

import os
import socket
import subprocess
import sys

from launch_util import clean_env

CODE = ("import torch, roundel.torch as hvd; hvd.init(); "
        "s = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item(); "
        "print('ID', hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), "
        "hvd.cross_size(), s, flush=True)")


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def horovod_env(rank, size, port, **extra):
    """What Horovod's gloo_run gives rank ``rank`` of ``size`` on one host."""
    return clean_env({"HOROVOD_RANK": rank, "HOROVOD_SIZE": size, "HOROVOD_LOCAL_RANK": rank,
                      "HOROVOD_LOCAL_SIZE": size, "HOROVOD_CROSS_RANK": 0, "HOROVOD_CROSS_SIZE": 1,
                      "HOROVOD_HOSTNAME": "localhost", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                      "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_CONTROLLER": "gloo",
                      "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_TIMEOUT_SECONDS": 30, **extra})


def run_ranks(size, **extra):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", CODE], env=horovod_env(r, size, port, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(size)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=90))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return procs, outs


def test_horovod_gloo_variables_start_a_job(tmp_path):
    procs, outs = run_ranks(3, ROUNDEL_SECRET_DIR=tmp_path / "secrets")
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    ids = sorted(out.split() for out, _ in outs)
    assert ids == [["ID", str(r), "3", str(r), "3", "0", "1", "3.0"] for r in range(3)]
    assert os.listdir(tmp_path / "secrets") == []  # the secret file is gone once every rank joined


def test_horovod_gloo_variables_with_an_exported_secret():
    procs, outs = run_ranks(2, ROUNDEL_SECRET="ab" * 32)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(out.split() for out, _ in outs) == [["ID", str(r), "2", str(r), "2", "0", "1", "1.0"] for r in range(2)]
