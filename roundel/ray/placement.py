"""Where a static Ray job's actors go, and the rank numbers that follows from where they landed."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roundel.rendezvous.identity import Identity, cross_ranks

__all__ = ["actor_options", "create_placement_group", "identities"]


def create_placement_group(resources: dict[str, float], bundles: int, strategy: str,
                           timeout_s: float) -> PlacementGroup:
    """A placement group of ``bundles`` copies of ``resources``, ready; TimeoutError (saying what the
    cluster has) when Ray cannot place it within ``timeout_s`` seconds."""
    group = ray.util.placement_group([dict(resources) for _ in range(bundles)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not place {bundles} bundle(s) of {resources} ({strategy}) within {timeout_s:g} s "
            f"(placement_group_timeout_s); the cluster has {ray.available_resources()} available. Ask for "
            "fewer workers or resources per worker, or add nodes")
    return group


def actor_options(group: PlacementGroup, bundle_index: int, cpus: float, gpus: float) -> dict:
    """Ray options putting an actor into bundle ``bundle_index`` of ``group``."""
    return {"num_cpus": cpus, "num_gpus": gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=False)}


def identities(node_ids: list[str]) -> tuple[list[int], list[Identity]]:
    """Rank numbers for actors on ``node_ids`` (one entry per actor).

    Returns the actors' indices in rank order (the actors of one node get
    consecutive ranks, nodes in the order their first actor appears) and each
    rank's Identity, its host being the node id.
    """
    by_node: dict[str, list[int]] = {}
    for index, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(index)
    order = [index for indices in by_node.values() for index in indices]
    table = [(node, local) for node, indices in by_node.items() for local in range(len(indices))]
    return order, cross_ranks(table)
