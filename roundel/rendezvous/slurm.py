"""What a task started by Slurm's ``srun`` can read about its job step.

Slurm names hosts with its hostlist grammar: a comma-separated list of names
in which bracket groups stand for ranges (``node[01-04,9]``), several groups
multiply out with the first varying slowest (``rack[1-2]-node[01-02]`` is
rack1-node01, rack1-node02, rack2-node01, rack2-node02), text may follow a
group (``gpu[1-2]-ib``), and a range keeps the zero padding of its first
number (``n[08-10]`` is n08, n09, n10). :func:`expand_hostlist` gives the names
in Slurm's order, as ``scontrol show hostnames`` does.
"""

from __future__ import annotations

import itertools
import re
from typing import Mapping

__all__ = ["expand_hostlist", "step_nodes", "this_node", "rank0_on_first_node", "single_node"]

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NODE_COUNT_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top_level(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets; raises ValueError for unbalanced brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' at position {i}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("a '[' is never closed")
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _expand_group(group: str) -> list[str]:
    """The names a bracket group's inside stands for: ``01-03,7`` is 01, 02, 03, 7."""
    out: list[str] = []
    for item in group.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match:
            raise ValueError(f"[{group}] holds {item!r}, which is neither a number nor a range a-b")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {item!r} in [{group}] runs backwards")
        width = len(low)  # Slurm pads every number of a range to the width of its first one
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def _expand_name(name: str) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", name)  # literal, group, literal, group, ..., literal
    choices = [[piece] if i % 2 == 0 else _expand_group(piece) for i, piece in enumerate(pieces)]
    return ["".join(combination) for combination in itertools.product(*choices)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host name of a Slurm hostlist such as ``node[03-05,9],gpu1`` in Slurm's order.

    Raises ValueError naming what is malformed.
    """
    try:
        names = [host for name in _split_top_level(hostlist) for host in _expand_name(name)]
    except ValueError as exc:
        raise ValueError(f"cannot read the Slurm node list {hostlist!r}: {exc}") from None
    if not names:
        raise ValueError(f"the Slurm node list {hostlist!r} names no host")
    return names


def step_nodes(env: Mapping[str, str]) -> list[str] | None:
    """The job step's nodes (``SLURM_STEP_NODELIST``, else the job's), or None when Slurm set neither."""
    for var in _NODELIST_VARS:
        if env.get(var):
            return expand_hostlist(env[var])
    return None


def this_node(env: Mapping[str, str]) -> str | None:
    """The Slurm name of the node this task runs on (``SLURMD_NODENAME``), or None outside a Slurm task."""
    return env.get("SLURMD_NODENAME") or None


def rank0_on_first_node(env: Mapping[str, str]) -> bool:
    """Whether task 0 of the step runs on the step's first node, as every distribution but
    ``arbitrary`` (``srun -m arbitrary`` with ``SLURM_HOSTFILE``) places it."""
    return not env.get("SLURM_DISTRIBUTION", "").startswith("arbitrary")


def single_node(env: Mapping[str, str]) -> bool:
    """Whether the job step runs on one node."""
    for var in _NODE_COUNT_VARS:
        if env.get(var):
            return env[var].strip() == "1"
    nodes = step_nodes(env)
    return nodes is not None and len(set(nodes)) == 1
