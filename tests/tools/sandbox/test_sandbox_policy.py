"""The sandbox's container policy, its CPU-time and file size limits, and its containers' lifecycle.

One attack or limit per test. Docker tests skip only when TOOLGYM_SKIP_DOCKER=1 asks for it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from sandboxkit import mine, need_docker

from toolgym.errors import InfraError, SandboxError
from toolgym.tools.sandbox import (
    HARNESS_USER,
    SANDBOX_UIDS,
    DockerSandbox,
    ExecResult,
    docker_client,
    leaked_containers,
)
from toolgym.tools.sandbox.policy import (
    REMAPPED_SANDBOX_UIDS,
    container_config,
    new_sandbox_uid,
    sandbox_user,
)
from toolgym.tools.sandbox.reaper import engine_remaps_users


def _run(
    box: DockerSandbox, code: str, timeout: float = 10.0, stdin: str = "", cpu_time_s: float | None = None
) -> ExecResult:
    result = box.run(textwrap.dedent(code), timeout=timeout, stdin=stdin, cpu_time_s=cpu_time_s)
    assert mine(box) == [], "a container outlived its run"
    return result


def test_policy_separates_users_and_keeps_no_engine_log() -> None:
    config = container_config(memory_mb=128, cpus=1.0, pids=64, workdir_mb=64, file_mb=16, ttl_s=600)
    assert config["user"] == HARNESS_USER and 0 not in SANDBOX_UIDS and 65534 not in SANDBOX_UIDS
    assert config["command"] == ["sleep", "600"] and config["auto_remove"]
    assert config["cap_drop"] == ["ALL"] and sorted(config["cap_add"]) == ["KILL", "SETGID", "SETUID"]
    assert config["log_config"]["type"] == "none"
    assert {"Name": "fsize", "Soft": 16 << 20, "Hard": 16 << 20} in config["ulimits"]
    assert "no-new-privileges" in config["security_opt"] and config["network_mode"] == "none"


def test_each_container_draws_a_sandbox_uid_no_other_container_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([5, 5, 7])
    monkeypatch.setattr("toolgym.tools.sandbox.policy.secrets.randbelow", lambda n: next(draws))
    assert new_sandbox_uid({SANDBOX_UIDS.start + 5}) == SANDBOX_UIDS.start + 7
    monkeypatch.undo()
    drawn = {new_sandbox_uid() for _ in range(100)}
    assert len(drawn) > 90 and all(uid in SANDBOX_UIDS for uid in drawn)  # a range tests membership in O(1)
    assert sandbox_user(2_000_000_123) == "2000000123:2000000123"
    remapped = {new_sandbox_uid(uids=REMAPPED_SANDBOX_UIDS) for _ in range(20)}
    assert all(uid in REMAPPED_SANDBOX_UIDS for uid in remapped) and max(REMAPPED_SANDBOX_UIDS) < 65534
    with pytest.raises(ValueError, match="taken"):
        new_sandbox_uid(set(range(10)), range(10))


def test_an_engine_with_user_namespaces_is_recognised_from_its_info() -> None:
    assert engine_remaps_users({"SecurityOptions": ["name=seccomp,profile=default", "name=userns"]})
    assert not engine_remaps_users({"SecurityOptions": ["name=seccomp,profile=default"]})
    assert not engine_remaps_users({})


@pytest.mark.docker
def test_attack_signals_and_fds_of_pid1_are_out_of_reach(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        import os, signal
        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
            try:
                os.kill(1, sig); print('signalled')
            except OSError as e:
                print(type(e).__name__)
        for fd in (1, 2):
            try:
                open(f'/proc/1/fd/{fd}', 'wb'); print('opened')
            except OSError as e:
                print(type(e).__name__)
        status = open('/proc/self/status').read()
        print(*(status.split(f'Cap{kind}:')[1].split()[0] for kind in ('Inh', 'Prm', 'Eff', 'Amb')))
        """,
    )
    assert result.stdout.split() == ["PermissionError"] * 5 + ["0000000000000000"] * 4


@pytest.mark.docker
def test_attack_flood_into_pid1_output_reaches_no_engine_log(pooled: DockerSandbox) -> None:
    # The container's own output would go to the engine's log (dockerd + shim CPU on the host).
    flood = """
    import os
    sent = 0
    for path in ('/proc/1/fd/1', '/proc/1/fd/2'):
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError as e:
            print(path, type(e).__name__)
            continue
        for _ in range(64):
            sent += os.write(fd, b'x' * (1 << 16))
    print('sent', sent)
    """
    import docker.errors

    with pooled.session() as session:
        result = session.run(textwrap.dedent(flood), timeout=20)
        container = session._ensure().container
        container.reload()
        assert container.attrs["HostConfig"]["LogConfig"]["Type"] == "none"
        try:
            logged = container.logs()
        except docker.errors.APIError as exc:
            assert "does not support reading" in str(exc)
            logged = b""
    assert result.stdout.split() == [
        "/proc/1/fd/1",
        "PermissionError",
        "/proc/1/fd/2",
        "PermissionError",
        "sent",
        "0",
    ]
    assert logged == b""


@pytest.mark.docker
def test_cpu_time_limit_ends_a_run_with_its_flag(sandbox: DockerSandbox) -> None:
    code = """
    import threading
    def spin():
        while True: pass
    threading.Thread(target=spin, daemon=True).start()
    spin()
    """
    result = _run(sandbox, code, timeout=60, cpu_time_s=1)
    assert result.cpu_time_exceeded and result.cpu_limit_s == 1 and result.exit_code == 152
    assert not result.timed_out


@pytest.mark.docker
def test_cpu_time_limit_stops_a_cell_and_keeps_the_session(pooled: DockerSandbox) -> None:
    with pooled.session() as session:
        assert session.run("x = 7", timeout=10).ok
        spun = session.run("while True: pass", timeout=60, cpu_time_s=1)
        assert spun.cpu_time_exceeded and not spun.timed_out
        assert session.run("x", timeout=10).stdout == "7\n" and session.restarts == 0


@pytest.mark.docker
def test_file_size_limit_stops_one_big_file(sandbox: DockerSandbox) -> None:
    # One megabyte at a time: a single write past the limit is cut short at it, without an error.
    too_big = _run(sandbox, "with open('big', 'wb') as f:\n    for _ in range(17): f.write(b'x' * (1 << 20))")
    assert too_big.file_size_exceeded and too_big.file_limit_mb == 16 and too_big.exit_code == 153
    assert "File too large" in too_big.stderr
    caught = _run(
        sandbox,
        """
        import errno
        try:
            with open('big', 'wb') as f:
                for _ in range(17): f.write(b'x' * (1 << 20))
        except OSError as e:
            print(errno.errorcode[e.errno])
        """,
    )
    assert caught.stdout == "EFBIG\n" and caught.ok and not caught.file_size_exceeded


@pytest.mark.docker
def test_container_killed_from_outside_is_a_sandbox_error() -> None:
    need_docker()
    box = DockerSandbox(pool_size=0)
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(box.run("import time\ntime.sleep(60)", timeout=120))
        except SandboxError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    try:
        worker.start()
        for _ in range(400):
            running = leaked_containers(box.client, instance=box.instance)
            if running:
                break
            time.sleep(0.05)
        time.sleep(1.0)  # let the exec start (a kill before it is a failed exec: a SandboxError too)
        box.client.api.kill(running[0])
        worker.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], SandboxError), outcome
        assert isinstance(outcome[0], InfraError)
    finally:
        box.close()


@pytest.mark.docker
def test_container_stops_itself_at_its_deadline_after_its_owner_is_killed() -> None:
    """The owner is SIGKILLed mid-session; the container (spinning) must end itself at its deadline.

    The child labels its containers as owned by this (live) test process, so no reaper on this host
    touches them before their deadline plus grace: whatever stops the container is the container.
    """
    need_docker()
    owner = f"{socket.gethostname()}:{os.getpid()}"
    script = textwrap.dedent(
        f"""
        import toolgym.tools.sandbox.docker_sandbox as docker_sandbox
        docker_sandbox.owner_label = lambda: {owner!r}
        box = docker_sandbox.DockerSandbox(pool_size=0, container_ttl_s=8)
        assert box.owner == {owner!r}, box.owner
        session = box.session()
        spin = "import threading\\ndef spin():\\n    while True: pass\\nthreading.Thread(target=spin).start()"
        assert session.run(spin, timeout=5, cpu_time_s=60).ok
        print(session._box.container.id, flush=True)
        import time; time.sleep(600)
        """
    )
    client = docker_client()
    since = time.time() - 1
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        cid = child.stdout.readline().strip()
        assert cid, "the owner process did not start its session"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    events = client.events(since=since, until=time.time() + 60, filters={"container": cid}, decode=True)
    seen = []
    for event in events:
        seen.append((event.get("status"), event["Actor"]["Attributes"].get("exitCode")))
        if event.get("status") == "destroy":
            break
    events.close()
    statuses = [status for status, _ in seen]
    assert "kill" not in statuses, f"something outside stopped the container: {seen}"
    assert ("die", "0") in seen and statuses[-1] == "destroy", seen
