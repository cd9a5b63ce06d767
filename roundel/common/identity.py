"""A worker's place in the job, as the launcher hands it over in the environment.

The launcher writes these variables (``ROUNDEL_*``, mirrored as the
``HOROVOD_*`` names Horovod's gloo launcher sets, for scripts that read them);
``hvd.init()`` reads them back.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from roundel.common.errors import SettingsError

RENDEZVOUS_ADDR = "ROUNDEL_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT = "ROUNDEL_RENDEZVOUS_PORT"
SECRET = "ROUNDEL_SECRET"

_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")


@dataclasses.dataclass(frozen=True)
class Identity:
    """Rank numbers as Horovod defines them, plus the host's name."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str = ""

    def to_env(self) -> dict[str, str]:
        """The environment variables that carry this identity to a worker."""
        env = {}
        for field in _FIELDS:
            value = str(getattr(self, field))
            env["ROUNDEL_" + field.upper()] = value
            env["HOROVOD_" + field.upper()] = value
        env["ROUNDEL_HOSTNAME"] = env["HOROVOD_HOSTNAME"] = self.hostname
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Identity | None":
        """The identity the launcher set, or None if this process was not launched by roundelrun."""
        env = os.environ if environ is None else environ
        if "ROUNDEL_RANK" not in env:
            return None
        values = {}
        for field in _FIELDS:
            var = "ROUNDEL_" + field.upper()
            try:
                values[field] = int(env[var])
            except (KeyError, ValueError):
                raise SettingsError(
                    f"{var}={env.get(var)!r}: the launcher's identity variables are incomplete; "
                    "start the script with roundelrun"
                ) from None
        ident = cls(hostname=env.get("ROUNDEL_HOSTNAME", ""), **values)
        ident.validate()
        return ident

    def validate(self) -> None:
        """Raise SettingsError when the numbers contradict each other."""
        if not (0 <= self.rank < self.size):
            raise SettingsError(f"rank {self.rank} is outside a job of size {self.size}")
        if not (0 <= self.local_rank < self.local_size):
            raise SettingsError(f"local rank {self.local_rank} is outside local size {self.local_size}")
        if not (0 <= self.cross_rank < self.cross_size):
            raise SettingsError(f"cross rank {self.cross_rank} is outside cross size {self.cross_size}")


def rendezvous_env(host: str, port: int, secret_hex: str) -> dict[str, str]:
    """The variables that tell a worker where the rendezvous store is and the job's secret."""
    return {RENDEZVOUS_ADDR: host, RENDEZVOUS_PORT: str(port), SECRET: secret_hex}
