"""Per-user kernel limits: what the code of one container spends, no other container loses.

The kernel counts some resources per user, machine-wide: descriptors in flight in unix sockets
(against ``RLIMIT_NOFILE``), inotify instances (``max_user_instances``), pipe buffer pages
(``pipe-user-pages-soft``). If the untrusted code of every container ran as one kernel user, one
episode could exhaust them for every other episode on the machine. Each attack here holds one of
them in a session (an episode's container, kept alive) while code in another container uses the same
resource; before each container had a user of its own, each of these uses failed (``ETOOMANYREFS``
for the other episode's ``python`` tool itself, ``EMFILE``, a pipe limited to one page). Docker tests
skip only when TOOLGYM_SKIP_DOCKER=1 asks for it.
"""

from __future__ import annotations

import textwrap

import pytest
from sandboxkit import mine, need_docker

from toolgym.tools.sandbox import DockerSandbox


@pytest.fixture(scope="module")
def sandbox():
    need_docker()
    box = DockerSandbox(pool_size=2)
    yield box
    box.close()
    assert mine(box) == []


def _hold(sandbox: DockerSandbox, code: str) -> object:
    """A session whose interpreter holds what ``code`` takes (its globals keep it)."""
    session = sandbox.session()
    result = session.run(textwrap.dedent(code), timeout=60)
    assert result.ok, result
    return session


@pytest.mark.docker
def test_each_container_runs_its_code_as_a_user_of_its_own(sandbox: DockerSandbox) -> None:
    probe = "import os; print(os.getuid(), os.getgid(), os.getgroups())"
    sessions = [sandbox.session() for _ in range(2)]
    try:
        seen = [s.run(probe, timeout=30).stdout.split(maxsplit=2) for s in sessions]
        seen.append(sandbox.run(probe, timeout=30).stdout.split(maxsplit=2))
    finally:
        for s in sessions:
            s.close()
    uids = {uid for uid, _, _ in seen}
    assert len(uids) == 3 and "0" not in uids and "65534" not in uids, seen
    assert all(uid == gid and groups.strip() == f"[{gid}]" for uid, gid, groups in seen), seen


@pytest.mark.docker
def test_attack_descriptors_in_flight_in_one_container_do_not_break_another_episode(
    sandbox: DockerSandbox,
) -> None:
    # Over 20,000 references in flight: the container's RLIMIT_NOFILE. With one kernel user for all
    # containers, every other container's SCM_RIGHTS failed, the session's own python tool included.
    holder = _hold(
        sandbox,
        """
        import os, socket
        a, b = socket.socketpair()
        r, w = os.pipe()
        try:
            while True:
                socket.send_fds(a, [b'x'], [r] * 250)
        except OSError as e:
            assert e.errno == 109, e  # ETOOMANYREFS: this user's own limit is reached
        """,
    )
    other = sandbox.session()
    try:
        cell = other.run("print('hello')", timeout=30)
        assert cell.ok and cell.stdout == "hello\n", cell
        code = "import socket\na, b = socket.socketpair()\nsocket.send_fds(a, [b'x'], [0])\nprint('sent')"
        one_shot = sandbox.run(code, timeout=30)
        assert one_shot.ok and one_shot.stdout == "sent\n", one_shot
    finally:
        other.close()
        holder.close()  # type: ignore[attr-defined]


@pytest.mark.docker
def test_attack_inotify_instances_of_one_container_leave_another_its_own(sandbox: DockerSandbox) -> None:
    holder = _hold(
        sandbox,
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        held = []
        while len(held) < 1024:
            fd = libc.inotify_init1(0)
            if fd < 0:
                break
            held.append(fd)
        assert ctypes.get_errno() == 24 and held, (len(held), ctypes.get_errno())  # EMFILE: the user's limit
        """,
    )
    try:
        code = """
        import ctypes
        fd = ctypes.CDLL(None, use_errno=True).inotify_init1(0)
        print(fd >= 0, ctypes.get_errno() if fd < 0 else 0)
        """
        result = sandbox.run(textwrap.dedent(code), timeout=30)
        assert result.ok and result.stdout == "True 0\n", result
    finally:
        holder.close()  # type: ignore[attr-defined]


@pytest.mark.docker
def test_attack_pipe_buffers_of_one_container_leave_another_full_sized_pipes(
    sandbox: DockerSandbox,
) -> None:
    holder = _hold(
        sandbox,
        """
        import fcntl, os
        held = []
        try:
            while len(held) < 1024:
                r, w = os.pipe()
                held.append((r, w))
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        except PermissionError:
            pass  # past the user's soft limit of pipe pages
        assert 16 < len(held) < 1024, len(held)
        """,
    )
    try:
        code = """
        import fcntl, os
        r, w = os.pipe()
        before = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
        print(before, fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20))
        """
        result = sandbox.run(textwrap.dedent(code), timeout=30)
        assert result.ok and result.stdout == f"{1 << 16} {1 << 20}\n", result
    finally:
        holder.close()  # type: ignore[attr-defined]
