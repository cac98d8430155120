"""The learner rendezvous lets no one else in: nothing listens beyond loopback on one machine, and a
rank that cannot prove the run's secret is refused by name before any weight or config is sent."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolgym.errors import ConfigError
from toolgym.training.distributed.learners import LearnerGroup
from toolgym.training.distributed.rendezvous import SECRET_ENV, RendezvousRefused, require_secret

pytestmark = pytest.mark.slow


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _listening(pids: list[int]) -> list[str]:
    """The local addresses of every TCP socket these processes listen on (IPv4 and IPv6)."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                assert len(address) == width
                found.append(f"{_address(address)}:{int(port, 16)}")
    return found


def _address(hex_address: str) -> str:
    if len(hex_address) == 8:  # little-endian IPv4
        return ".".join(str(int(hex_address[i : i + 2], 16)) for i in (6, 4, 2, 0))
    words = [hex_address[i : i + 8] for i in range(0, 32, 8)]
    raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
    import ipaddress

    return str(ipaddress.IPv6Address(raw))


def test_nothing_a_learner_group_starts_listens_beyond_loopback(tmp_path: Path) -> None:
    group = LearnerGroup(2, log_dir=tmp_path)
    try:
        group.start()
        pids = [os.getpid(), *(child.pid for child in group.children.values())]
        listening = _listening(pids)
        # rank 0's store, and each rank's collective transport
        assert len(listening) >= 2, listening
        assert all(a.startswith(("127.0.0.1:", "::1:", "::ffff:127.0.0.1:")) for a in listening), listening
    finally:
        group.close()


def _impostor(tmp_path: Path, code: str, *, secret: str = "an attacker's guess, long enough"):
    """A ``_spawn`` that kills the learner this run started and runs ``code`` in its seat instead (it
    knows the store's address, as any local process could; ``secret`` is what it believes the secret is)."""

    def spawn(rank: int, port: int, master_addr: str) -> subprocess.Popen:
        env = {**os.environ, "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(rank)}
        env.update(
            WORLD_SIZE="2", TOOLGYM_DIST_BACKEND="gloo", TOOLGYM_DIST_TIMEOUT="60", **{SECRET_ENV: secret}
        )
        out = open(tmp_path / "impostor.log", "wb")  # noqa: SIM115 (the child writes to it)
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=out, stderr=out)

    return spawn


WORKER = "from toolgym.training.distributed.worker import worker_main; raise SystemExit(worker_main())"
#: checks in at the store with a proof under its secret, joins the group, then never says a word
SILENT = """
import datetime, os, time
import torch.distributed as dist
from toolgym.training.distributed.rendezvous import CHALLENGE_KEY, store_proof
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
proof = store_proof(os.environ["TOOLGYM_LEARNER_SECRET"], rank, world, bytes(store.get(CHALLENGE_KEY)))
store.set(f"learner/{rank}", proof)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
print("joined, saying nothing", flush=True)
time.sleep(600)
"""


def test_a_rank_without_the_runs_secret_is_refused_by_name_before_the_group_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that dials rank 0's store as rank 1 first, knowing the address but not the secret: its
    check-in proof is wrong, so it is refused before the learner group forms."""
    group = LearnerGroup(2, log_dir=tmp_path)
    monkeypatch.setattr(group, "_spawn", _impostor(tmp_path, WORKER))
    with pytest.raises(
        RendezvousRefused, match=r"checked in at the learner store as rank 1 without the run's secret"
    ):
        group.start()
    assert not group.started and not group.children


def test_a_silent_rank_stops_the_run_within_the_handshake_deadline_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that joins and never speaks used to hold the run for the collectives' timeout (half an
    hour by default); the secret's proof has a deadline of seconds, and the refusal names the rank."""
    group = LearnerGroup(2, log_dir=tmp_path, timeout_s=15)
    monkeypatch.setattr(
        group,
        "_spawn",
        lambda rank, port, addr: _impostor(tmp_path, SILENT, secret=group.secret)(rank, port, addr),
    )
    started = time.monotonic()
    with pytest.raises(
        RendezvousRefused, match=r"learner rank 1 joined the learner group but sent no proof .* within 15 s"
    ):
        group.start()
    assert time.monotonic() - started < 120
    assert "joined, saying nothing" in (tmp_path / "impostor.log").read_text()
    assert not group.started and not group.children


def test_a_rank_with_another_secret_is_refused_in_the_handshake(tmp_path: Path) -> None:
    """The group-level proof (what guards torchrun's ranks, which no store check-in precedes): a rank
    that joined the group with another secret is refused by name on every honest rank."""
    code = """
import datetime, os
import torch.distributed as dist
from toolgym.training.distributed.rendezvous import authenticate
store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), 2, is_master=False)
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=60))
authenticate("another secret, long enough to pass", 1, 2, deadline_s=30)
"""
    import torch.distributed as dist

    from toolgym.training.distributed.rendezvous import authenticate, listening_store

    store = listening_store("127.0.0.1", 2, 60)
    out = open(tmp_path / "rank1.log", "wb")  # noqa: SIM115 (the child writes to it)
    child = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PORT": str(store.port)}, stdout=out, stderr=out
    )
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2)
        with pytest.raises(
            RendezvousRefused, match="learner rank 1 could not prove the run's secret, as seen from rank 0"
        ):
            authenticate("the run's own secret, long enough", 0, 2, deadline_s=30)
        assert child.wait(timeout=60) != 0
        assert "learner rank 0 could not prove" in (tmp_path / "rank1.log").read_text()
    finally:
        dist.destroy_process_group()
        if child.poll() is None:
            child.kill()


def test_torchrun_learners_without_a_secret_are_refused_with_the_command_that_makes_one() -> None:
    with pytest.raises(ConfigError, match=r"TOOLGYM_LEARNER_SECRET is not set.*secrets\.token_hex\(32\)"):
        require_secret({})
    with pytest.raises(ConfigError, match="is 5 characters"):
        require_secret({SECRET_ENV: "short"})
    assert require_secret({SECRET_ENV: "x" * 64}) == "x" * 64
