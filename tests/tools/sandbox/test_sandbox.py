"""The Docker sandbox: behaviour, then one attack per test (each followed by a leak count).

Limits, the container policy and the container's lifecycle are in ``test_sandbox_policy.py``.

Docker tests need a running engine and the image (``toolgym sandbox build``); they skip only when
TOOLGYM_SKIP_DOCKER=1 asks for it. Pure-logic tests at the top run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from sandboxkit import mine, need_docker

from toolgym.errors import SandboxError
from toolgym.tools.sandbox import (
    SECCOMP_PROFILE,
    DockerSandbox,
    ExecResult,
    SandboxUnavailable,
    docker_client,
    leaked_containers,
)
from toolgym.tools.sandbox.image import debian_mirror

# --------------------------------------------------------------------------- pure logic


def test_seccomp_profile_denies_ptrace_and_namespaces() -> None:
    denied = {
        name
        for rule in SECCOMP_PROFILE["syscalls"]
        for name in rule["names"]
        if rule["action"] != "SCMP_ACT_ALLOW"
    }
    assert {"ptrace", "process_vm_readv", "unshare", "setns", "mount", "bpf", "clone3"} <= denied
    json.dumps(SECCOMP_PROFILE)  # the engine receives it as JSON


def test_exec_result_ok_requires_clean_exit() -> None:
    clean = ExecResult(0, "", "", False, False, False, 0.1)
    assert clean.ok
    assert not ExecResult(0, "", "", False, False, True, 0.1).ok
    assert not ExecResult(None, "", "", True, False, False, 0.1).ok


def test_missing_engine_raises_sandbox_unavailable_with_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such.sock")
    with pytest.raises(SandboxUnavailable) as info:
        docker_client()
    assert isinstance(info.value, SandboxError)
    assert "toolgym sandbox build" in str(info.value) and "dockerd" in str(info.value)


def test_debian_mirror_can_be_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLGYM_DEBIAN_MIRROR", "http://mirror.example/debian")
    assert debian_mirror() == "http://mirror.example/debian"


# --------------------------------------------------------------------------- helpers (fixtures: conftest.py)


def _run(
    box: DockerSandbox, code: str, timeout: float = 10.0, stdin: str = "", cpu_time_s: float | None = None
) -> ExecResult:
    result = box.run(textwrap.dedent(code), timeout=timeout, stdin=stdin, cpu_time_s=cpu_time_s)
    assert mine(box) == [], "a container outlived its run"
    return result


# --------------------------------------------------------------------------- behaviour


@pytest.mark.docker
def test_run_returns_output_stdin_and_exit_code(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        "import sys, json, unittest, ctypes, multiprocessing\nprint(input())\nsys.exit(3)",
        stdin="hi\n",
    )
    assert (result.exit_code, result.stdout) == (3, "hi\n")
    assert not (result.timed_out or result.oom_killed or result.output_truncated)


@pytest.mark.docker
def test_runs_as_the_containers_own_unprivileged_user_in_workdir(sandbox: DockerSandbox) -> None:
    result = _run(sandbox, "import os; print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd())")
    uid, gid, groups, cwd = result.stdout.split()
    assert int(uid) in sandbox.sandbox_uids and gid == uid and groups == f"[{uid}]" and cwd == "/work"


@pytest.mark.docker
def test_warm_pool_runs_each_container_once_on_the_exec_path() -> None:
    # The resident path reuses containers after clean-up: test_sandbox_resident.py.
    need_docker()
    with DockerSandbox(pool_size=2, one_shot="exec") as pooled:
        hostnames = {
            pooled.run("import socket; print(socket.gethostname())", timeout=10).stdout for _ in range(4)
        }
    assert len(hostnames) == 4 and mine(pooled) == []


@pytest.mark.docker
def test_session_keeps_state_and_restarts_after_timeout(pooled: DockerSandbox) -> None:
    with pooled.session() as session:
        assert session.run("x = 41", timeout=10).ok
        assert session.run("x += 1\nx", timeout=10).stdout == "42\n"
        err = session.run("1/0", timeout=10)
        assert err.exit_code == 1 and "ZeroDivisionError" in err.stderr and "<string>" not in err.stderr
        assert session.run("while True: pass", timeout=1).timed_out
        after = session.run("print('x' in globals())", timeout=10)
        assert after.stdout == "False\n" and session.restarts == 1


@pytest.mark.docker
def test_missing_image_raises_with_build_hint() -> None:
    need_docker()
    with pytest.raises(SandboxUnavailable, match="toolgym sandbox build"):
        DockerSandbox(image="toolgym-sandbox:does-not-exist")


# --------------------------------------------------------------------------- attacks


@pytest.mark.docker
def test_attack_fork_bomb_is_contained(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        import os
        n = 0
        while True:
            try:
                os.fork(); n += 1
            except OSError:
                pass
        """,
        timeout=3,
    )
    assert result.timed_out and result.exit_code is None


@pytest.mark.docker
def test_attack_memory_bomb_sets_oom_flag(sandbox: DockerSandbox) -> None:
    result = _run(sandbox, "x = b'x' * (1 << 30)\nprint('survived')", timeout=20)
    assert result.oom_killed and "survived" not in result.stdout


@pytest.mark.docker
def test_attack_infinite_loop_killed_within_a_second_of_deadline(sandbox: DockerSandbox) -> None:
    result = _run(sandbox, "while True: pass", timeout=2)
    # the CPU-time limit equals the deadline, so on an idle core either may end the loop first
    assert result.timed_out or result.cpu_time_exceeded, result
    assert result.exit_code != 0 and result.duration_s < 3.0


@pytest.mark.docker
def test_attack_cpu_spin_in_many_threads_is_killed(sandbox: DockerSandbox) -> None:
    code = """
    import threading
    def spin():
        while True: pass
    for _ in range(32):
        threading.Thread(target=spin, daemon=True).start()
    spin()
    """
    result = _run(sandbox, code, timeout=2)
    # The wall clock (2 s) and the CPU-time limit (2 s of CPU on the container's one CPU) race here:
    # either stops the spinning threads, in under 3 s.
    assert (result.timed_out or result.cpu_time_exceeded) and result.duration_s < 3.0


@pytest.mark.docker
def test_attack_gigabyte_of_stdout_is_truncated(sandbox: DockerSandbox) -> None:
    code = "import sys\nchunk = b'a' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.buffer.write(chunk)"
    result = _run(sandbox, code, timeout=60)
    assert result.output_truncated and result.exit_code is None
    assert 0 < len(result.stdout) <= sandbox.max_output_bytes


@pytest.mark.docker
def test_attack_disk_fill_of_workdir_stops_at_its_cap(sandbox: DockerSandbox) -> None:
    # Files of 8 MB each, under the per-file limit: the workdir's own cap is what stops this.
    code = """
    import errno
    written = 0
    try:
        while True:
            with open(f'fill{written // 8}', 'ab') as f:
                f.write(b'x' * (1 << 20)); f.flush(); written += 1
    except OSError as e:
        print(errno.errorcode[e.errno], written)
    """
    code_result = _run(sandbox, code, timeout=30)
    name, megabytes = code_result.stdout.split()
    assert name == "ENOSPC" and int(megabytes) <= sandbox.workdir_mb


@pytest.mark.docker
def test_attack_disk_fill_of_root_is_refused(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        import errno
        for path in ('/fill', '/usr/fill', '/var/fill'):
            try:
                open(path, 'wb').write(b'x' * (1 << 20)); print('wrote', path)
            except OSError as e:
                print(errno.errorcode[e.errno])
        """,
    )
    assert "wrote" not in result.stdout and set(result.stdout.split()) <= {"EROFS", "EACCES"}


@pytest.mark.docker
def test_attack_network_connect_fails_and_only_loopback_exists(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        import socket
        try:
            socket.create_connection(('1.1.1.1', 53), timeout=3); print('connected')
        except OSError as e:
            print('refused', e.errno)
        print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))
        """,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("refused") and lines[1] == "['lo']"


@pytest.mark.docker
def test_attack_reading_host_files_fails(sandbox: DockerSandbox) -> None:
    here = os.path.abspath(__file__)
    result = _run(
        sandbox,
        f"""
        for path in ('/etc/shadow', {here!r}, '/root/.bashrc', '/var/lib/docker/containers'):
            try:
                open(path).read(); print('read', path)
            except OSError as e:
                print(type(e).__name__)
        """,
    )
    assert "read" not in result.stdout and len(result.stdout.split()) == 4


@pytest.mark.docker
def test_attack_writing_outside_workdir_fails(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        for path in ('/etc/passwd', '/usr/lib/python3/dist-packages/sitecustomize.py', '/home/x'):
            try:
                open(path, 'a').write('pwned'); print('wrote', path)
            except OSError as e:
                print(type(e).__name__)
        """,
    )
    assert "wrote" not in result.stdout and len(result.stdout.split()) == 3


@pytest.mark.docker
def test_attack_detached_child_does_not_survive_timeout(sandbox: DockerSandbox) -> None:
    code = """
    import os, subprocess, time
    subprocess.Popen(['sleep', '1000'], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if os.fork() == 0:
        os.setsid()
        while True: time.sleep(1)
    while True: pass
    """
    result = _run(sandbox, code, timeout=2)
    assert result.timed_out  # and _run asserted that the container (with its children) is gone


@pytest.mark.docker
def test_attack_docker_socket_is_absent(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        import os, socket
        print(any(os.path.exists(p) for p in ('/var/run/docker.sock', '/run/docker.sock')))
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect('/var/run/docker.sock'); print('connected')
        except OSError as e:
            print(type(e).__name__)
        """,
    )
    assert result.stdout.split() == ["False", "FileNotFoundError"]


@pytest.mark.docker
def test_attack_setuid_and_privilege_gain_fail(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        import os, subprocess
        try:
            os.setuid(0); print('root')
        except PermissionError:
            print('EPERM')
        r = subprocess.run(['su', '-c', 'id -u'], stdin=subprocess.DEVNULL, capture_output=True, text=True)
        print('su', r.returncode != 0 and '0' not in r.stdout.split())
        print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])
        print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
        """,
    )
    assert result.stdout.split() == ["EPERM", "su", "True", "1", "0000000000000000"]


@pytest.mark.docker
def test_attack_ptrace_and_user_namespaces_are_denied(sandbox: DockerSandbox) -> None:
    result = _run(
        sandbox,
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())   # PTRACE_TRACEME
        print(libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
        """,
    )
    assert result.stdout.split() == ["-1", "1", "-1", "1"]


@pytest.mark.docker
def test_sigkilled_owner_leaves_orphans_that_the_next_start_reaps() -> None:
    need_docker()
    script = textwrap.dedent(
        """
        from toolgym.tools.sandbox import DockerSandbox
        box = DockerSandbox(pool_size=1)
        session = box.session()
        session.run('x = 1', timeout=30)
        print('ready', flush=True)
        import time; time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        owner = f"{__import__('socket').gethostname()}:{child.pid}"
        client = docker_client()
        orphans = leaked_containers(client, owner=owner)
        assert len(orphans) >= 1
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    time.sleep(0.5)
    fresh = DockerSandbox(pool_size=0)  # start-up reaps the dead process's containers
    try:
        # Another reaper in this process may be removing them at the same moment ("removal in
        # progress"): wait for the engine to finish, then none may be left.
        for _ in range(40):
            left = set(orphans) & set(leaked_containers(client))
            if not left:
                break
            time.sleep(0.25)
        assert not left, f"orphans not reaped: {left}"
    finally:
        fresh.close()
