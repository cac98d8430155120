"""How the data-parallel learners meet, and how each proves it belongs to the run.

Threat model. A learner receives rank 0's model, optimizer state and config, and its gradient goes
into every weight, so a process that joins the group in a learner's place reads the run and steers it.
Two rules keep it out:

* **Nothing listens beyond loopback on one machine.** When every rank runs on the trainer's machine
  (``--learners N`` as child processes, or Ray actors with ``train.learners.nodes = "trainer"``), rank
  0's store listens on 127.0.0.1 only (a socket bound there and handed to the ``TCPStore``) and the
  collectives' transport is pinned to the loopback interface (``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME``). Across nodes (``train.learners.nodes = "any"``), the store listens on the
  trainer node's own address only, and the transport uses the interface the user names (or the
  library's choice).
* **Every rank proves the run's secret before anything is exchanged.** Rank 0 draws a fresh secret
  for each run and hands it to the ranks it starts (a child's environment, a Ray actor's arguments).
  Right after the process group forms, and before any weight or config is sent, every rank
  contributes a random nonce, then an HMAC-SHA256 of its rank and all the nonces under the secret
  (:func:`authenticate`, tensors only: nothing from another rank is unpickled before it passes). Every
  rank checks every other's tag; a rank that cannot prove it is refused by name and the run stops
  (:class:`RendezvousRefused`). The tags bind the rank and this group's nonces, so a tag seen on the
  wire is worth nothing in another group. Under ``torchrun`` no process starts the others: every rank
  reads the secret from ``TOOLGYM_LEARNER_SECRET``, which the user exports on every node (a run
  without it is refused at start, with the command that makes one).

Two deadlines of seconds, not the collectives' timeout (half an hour by default), bound a rank that
joins and then says nothing. Ranks this run starts check in at rank 0's store with a proof before the
group forms (:func:`store_proof` over a challenge rank 0 put in the store; a wrong one is refused by
rank, before the group forms: the store answers any local client, the proof is what it trusts); and
:func:`authenticate` waits at most :data:`HANDSHAKE_S` for every rank's tags, then stops the run,
naming the ranks that stayed silent.

What the secret does not do: the collectives' traffic (weights, gradients) is not encrypted, and an
on-path attacker who can rewrite packets between nodes is out of scope. Learners on several nodes
should share a private network (a cluster's own fabric, a VPN), never the open internet. A process of
the same user on the same machine can read the secret (``/proc/PID/environ``): the boundary is the
user account, as for every file of the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from toolgym.errors import ConfigError, RunStopped

__all__ = [
    "INTERFACE_ENV",
    "LOOPBACK_NAMES",
    "CHALLENGE_KEY",
    "HANDSHAKE_S",
    "SECRET_ENV",
    "RendezvousRefused",
    "authenticate",
    "listening_store",
    "loopback_env",
    "loopback_interface",
    "new_secret",
    "require_secret",
    "store_proof",
    "transport_env",
]

#: The run's learner secret, in every rank's environment.
SECRET_ENV = "TOOLGYM_LEARNER_SECRET"
#: How long every rank's secret proof may take once the group has formed (then the run stops).
HANDSHAKE_S = 60.0
#: The store key of rank 0's challenge, which a rank it started answers with :func:`store_proof`.
CHALLENGE_KEY = "learner/challenge"
#: The environment variables that pin each collective library's transport to one interface.
INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: Addresses that mean "this machine" (a torchrun group whose master is one of them stays on loopback).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
_NONCE = 32
_MAKE_SECRET = "export TOOLGYM_LEARNER_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')"


class RendezvousRefused(RunStopped):
    """A rank of the learner group could not prove the run's secret: nothing was sent to it."""


def new_secret() -> str:
    """A fresh per-run secret (256 bits)."""
    return secrets.token_hex(32)


def require_secret(environ: MutableMapping[str, str] | None = None) -> str:
    """The secret from the environment (``torchrun``'s ranks, a child this run started).

    Raises:
        ConfigError: it is missing or too short to be a secret, with the command that makes one.
    """
    value = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if len(value) < 16:
        what = "is not set" if not value else f"is {len(value)} characters (at least 16)"
        raise ConfigError(
            f"several learners need a shared secret that proves each rank belongs to the run, and "
            f"{SECRET_ENV} {what}. Under torchrun, set the same secret on every node before starting "
            f"it: {_MAKE_SECRET}"
        )
    return value


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name == "lo" or name.startswith("lo") and name[2:].isdigit():
            return name
    raise ConfigError(f"no loopback interface on this machine (interfaces: {', '.join(names)})")


def loopback_env() -> dict[str, str]:
    """The settings that pin the collectives' transport to the loopback interface (a one-machine group)."""
    name = loopback_interface()
    return dict.fromkeys(INTERFACE_ENV, name)


@contextlib.contextmanager
def transport_env(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the group forms (the libraries read them when a
    process group is made), then the environment as it was: nothing else in the process inherits them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def listening_store(address: str, world: int, timeout_s: float) -> Any:
    """Rank 0's ``TCPStore``, listening on ``address`` only (127.0.0.1, or the node's own address).

    The store binds every interface when it opens its own socket; a socket bound to ``address`` and
    handed over (``master_listen_fd``) keeps it there. Returns the store; its ``port`` is the one the
    other ranks dial.
    """
    import datetime

    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, 0))
        listener.listen(max(world * 4, 64))
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()  # the store's from here on: it serves on this socket and closes it
    try:
        return dist.TCPStore(
            address,
            port,
            world,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def store_proof(secret: str, rank: int, world: int, challenge: bytes) -> str:
    """What a rank this run started writes at ``learner/RANK`` in rank 0's store: an HMAC of its rank
    and rank 0's challenge under the secret (hex), so rank 0 can refuse a rank that checked in without
    the secret before the group forms."""
    message = b"toolgym-store|%d|%d|" % (rank, world) + bytes(challenge)
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def _tag(secret: str, rank: int, world: int, nonces: bytes) -> bytes:
    message = b"toolgym-learner|%d|%d|" % (rank, world) + nonces
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def authenticate(
    secret: str, rank: int, world: int, device: Any = "cpu", *, deadline_s: float = HANDSHAKE_S
) -> None:
    """Every rank proves the secret to every other; call on every rank right after the group forms.

    Raises:
        RendezvousRefused: naming the ranks whose proof failed (on every honest rank alike), or, when
            the tags did not all arrive within ``deadline_s``, naming the ranks that stayed silent.
    """
    import datetime

    import torch
    import torch.distributed as dist

    def gather(mine: bytes) -> list[bytes]:
        local = torch.tensor(list(mine), dtype=torch.uint8, device=device)
        parts = [torch.zeros_like(local) for _ in range(world)]
        work = dist.all_gather(parts, local, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=deadline_s))
        except RuntimeError as exc:  # the backend's timeout: some rank never sent its part
            silent = [r for r in range(world) if r != rank and not bool(parts[r].any())]
            who = ", ".join(f"rank {r}" for r in silent) or "a rank"
            raise RendezvousRefused(
                f"learner {who} joined the learner group but sent no proof of the run's secret within "
                f"{deadline_s:.0f} s, as seen from rank {rank} ({type(exc).__name__}: {str(exc)[:120]}): a "
                "process this run did not start (one that reached the store without the secret), or a "
                "learner that hangs. Nothing was sent to it; the run stops here instead of waiting for the "
                "collectives' timeout"
            ) from None
        return [bytes(p.cpu().tolist()) for p in parts]

    nonces = b"".join(gather(secrets.token_bytes(_NONCE)))
    tags = gather(_tag(secret, rank, world, nonces))
    bad = [
        r
        for r in range(world)
        if r != rank and not hmac.compare_digest(tags[r], _tag(secret, r, world, nonces))
    ]
    if bad:
        who = ", ".join(f"rank {r}" for r in bad)
        raise RendezvousRefused(
            f"learner {who} could not prove the run's secret, as seen from rank {rank}: a process that "
            "this run did not start (or one given another secret) joined the learner group; it was "
            "refused before any weights or config were exchanged. If the learners run under torchrun, "
            f"every node needs the same {SECRET_ENV}"
        )
