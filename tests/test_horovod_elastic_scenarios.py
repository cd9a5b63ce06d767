"""Horovod 0.28.1's elastic scenarios (its test/integration/elastic_common.py) under the real ``roundelrun``.

Each scenario runs tests/workers/horovod_style_elastic.py, which takes the
arguments of Horovod's elastic test scripts and uses what they use
(``state._host_messages``, ``optimizer.lr``), with ``horovodrun``'s flags,
and checks what Horovod's test checks (tests/horovod_elastic_scenarios.py).
PyTorch runs all of them; TensorFlow 2 the ones where its state, its reset
callback and the host notices matter. Horovod's own scripts run the same
way with ``python tests/horovod_elastic_scenarios.py PATH/TO/elastic_torch_main.py``.
"""

from __future__ import annotations

import pytest

from horovod_elastic_scenarios import SCENARIOS, run
from launch_util import WORKERS_DIR

SCRIPT = str(WORKERS_DIR / "horovod_style_elastic.py")
TENSORFLOW = ("hosts_added_and_removed[2 slots]", "single_rank_failure[kill]",
              "resurrecting_blacklisted_hosts_exponential_backoff")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_torch(scenario, tmp_path):
    run(scenario, SCRIPT, tmp_path)


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.name in TENSORFLOW], ids=list(TENSORFLOW))
def test_tensorflow(scenario, tmp_path):
    run(scenario, SCRIPT, tmp_path, script_args=["--framework", "tensorflow"])
