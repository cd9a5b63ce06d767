"""A job secret handed from rank 0 to the other ranks through a private file.

Under ``srun`` and ``torchrun`` without an exported ``ROUNDEL_SECRET``, no
launcher channel can carry a secret privately: Slurm's variables are public
facts and torchrun's TCPStore has no authentication. Rank 0 then makes a fresh
random secret and writes it to a file only its user can read, in
``~/.roundel/jobs`` (or ``ROUNDEL_SECRET_DIR``); the other ranks, running as
the same user on hosts that share the home directory, read it from there,
together with the address of rank 0's store (so a forged address in
torchrun's store cannot send them elsewhere).

The file is created under a temporary name with ``O_EXCL`` and mode 0600, then
renamed into place, so a reader never sees it half written. A reader accepts
it only if it is a regular file (not a link), owned by the reader's user, with
mode 0600, in a directory owned by that user that no group or other user can
write to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Mapping

from roundel.errors import RoundelInternalError, SettingsError
from roundel.rendezvous import identity as identity_env
from roundel.rendezvous.store import RendezvousServer

__all__ = ["SECRET_DIR", "JobSecret", "SecretFileError", "job_secret_path", "publish", "read", "remove"]

SECRET_DIR = "ROUNDEL_SECRET_DIR"
_SECRET_BYTES = 32
_MAX_FILE_BYTES = 4096
_POLL_S = 0.05
_FIX = ("export ROUNDEL_SECRET=$(openssl rand -hex 32) before starting the job (every rank must see the "
        "same value), or give every rank the same private directory with ROUNDEL_SECRET_DIR (a home "
        "directory shared by the hosts)")


def exported_secret(env: Mapping[str, str]) -> bytes | None:
    """``ROUNDEL_SECRET`` when set (it always wins over a secret rank 0 would make), else None.

    Raises SettingsError when it is not hex.
    """
    value = env.get(identity_env.SECRET)
    if not value:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise SettingsError(f"{identity_env.SECRET} must be hex digits; make one with "
                            "export ROUNDEL_SECRET=$(openssl rand -hex 32)") from None


class SecretFileError(RoundelInternalError):
    """The job secret file is missing, unsafe, or malformed."""


@dataclasses.dataclass(frozen=True)
class JobSecret:
    """What a secret file holds: the job secret and where rank 0's store listens."""

    secret: bytes
    host: str
    port: int


def secret_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The directory of job secret files: ``ROUNDEL_SECRET_DIR``, else ``~/.roundel/jobs``."""
    env = os.environ if environ is None else environ
    if env.get(SECRET_DIR):
        return Path(env[SECRET_DIR])
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".roundel" / "jobs"


def job_secret_path(launcher: str, job_key: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where rank 0 of the job that ``launcher`` identifies by ``job_key`` writes the secret."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", job_key)[:80]
    digest = hashlib.sha256(job_key.encode()).hexdigest()[:12]
    return secret_dir(environ) / f"{launcher}-{readable}-{digest}"


def _check_dir(directory: Path) -> None:
    try:
        info = os.stat(directory)
    except OSError as exc:
        raise SecretFileError(f"cannot use the job secret directory {directory}: {exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise SecretFileError(f"the job secret directory {directory} is not a directory")
    if info.st_uid != os.getuid():
        raise SecretFileError(f"refusing the job secret directory {directory}: it belongs to uid "
                              f"{info.st_uid}, not to this user (uid {os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SecretFileError(f"refusing the job secret directory {directory}: other users can write to it "
                              f"(mode {stat.S_IMODE(info.st_mode):03o}); run chmod 700 {directory}")


def _ensure_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise SecretFileError(f"cannot create the job secret directory {directory}: {exc}; {_FIX}") from None
    _check_dir(directory)


def publish(path: Path, job: JobSecret) -> None:
    """Write ``job`` to ``path`` atomically, readable by this user only (mode 0600).

    Creates the directory with mode 0700 when missing. Raises SecretFileError
    when the directory is unsafe or cannot be written.
    """
    _ensure_dir(path.parent)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(temporary, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            data = json.dumps({"secret": job.secret.hex(), "host": job.host, "port": job.port}).encode()
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except OSError as exc:
        remove(temporary)
        raise SecretFileError(f"cannot write the job secret file {path}: {exc}; {_FIX}") from None


def _check_file(info: os.stat_result, path: Path) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise SecretFileError(f"refusing the job secret file {path}: not a regular file")
    if info.st_uid != os.getuid():
        raise SecretFileError(f"refusing the job secret file {path}: it belongs to uid {info.st_uid}, "
                              f"not to this user (uid {os.getuid()})")
    if stat.S_IMODE(info.st_mode) != 0o600:
        raise SecretFileError(f"refusing the job secret file {path}: its mode is "
                              f"{stat.S_IMODE(info.st_mode):03o}, not 600 (others may have read it)")


def _open_when_present(path: Path, deadline: float, who: str, fix: str) -> int:
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise SecretFileError(
                    f"{who} found no job secret at {path}: rank 0 writes it there for ranks that share its "
                    f"home directory, and it did not appear in time (ranks on hosts without that "
                    f"directory cannot see it). To fix: {fix}") from None
            time.sleep(_POLL_S)
        except OSError as exc:  # ELOOP for a symbolic link, EACCES, ...
            raise SecretFileError(f"refusing the job secret file {path}: {exc}") from None


def read(path: Path, timeout_s: float, who: str = "this rank", fix: str = _FIX) -> JobSecret:
    """What rank 0 wrote to ``path``, waiting up to ``timeout_s`` seconds for it to appear.

    ``who`` names this process in errors, ``fix`` says what to do when the
    file never appears. Raises SecretFileError when the file does not appear
    in time, or is not a 0600 regular file of this user in a directory no one
    else can write to.
    """
    fd = _open_when_present(path, time.monotonic() + timeout_s, who, fix)
    try:
        _check_file(os.fstat(fd), path)
        _check_dir(path.parent)
        content = os.read(fd, _MAX_FILE_BYTES)
    finally:
        os.close(fd)
    try:
        fields = json.loads(content)
        job = JobSecret(bytes.fromhex(fields["secret"]), str(fields["host"]), int(fields["port"]))
    except (ValueError, TypeError, KeyError):
        job = None
    if job is None or len(job.secret) != _SECRET_BYTES:
        raise SecretFileError(f"refusing the job secret file {path}: it does not hold a {_SECRET_BYTES}-byte "
                              "secret and a store address as rank 0 writes them")
    return job


def remove(path: Path) -> None:
    """Delete ``path`` if it exists (best effort)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def serve(secret: bytes, bind: str, port: int, host: str, path, what_to_do: str) -> RendezvousServer:
    """Rank 0's store on ``bind:port`` (0: any free port), with the secret and the port bound published at
    ``path`` (None: nothing to publish).

    Raises RoundelInternalError ending with ``what_to_do`` when the port cannot be bound; the
    store is stopped again if publishing fails.
    """
    server = RendezvousServer(secret, bind, port)
    try:
        server.start()
    except OSError as exc:
        raise RoundelInternalError(f"rank 0 could not listen on {bind}:{port} for the rendezvous ({exc}); "
                                   f"{what_to_do}") from None
    if path is not None:
        try:
            publish(path, JobSecret(secret, host, server.port))
        except BaseException:
            server.stop()
            raise
    return server
