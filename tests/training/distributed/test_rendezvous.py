"""The learner rendezvous lets no one else in: nothing listens beyond loopback on one machine, and a
rank that cannot prove the run's secret is refused by name before any weight or config is sent."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_a_rank_without_the_runs_secret_is_refused_by_name_before_anything_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that dials rank 0's store as rank 1 first, knowing the address but not the secret."""
    group = LearnerGroup(2, log_dir=tmp_path)
    real_spawn = group._spawn

    def impostor(rank: int, port: int, master_addr: str) -> subprocess.Popen:
        real_spawn(rank, port, master_addr).kill()  # the learner this run started never gets there
        env = {**os.environ, "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(rank)}
        env.update(WORLD_SIZE="2", TOOLGYM_DIST_BACKEND="gloo", TOOLGYM_DIST_TIMEOUT="60")
        env[SECRET_ENV] = "an attacker's guess, long enough"
        out = open(tmp_path / "impostor.log", "wb")  # noqa: SIM115 (the child writes to it)
        return subprocess.Popen(
            [sys.executable, "-m", "toolgym.training.distributed.worker"], env=env, stdout=out, stderr=out
        )

    monkeypatch.setattr(group, "_spawn", impostor)
    with pytest.raises(
        RendezvousRefused, match=r"learner rank 1 could not prove the run's secret, as seen from rank 0"
    ):
        group.start()
    child = group.children.get(1)
    if child is not None:
        child.wait(timeout=60)
    log = (tmp_path / "impostor.log").read_text()
    # the impostor refused rank 0 too, and never reached the first message (the model and config)
    assert "RendezvousRefused: learner rank 0 could not prove" in log, log[-2000:]
    assert not group.started


def test_torchrun_learners_without_a_secret_are_refused_with_the_command_that_makes_one() -> None:
    with pytest.raises(ConfigError, match=r"TOOLGYM_LEARNER_SECRET is not set.*secrets\.token_hex\(32\)"):
        require_secret({})
    with pytest.raises(ConfigError, match="is 5 characters"):
        require_secret({SECRET_ENV: "short"})
    assert require_secret({SECRET_ENV: "x" * 64}) == "x" * 64
