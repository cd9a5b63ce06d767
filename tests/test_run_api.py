"""``roundel.run(fn, ...)``: a function run on every rank through the real launcher, as ``horovod.run`` does."""

import os
import sys

import cloudpickle
import pytest

import roundel
from roundel.runner.run_api import RankFailedError

# this test module is not importable in the workers: ship its functions by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rank_and_sum(offset, scale=1):
    import torch
    import roundel.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "size": hvd.size(), "sum": total * scale, "pid": os.getpid()}


def fails_on_rank_one():
    if os.environ["ROUNDEL_RANK"] == "1":
        raise KeyError("rank one cannot find its key")
    return "fine"


def test_results_come_back_in_rank_order():
    results = roundel.run(rank_and_sum, args=(10,), kwargs={"scale": 2}, np=2)
    assert [(r["rank"], r["size"], r["sum"]) for r in results] == [(0, 2, 42.0), (1, 2, 42.0)]
    assert results[0]["pid"] != results[1]["pid"] != os.getpid()


def test_horovod_spelling_num_proc_and_three_ranks():
    results = roundel.run(lambda: int(os.environ["ROUNDEL_RANK"]) ** 2, num_proc=3, use_gloo=True)
    assert results == [0, 1, 4]


def test_a_raising_rank_reaches_the_caller_with_its_traceback():
    with pytest.raises(RankFailedError) as info:
        roundel.run(fails_on_rank_one, np=2)
    assert info.value.rank == 1
    assert "rank 1 raised" in str(info.value)
    assert "KeyError: 'rank one cannot find its key'" in info.value.traceback_text
    assert "in fails_on_rank_one" in info.value.traceback_text


def test_a_dying_rank_is_an_error():
    with pytest.raises(RankFailedError, match="the job failed"):
        roundel.run(lambda: os._exit(3), np=2)


def test_bad_arguments_are_a_value_error(capfd):
    with pytest.raises(ValueError, match="refused the arguments"):
        roundel.run(len, np=2, hosts="-oProxyCommand=x:2")
    assert "starts with '-'" in capfd.readouterr().err


def test_function_travels_through_the_store_not_the_command_line():
    results = roundel.run(lambda: open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\0"), np=1)
    assert results[0][-3:] == [b"-m", b"roundel.runner.run_api", b""]
