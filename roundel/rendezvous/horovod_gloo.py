"""Workers started the way Horovod's Gloo launcher starts them, by another tool or by hand.

Such a process has its place in Horovod's variables (``HOROVOD_RANK``,
``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``/``SIZE``, ``HOROVOD_CROSS_RANK``/``SIZE``,
``HOROVOD_HOSTNAME``) and the rendezvous address in
``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT``, where Horovod runs its HTTP
rendezvous. roundel does not speak that protocol: rank 0 serves roundel's own
authenticated store at that address and port instead, and the others connect
to it. The secret is ``ROUNDEL_SECRET`` when exported (every rank must see the
same value); otherwise rank 0 makes one and hands it over in a private file
(:mod:`roundel.rendezvous.secret_file`, which needs the ranks to share that
directory: the same machine, or a shared home).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from roundel.errors import SettingsError
from roundel.rendezvous import identity as identity_env
from roundel.rendezvous import network, secret_file
from roundel.rendezvous.identity import LauncherIdentity
from roundel.rendezvous.store import RendezvousServer, new_secret

__all__ = ["ADDR", "PORT", "store"]

ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"


def _port(env: Mapping[str, str]) -> int:
    try:
        port = int(env[PORT])
    except (KeyError, ValueError):
        raise SettingsError(f"{PORT}={env.get(PORT)!r}: set it to the port rank 0 serves the rendezvous on "
                            f"(with {ADDR})") from None
    if not 0 < port < 65536:
        raise SettingsError(f"{PORT}={port} is not a port number")
    return port


def store(info: LauncherIdentity, env: Mapping[str, str], prefix: str, timeout_s: float
          ) -> tuple[str, int, bytes, RendezvousServer | None, Path | None]:
    """(store host, port, secret, the server rank 0 runs or None, the secret file rank 0 wrote or None).

    Raises SettingsError for malformed variables and RoundelInternalError when
    rank 0 cannot listen or the secret cannot be handed over in time.
    """
    host, port = env[ADDR], _port(env)
    secret = secret_file.exported_secret(env)
    path = None
    if secret is None:
        path = secret_file.job_secret_path("horovod", f"{host}.{port}.{prefix.rstrip('/')}", env)
    if info.rank != 0:
        if secret is None:
            assert path is not None  # made above for a job without an exported secret
            secret = secret_file.read(path, timeout_s, f"rank {info.rank} of {info.size} (Horovod's Gloo variables)"
                                      ).secret
        return host, port, secret, None, None
    secret = secret or new_secret()
    try:  # the address Horovod names is this host's: listen there only, unless asked otherwise
        bind = env.get(identity_env.RENDEZVOUS_BIND) or network.resolve(host)
    except ValueError as exc:
        raise SettingsError(f"{ADDR}={host!r}: {exc}") from None
    server = secret_file.serve(secret, bind, port, host, path, f"choose a free port ({PORT})")
    return host, port, secret, server, path
