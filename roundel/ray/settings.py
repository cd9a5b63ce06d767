"""The settings of a Ray job (Horovod's ``MiniSettings``), and the rendezvous store a Ray driver runs."""

from __future__ import annotations

import dataclasses

import ray

from roundel.common.settings import Settings, setting
from roundel.rendezvous import network
from roundel.rendezvous.store import RendezvousServer, new_secret

__all__ = ["RaySettings", "start_store"]

_DEFAULTS = Settings()  # the settings table's defaults: Horovod's Ray settings read no variables


@dataclasses.dataclass
class RaySettings:
    """What ``RayExecutor.create_settings`` / ``ElasticRayExecutor.create_settings`` return.

    ``timeout_s`` bounds each rank's ``init()`` (``ROUNDEL_START_TIMEOUT``),
    ``placement_group_timeout_s`` the wait for Ray to place the actors,
    ``elastic_timeout_s`` an elastic job's wait for enough workers and for
    them to join. ``nics``: network interfaces to use (the first one's
    address serves the rendezvous store and carries the ranks' traffic);
    without them the store listens on the driver's Ray node address. The
    ssh settings are accepted for Horovod's signature: Ray starts the
    workers, so roundel never uses ssh here. ``discovery`` is set by
    ``ElasticRayExecutor`` (or by the caller, with ``override_discovery=False``).
    """

    timeout_s: float = _DEFAULTS.start_timeout_s
    placement_group_timeout_s: float = 100
    nics: tuple[str, ...] | None = None
    ssh_identity_file: str | None = None
    elastic_timeout_s: float = _DEFAULTS.elastic_timeout_s
    min_num_proc: int | None = None
    max_num_proc: int | None = None
    reset_limit: int | None = None
    discovery: object | None = None  # an elastic job's hosts (find_available_hosts_and_slots())

    def __post_init__(self):
        if isinstance(self.nics, str):
            self.nics = tuple(n for n in self.nics.split(",") if n)
        elif self.nics is not None:
            self.nics = tuple(self.nics)
        for name in ("timeout_s", "placement_group_timeout_s", "elastic_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: give a number of seconds above 0")

    def worker_env(self) -> dict[str, str]:
        """The settings every rank's actor gets in its environment."""
        env = {setting("start_timeout_s").var: repr(float(self.timeout_s)), "PYTHONUNBUFFERED": "1"}
        if self.nics:
            env[setting("network_interface").var] = self.nics[0]
        return env

    def store_address(self) -> str:
        """Where the driver's store listens and the ranks reach it: the first nic's address, else the
        address Ray gave the driver's node."""
        if self.nics:
            return network.interface_address(self.nics[0])
        return ray.util.get_node_ip_address()


def start_store(address: str) -> tuple[RendezvousServer, bytes]:
    """A rendezvous store with a fresh secret, listening on ``address``; (server, secret)."""
    secret = new_secret()
    server = RendezvousServer(secret, host=address)
    server.start()
    return server, secret
