"""Resources a call holds without any process: the next call in a resident container never pays for them.

Killing every process and emptying the writable directories is not enough: a descriptor can stay
alive "in flight" in a unix socket that holds itself (no process owns it; the kernel's garbage
collector frees it whenever it next runs), and the kernel keeps some state after its owner ends
(``TIME_WAIT`` ports). Each attack here leaves one such resource behind and ends normally; the next
call then tries to use what the resource takes away (space, memory, a socket name, a port, a lock)
and must find it free: the runner measures the container against its baseline after every call and
retires it when anything is still held. Before those checks, each of these next calls failed
(``ENOSPC``, an OOM kill, ``EADDRINUSE``, a lock held by nobody). Docker tests skip only when
TOOLGYM_SKIP_DOCKER=1 asks for it.
"""

from __future__ import annotations

import textwrap

import pytest

from toolgym.tools.sandbox import DockerSandbox, ExecResult

# Puts descriptors in flight in a unix socket pair that holds itself, then closes every descriptor:
# no process owns the pair or what it carries any more.
HOLD = """
import os, socket
def hold(*fds):
    a, b = socket.socketpair()
    for k in range(0, len(fds), 200):
        socket.send_fds(a, [b'x'], list(fds[k:k + 200]))
    socket.send_fds(a, [b'x'], [a.fileno(), b.fileno()])
    for fd in fds:
        os.close(fd)
    a.close()
    b.close()
"""


def _run(box: DockerSandbox, code: str, timeout: float = 20.0) -> ExecResult:
    return box.run(textwrap.dedent(code), timeout=timeout)


def _attack(box: DockerSandbox, code: str) -> ExecResult:
    result = _run(box, HOLD + textwrap.dedent(code))
    assert result.ok, result
    return result


@pytest.mark.docker
def test_attack_a_full_workdir_held_in_flight_is_not_inherited(resident: DockerSandbox) -> None:
    _attack(
        resident,
        """
        fds, i = [], 0
        try:
            while True:
                fd = os.open(f'/work/fill{i}', os.O_WRONLY | os.O_CREAT, 0o600)
                fds.append(fd)
                i += 1
                for _ in range(8):
                    os.write(fd, b'x' * (1 << 20))
        except OSError:
            pass
        for n in range(i):
            os.unlink(f'/work/fill{n}')
        hold(*fds)
        """,
    )
    after = _run(resident, "open('/work/six', 'wb').write(b'y' * 6000); print('written')")
    assert after.ok and after.stdout == "written\n", after


@pytest.mark.docker
def test_attack_full_tmp_and_shm_held_in_flight_are_not_inherited(resident: DockerSandbox) -> None:
    _attack(
        resident,
        """
        fds = []
        for top in ('/tmp', '/dev/shm'):
            i = 0
            try:
                while True:
                    fd = os.open(f'{top}/fill{i}', os.O_WRONLY | os.O_CREAT, 0o600)
                    fds.append(fd)
                    os.unlink(f'{top}/fill{i}')
                    i += 1
                    for _ in range(8):
                        os.write(fd, b'x' * (1 << 20))
            except OSError:
                pass
        hold(*fds)
        """,
    )
    code = (
        "for top in ('/tmp', '/dev/shm'):\n    open(top + '/f', 'wb').write(b'y' * 65536)\nprint('written')"
    )
    after = _run(resident, code)
    assert after.ok and after.stdout == "written\n", after


@pytest.mark.docker
def test_attack_memory_held_in_flight_does_not_starve_the_next_call(resident: DockerSandbox) -> None:
    _attack(
        resident,
        """
        fds = []
        try:
            for _ in range(6):  # 16 MB each: the file size limit applies to memory files too
                fds.append(os.memfd_create('held'))
                for _ in range(16):
                    os.write(fds[-1], b'x' * (1 << 20))
        except OSError:
            pass
        hold(*fds)
        """,
    )
    after = _run(resident, "x = bytearray(64 << 20)\nprint(len(x) >> 20)")
    assert after.ok and after.stdout == "64\n", after


@pytest.mark.docker
def test_attack_a_socket_name_held_in_flight_is_free_for_the_next_call(resident: DockerSandbox) -> None:
    _attack(
        resident,
        """
        s = socket.socket(socket.AF_UNIX)
        s.bind('\\0toolgym-held-name')
        s.listen()
        hold(os.dup(s.fileno()))
        s.close()
        """,
    )
    code = "import socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('\\0toolgym-held-name')\nprint('bound')"
    after = _run(resident, code)
    assert after.ok and after.stdout == "bound\n", after


@pytest.mark.docker
def test_attack_a_listening_port_held_in_flight_is_free_for_the_next_call(resident: DockerSandbox) -> None:
    _attack(
        resident,
        """
        tcp, udp = socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tcp.bind(('127.0.0.1', 7011))
        tcp.listen()
        udp.bind(('127.0.0.1', 7012))
        hold(os.dup(tcp.fileno()), os.dup(udp.fileno()))
        tcp.close()
        udp.close()
        """,
    )
    code = """
    import socket
    socket.socket().bind(('127.0.0.1', 7011))
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).bind(('127.0.0.1', 7012))
    print('bound')
    """
    after = _run(resident, code)
    assert after.ok and after.stdout == "bound\n", after


@pytest.mark.docker
def test_attack_a_port_in_time_wait_is_free_for_the_next_call(resident: DockerSandbox) -> None:
    # No descriptor survives here: the kernel keeps the closed connection's port for a minute.
    _attack(
        resident,
        """
        server = socket.socket()
        server.bind(('127.0.0.1', 7013))
        server.listen()
        client = socket.create_connection(('127.0.0.1', 7013))
        conn, _ = server.accept()
        conn.close()  # the side that closes first keeps the port in TIME_WAIT
        client.close()
        server.close()
        """,
    )
    after = _run(resident, "import socket\nsocket.socket().bind(('127.0.0.1', 7013))\nprint('bound')")
    assert after.ok and after.stdout == "bound\n", after


@pytest.mark.docker
def test_attack_a_file_lock_held_in_flight_is_released_for_the_next_call(resident: DockerSandbox) -> None:
    # The locked file is part of the read-only image, so the clean-up cannot remove it.
    _attack(
        resident,
        """
        import fcntl
        fd = os.open('/usr/lib/python3.11/os.py', os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        hold(fd)
        """,
    )
    code = """
    import fcntl, os
    fd = os.open('/usr/lib/python3.11/os.py', os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print('locked')
    """
    after = _run(resident, code)
    assert after.ok and after.stdout == "locked\n", after


@pytest.mark.docker
def test_a_call_that_leaves_nothing_keeps_its_container(resident: DockerSandbox) -> None:
    # The checks measure, they do not guess: sockets, files and locks released by their owner's
    # end leave the container reusable.
    code = """
    import fcntl, os, socket
    s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()
    a, b = socket.socketpair()
    socket.send_fds(a, [b'x'], [s.fileno()])
    f = open('/work/kept', 'wb'); f.write(b'x' * (1 << 20)); fcntl.flock(f, fcntl.LOCK_EX)
    print(socket.gethostname())
    """
    first = _run(resident, code)
    second = _run(resident, "import socket\nprint(socket.gethostname())")
    assert first.ok and second.ok and first.stdout == second.stdout
