"""A call cannot make the next call in its container wait: a slow clean-up retires the container.

The clean-up after a call removes what the call left; its time grows with what was left. Each attack
here ends quickly but leaves a clean-up of seconds (hundreds of thousands of names, or directories
the clean-up must unlock one by one). The runner bounds the clean-up
(:data:`~toolgym.tools.sandbox.resident.CLEANUP_BOUND_S`): past it the container is retired, and the
call that caused it waits for that verdict before its result comes back, so the next call starts in
another container at once. Before the bound, the next call waited seconds in the same container.
The last attack tries to stop the clean-up itself, which the call cannot signal. Docker tests skip
only when TOOLGYM_SKIP_DOCKER=1 asks for it.
"""

from __future__ import annotations

import textwrap

import pytest
from sandboxkit import mine, need_docker

from toolgym.tools.sandbox import DockerSandbox

HOST = "import socket\nprint(socket.gethostname())"


@pytest.fixture(scope="module")
def resident():
    need_docker()
    box = DockerSandbox(pool_size=1, memory_mb=512)
    yield box
    box.close()
    assert mine(box) == []


def _stall(box: DockerSandbox, code: str) -> tuple[str, str]:
    """Run the attack; the host it ran in and the host of the next call."""
    assert box.run(HOST, timeout=30).ok  # a warm, clean container
    retired = box.retirements["slow clean-up"]
    attack = box.run(textwrap.dedent(code) + "\n" + HOST, timeout=60)
    assert attack.ok, attack
    # The verdict is in before the attack's result came back: the attack paid for its clean-up.
    assert box.retirements["slow clean-up"] == retired + 1
    after = box.run(HOST, timeout=30)
    assert after.ok, after
    return attack.stdout.split()[-1], after.stdout.strip()


@pytest.mark.docker
def test_attack_hundreds_of_thousands_of_hard_links_do_not_stall_the_next_call(
    resident: DockerSandbox,
) -> None:
    code = """
    import os
    open('/work/f', 'w').close()
    os.mkdir('/work/links')
    for i in range(400_000):
        os.link('/work/f', f'/work/links/{i}')
    """
    attacked, after = _stall(resident, code)
    assert attacked != after


@pytest.mark.docker
def test_attack_hundreds_of_thousands_of_files_do_not_stall_the_next_call(resident: DockerSandbox) -> None:
    code = """
    import os
    for d in range(100):
        os.mkdir(f'/work/d{d}')
        for i in range(2_500):
            os.close(os.open(f'/work/d{d}/{i}', os.O_CREAT | os.O_WRONLY, 0o600))
    """
    attacked, after = _stall(resident, code)
    assert attacked != after


@pytest.mark.docker
def test_attack_directories_the_clean_up_must_unlock_one_by_one_do_not_stall_the_next_call(
    resident: DockerSandbox,
) -> None:
    code = """
    import os
    for d in range(120_000):
        os.mkdir(f'/work/{d}', 0)  # unreadable: the clean-up must chmod each before removing it
    """
    attacked, after = _stall(resident, code)
    assert attacked != after


@pytest.mark.docker
def test_attack_a_background_process_cannot_stop_the_clean_up(resident: DockerSandbox) -> None:
    # Detached processes, their output closed so that the call's result comes back at once, send
    # SIGSTOP in a loop to every process of another uid (the runner, the zygote and the waiting
    # clean-up) until they are killed. The clean-up never holds a uid they may signal.
    code = """
    import os, signal, time
    others = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != 1
              and os.stat(f'/proc/{p}').st_uid != os.getuid()]
    for _ in range(4):
        if os.fork() == 0:
            os.setsid()
            null = os.open('/dev/null', os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            while True:
                for pid in others:
                    try:
                        os.kill(pid, signal.SIGSTOP)
                    except OSError:
                        pass
    time.sleep(0.2)
    """
    for _ in range(5):
        assert resident.run(HOST, timeout=30).ok
        attack = resident.run(textwrap.dedent(code) + "\n" + HOST, timeout=30)
        after = resident.run(HOST, timeout=30)
        assert attack.ok and after.ok and attack.stdout.split()[-1] == after.stdout.strip()
