"""Process sets under the real launcher: static (``init(process_sets=...)``) and dynamic
(``add_process_set``/``remove_process_set``), every collective checked against NumPy over the
members only, disjoint sets running at once, and clear errors for non-members and removed sets.
"""

import pytest

from launch_util import assert_checks_passed, describe, rank_lines, run_job

WORKER = "torch_process_sets.py"
SCENARIOS = ("static", "concurrent", "dynamic", "many_sets")


@pytest.mark.parametrize("np", [3, 4])
def test_process_sets(np):
    result = run_job(np, WORKER, ",".join(SCENARIOS), timeout=90)
    assert_checks_passed(result, np, *SCENARIOS)
    # a non-member's call names the rank and the set's members
    odd_ranks = list(range(1, np, 2))
    assert f"non-member error: rank 0 is not a member of process set 2 {odd_ranks}" in \
        rank_lines(result.stdout, 0, "stdout"), describe(result)
    for rank in range(np):
        assert any(line.startswith("removed-set error:") and "not registered" in line
                   for line in rank_lines(result.stdout, rank, "stdout")), describe(result)
