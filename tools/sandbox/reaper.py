"""The engine side of the sandbox: connecting to Docker, labelling containers, reaping orphans.

Every sandbox container carries :data:`LABEL` (its owner, ``host:pid``), :data:`INSTANCE_LABEL` (the
:class:`~toolgym.tools.sandbox.DockerSandbox` that made it), :data:`DEADLINE_LABEL` (Unix time) and
:data:`UID_LABEL` (the uid its untrusted code runs as, which no other sandbox container on the engine
shares: :func:`uids_in_use`).
Containers end themselves at their deadline (PID 1 is a ``sleep`` of the lifetime and they are
auto-removed, see :mod:`toolgym.tools.sandbox.policy`); the reaper is the second line: it removes
containers of dead owners on this host and containers :data:`DEADLINE_GRACE_S` past their deadline,
at start-up, every few seconds while a sandbox is open, and at exit. Containers of live processes
within their deadline are left alone, so several processes can share one engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

from toolgym.errors import MissingDependencyError, SandboxError

__all__ = [
    "DEADLINE_GRACE_S",
    "DEADLINE_LABEL",
    "INSTANCE_LABEL",
    "LABEL",
    "UID_LABEL",
    "SandboxUnavailable",
    "docker_client",
    "engine_remaps_users",
    "leaked_containers",
    "reap_containers",
    "reap_forever",
    "uids_in_use",
]

log = logging.getLogger(__name__)

#: Label carried by every sandbox container (the value is the owner's ``host:pid``).
LABEL = "toolgym.sandbox"
#: Label holding the container's deadline (Unix time).
DEADLINE_LABEL = "toolgym.deadline"
#: Label naming the :class:`~toolgym.tools.sandbox.DockerSandbox` instance that created the container.
INSTANCE_LABEL = "toolgym.sandbox.instance"
#: Label holding the uid the container's untrusted code runs as.
UID_LABEL = "toolgym.sandbox.uid"
#: Seconds past its deadline before the reaper removes a container: the container stops itself at
#: the deadline, so the reaper only acts when that failed.
DEADLINE_GRACE_S = 5.0

_FIX = (
    "Fix: install and start Docker (Debian: `apt-get install -y docker.io && dockerd &`; or start the "
    "Docker service), then build the image with `toolgym sandbox build`. "
    "Set TOOLGYM_SKIP_DOCKER=1 to skip Docker tests on a machine without it."
)


class SandboxUnavailable(SandboxError):
    """No usable Docker engine or sandbox image; the message says how to fix it."""


def docker_client() -> Any:
    """A docker SDK client for the local engine, or :class:`SandboxUnavailable` saying how to get one."""
    try:
        import docker
        import docker.errors
    except ImportError:
        raise MissingDependencyError("docker", "docker", "the Docker sandbox") from None
    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except docker.errors.DockerException as exc:
        raise SandboxUnavailable(f"cannot reach a Docker engine ({exc}). {_FIX}") from None
    return client


def owner_label() -> str:
    """This process's owner label, ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_orphan(labels: dict[str, str], now: float) -> bool:
    """Past its deadline (plus grace), or owned by a process on this host that no longer exists."""
    try:
        if float(labels.get(DEADLINE_LABEL, "inf")) + DEADLINE_GRACE_S < now:
            return True
    except ValueError:
        return True
    host, _, pid = labels.get(LABEL, "").rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not _pid_alive(int(pid))


def _labelled(client: Any, label: str = LABEL) -> list[dict[str, Any]]:
    """Labelled containers as plain records (``Id``, ``Labels``).

    The low-level call on purpose: ``containers.list`` inspects each container afterwards and fails
    when another process removes one in between.
    """
    return list(client.api.containers(all=True, filters={"label": label}))


def reap_containers(client: Any | None = None, *, owner: str | None = None) -> int:
    """Remove labelled containers that are orphans (dead owner, past deadline), or all of ``owner``'s.

    Returns how many were removed.
    """
    import docker.errors

    client = client or docker_client()
    removed = 0
    now = time.time()
    for record in _labelled(client):
        labels = record.get("Labels") or {}
        if (owner is not None and labels.get(LABEL) == owner) or _is_orphan(labels, now):
            with contextlib.suppress(docker.errors.DockerException):
                client.api.remove_container(record["Id"], force=True)
                removed += 1
    if removed:
        log.info("removed %d sandbox container(s)", removed)
    return removed


def reap_forever(client: Any, stop: threading.Event, every_s: float = 5.0) -> None:
    """Reap every ``every_s`` seconds until ``stop`` is set (a sandbox's background thread)."""
    import docker.errors

    while not stop.wait(every_s):
        try:
            reap_containers(client)
        except (docker.errors.DockerException, OSError) as exc:
            log.debug("reaper: %s", exc)


def leaked_containers(
    client: Any | None = None, *, owner: str | None = None, instance: str | None = None
) -> list[str]:
    """Ids of labelled containers (only ``owner``'s / ``instance``'s when given), for leak counts."""
    client = client or docker_client()
    label = f"{INSTANCE_LABEL}={instance}" if instance else (f"{LABEL}={owner}" if owner else LABEL)
    return [record["Id"] for record in _labelled(client, label)]


def uids_in_use(client: Any) -> set[int]:
    """The sandbox uids of the engine's labelled containers, stopped ones included (any process's)."""
    labels = (record.get("Labels") or {} for record in _labelled(client))
    return {int(value) for value in (lab.get(UID_LABEL, "") for lab in labels) if value.isdigit()}


def engine_remaps_users(info: dict[str, Any]) -> bool:
    """Whether the engine (its ``docker info``) maps containers into a user namespace (``userns-remap``)."""
    return any("name=userns" in str(option) for option in info.get("SecurityOptions") or [])
