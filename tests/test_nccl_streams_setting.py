"""HOROVOD_NUM_NCCL_STREAMS: roundel runs NCCL on one stream of its own per rank, so any other count is refused,
by ``hvd.init()``'s settings and by ``roundelrun``, saying what roundel does instead."""

import sys

import pytest

from launch_util import LAUNCHER, describe, run_command
from roundel.common.settings import Settings
from roundel.errors import SettingsError


def test_one_stream_is_taken_and_is_the_default():
    assert Settings.from_env({}).num_nccl_streams == 1
    assert Settings.from_env({"HOROVOD_NUM_NCCL_STREAMS": "1"}).num_nccl_streams == 1


@pytest.mark.parametrize("raw", ["2", "4"])
def test_more_streams_are_refused_saying_what_roundel_does(raw):
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"HOROVOD_NUM_NCCL_STREAMS": raw})
    message = str(info.value)
    assert message.startswith(f"HOROVOD_NUM_NCCL_STREAMS={raw!r}: ")
    assert "one CUDA stream of its own" in message and "set it to 1 or unset it" in message


def test_roundelrun_refuses_the_flag_with_another_count_before_starting_workers():
    result = run_command([*LAUNCHER, "-np", "1", "--num-nccl-streams", "2", sys.executable, "-c", "print('ran')"],
                         timeout=60)
    assert result.returncode != 0, describe(result)
    assert "ran" not in result.stdout
    assert "--num-nccl-streams 2" in result.stderr and "set it to 1 or unset it" in result.stderr, describe(result)
