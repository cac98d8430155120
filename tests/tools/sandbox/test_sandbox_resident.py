"""One-shot runs through the resident runner: a container serves several calls, and no call sees another.

Every attack here runs in one call and checks, from the next call in the *same* container (same
hostname, same container id), that nothing of it is left: processes, files, IPC objects, planted
modules, memory. The general attacks (limits, escapes, floods) of ``test_sandbox.py`` and
``test_sandbox_policy.py`` run through the resident runner too, as it is the default path.
Docker tests skip only when TOOLGYM_SKIP_DOCKER=1 asks for it.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from toolgym.tools.sandbox import DockerSandbox, ExecResult, program_source

# What the next call sees of everything a call could leave behind.
CENSUS = """
import json, os, socket
procs = []
for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            if os.stat(f'/proc/{pid}').st_uid == os.getuid():
                procs.append(open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace'))
        except OSError:
            pass
files = {d: sorted(os.listdir(d)) for d in ('/work', '/tmp', '/dev/shm', '/dev/mqueue') if os.path.isdir(d)}
ipc = {k: open(f'/proc/sysvipc/{k}').read().splitlines()[1:] for k in ('shm', 'sem', 'msg')}
print(json.dumps({'host': socket.gethostname(), 'procs': procs, 'files': files, 'ipc': ipc}))
"""


def _run(box: DockerSandbox, code: str, timeout: float = 10.0, **kwargs: object) -> ExecResult:
    return box.run(textwrap.dedent(code), timeout=timeout, **kwargs)  # type: ignore[arg-type]


def _census(box: DockerSandbox) -> dict:
    result = _run(box, CENSUS)
    assert result.ok, result
    return json.loads(result.stdout)


def _clean(census: dict) -> None:
    assert census["procs"] == []
    files = dict(census["files"], **{"/work": [n for n in census["files"]["/work"] if n != "main.py"]})
    assert all(names == [] for names in files.values()), census["files"]  # main.py: the census itself
    assert census["ipc"] == {"shm": [], "sem": [], "msg": []}


# --------------------------------------------------------------------------- behaviour


def _baseline_rules() -> dict:
    rules: dict = {"__name__": "baseline"}
    exec(program_source("toolgym.tools.sandbox", "programs/baseline"), rules)
    return rules


def test_each_baseline_rule_names_what_is_still_held() -> None:
    rules = _baseline_rules()
    base = {
        "space": {"/work": (100, 50)},
        "memory": 10 << 20,
        "unix": {1, 2},
        "inet": {"TCP inuse": 0, "TCP tw": 0},
        "locks": set(),
    }
    assert rules["compare"](base, dict(base)) == ""
    more = dict(base, space={"/work": (120, 60)}, memory=(10 << 20) + rules["MEMORY_SLACK"], unix={1})
    assert rules["compare"](base, more) == ""  # more free, a little more memory, fewer sockets: clean
    held = {
        "/work": dict(space={"/work": (99, 50)}),
        "memory": dict(memory=(11 << 20) + rules["MEMORY_SLACK"]),
        "unix sockets": dict(unix={1, 2, 7}),
        "inet sockets": dict(inet={"TCP inuse": 0, "TCP tw": 1}),
        "file locks": dict(locks={"FLOCK WRITE 00:2a:1624433 0 EOF"}),
    }
    for name, change in held.items():
        assert rules["compare"](base, dict(base, **change)).startswith(name), name
    unmeasured = dict(base, locks=None)  # locks not read after this call
    assert rules["compare"](base, unmeasured) == ""


def test_the_baseline_is_measured_on_this_machine_too() -> None:
    state = _baseline_rules()["measure"]()
    assert state["space"] and isinstance(state["memory"], int) and isinstance(state["unix"], set)
    assert {"TCP inuse", "TCP tw", "UDP inuse"} <= state["inet"].keys()


def test_unknown_one_shot_mode_is_refused_before_docker() -> None:
    with pytest.raises(ValueError, match="one_shot must be 'resident' or 'exec'"):
        DockerSandbox(one_shot="fork")


@pytest.mark.docker
def test_resident_container_serves_several_calls_each_in_a_fresh_interpreter(resident: DockerSandbox) -> None:
    first = _run(resident, "import socket, os\nx = 1\nprint(socket.gethostname(), os.getpid())")
    second = _run(resident, "import socket, os\nprint(socket.gethostname(), os.getpid(), 'x' in globals())")
    host1, pid1 = first.stdout.split()
    host2, pid2, seen = second.stdout.split()
    assert host1 == host2 and pid1 != pid2 and seen == "False"


@pytest.mark.docker
def test_resident_and_exec_runs_see_the_same_interpreter(resident: DockerSandbox) -> None:
    probe = """
    import json, os, sys
    env = {k: v for k, v in os.environ.items() if k != 'HOSTNAME'}
    uid = os.getuid()  # one per container: the same kind of user, not the same number
    print(json.dumps([env, sys.path, os.getcwd(), uid >= 2_000_000_000, os.getgid() == uid,
                      os.getgroups() == [uid], sys.argv,
                      sys.stdout.encoding, sys.stdin.isatty(), os.umask(0o22)]))
    """
    with DockerSandbox(pool_size=0, one_shot="exec") as old:
        before = json.loads(_run(old, probe).stdout)
    assert json.loads(_run(resident, probe).stdout) == before


@pytest.mark.docker
def test_random_numbers_differ_between_calls_in_one_container(resident: DockerSandbox) -> None:
    code = "import random, socket; print(socket.gethostname(), random.random())"
    first, second = _run(resident, code).stdout.split(), _run(resident, code).stdout.split()
    assert first[0] == second[0] and first[1] != second[1]


@pytest.mark.docker
def test_a_call_ended_by_a_signal_or_the_oom_killer_is_a_result_and_the_container_goes_on(
    resident: DockerSandbox,
) -> None:
    host = _census(resident)["host"]
    killed = _run(resident, "import os\nprint('bye', flush=True)\nos.kill(os.getpid(), 9)")
    assert (killed.exit_code, killed.stdout, killed.oom_killed) == (137, "bye\n", False)
    oom = _run(resident, "x = b'x' * (1 << 30)", timeout=20)
    assert oom.oom_killed and oom.exit_code == 137
    after = _census(resident)
    assert after["host"] == host
    _clean(after)


@pytest.mark.docker
def test_a_timed_out_call_retires_its_container(resident: DockerSandbox) -> None:
    host = _census(resident)["host"]
    assert _run(resident, "while True: pass", timeout=1).timed_out
    after = _census(resident)
    assert after["host"] != host
    _clean(after)


# --------------------------------------------------------------------------- attacks on the next call


@pytest.mark.docker
def test_attack_escaped_processes_do_not_reach_the_next_call(resident: DockerSandbox) -> None:
    code = """
    import os, subprocess, time, socket
    subprocess.Popen(['sleep', '1000'], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if os.fork() == 0:          # double fork + setsid: an orphan in its own session
        os.setsid()
        if os.fork() == 0:
            os.kill(os.getpid(), 19)  # and one stopped (SIGSTOP) for good measure
        while True:
            time.sleep(0.01)
            open('/tmp/beacon', 'w').write('alive')
    time.sleep(0.2)
    print(socket.gethostname())
    """
    host = _run(resident, code).stdout.strip()
    after = _census(resident)
    assert after["host"] == host
    _clean(after)


@pytest.mark.docker
def test_attack_sleeping_children_holding_every_process_slot_are_cleared(resident: DockerSandbox) -> None:
    # The call ends normally but leaves the pids limit exhausted, its children grabbing every
    # process slot that frees up (the worker's own included): the clean-up must still work.
    code = """
    import os, socket, time
    n = 0
    try:
        while True:
            if os.fork() == 0:
                while True:
                    try:
                        if os.fork() == 0:
                            time.sleep(1000)
                    except OSError:
                        time.sleep(0.001)
            n += 1
    except OSError as e:
        print(type(e).__name__, n > 0, socket.gethostname())
    """
    first = _run(resident, code)
    assert first.ok and first.stdout.split()[:2] == ["BlockingIOError", "True"], first
    after = _census(resident)
    assert after["host"] == first.stdout.split()[2]
    _clean(after)


@pytest.mark.docker
def test_attack_files_planted_in_every_writable_place_are_gone(resident: DockerSandbox) -> None:
    code = """
    import os, socket
    for d in ('/work', '/tmp', '/dev/shm', '/dev/mqueue'):
        try:
            os.makedirs(d + '/deep/locked', exist_ok=True)
            open(d + '/deep/locked/f', 'w').write('x')
            os.chmod(d + '/deep/locked', 0)          # a directory its owner made unreadable
            open(d + '/.hidden', 'w').write('x')
            os.symlink('/etc/passwd', d + '/link')
        except OSError as e:
            print(d, type(e).__name__)
    print(socket.gethostname())
    """
    host = _run(resident, code).stdout.split()[-1]
    after = _census(resident)
    assert after["host"] == host
    _clean(after)


@pytest.mark.docker
def test_attack_a_planted_module_is_not_imported_by_the_next_call(resident: DockerSandbox) -> None:
    # The working directory comes first on sys.path (as for ``python3 -c``): a csv.py left there
    # would shadow the standard library's for every later call.
    assert _run(resident, "open('csv.py', 'w').write('raise SystemExit(99)')\nimport csv").exit_code == 99
    result = _run(resident, "import csv\nprint(csv.__file__)")
    assert result.ok and result.stdout.startswith("/usr/lib/python3")


@pytest.mark.docker
def test_attack_system_v_ipc_objects_are_removed(resident: DockerSandbox) -> None:
    code = """
    import ctypes, socket
    libc = ctypes.CDLL(None, use_errno=True)
    IPC_CREAT = 0o1000
    print(libc.shmget(0x1234, 4096, IPC_CREAT | 0o666) >= 0, libc.semget(0x1235, 1, IPC_CREAT | 0o666) >= 0,
          libc.msgget(0x1236, IPC_CREAT | 0o666) >= 0, socket.gethostname())
    """
    made = _run(resident, code).stdout.split()
    assert made[:3] == ["True", "True", "True"]
    after = _census(resident)
    assert after["host"] == made[3]
    _clean(after)


@pytest.mark.docker
def test_attack_the_next_call_finds_no_trace_of_a_secret_in_its_memory(resident: DockerSandbox) -> None:
    # The secret is made at run time, never written in any call's source; the next call scans all of
    # its own readable memory (what a worker forked from a contaminated parent would inherit).
    first = _run(
        resident, "import os, socket\nS = 'SECRET-' + os.urandom(16).hex()\nprint(S, socket.gethostname())"
    )
    secret, host = first.stdout.split()
    scan = """
    import re, socket
    found = set()
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if 'r' not in perms or line.rstrip().endswith(('[vvar]', '[vsyscall]')):
                continue
            lo, hi = (int(x, 16) for x in span.split('-'))
            try:
                mem.seek(lo)
                found.update(re.findall(rb'SECRET-[0-9a-f]{32}', mem.read(hi - lo)))
            except (OSError, ValueError, OverflowError):
                pass
    print(socket.gethostname(), *sorted(s.decode() for s in found))
    """
    seen = _run(resident, scan, timeout=30).stdout.split()
    assert seen[0] == host and secret not in seen[1:]


@pytest.mark.docker
def test_attack_the_runner_and_zygote_are_out_of_reach(resident: DockerSandbox) -> None:
    code = """
    import os, signal, socket
    roots = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != 1
             and os.stat(f'/proc/{p}').st_uid == 0]
    print(len(roots))
    for pid in roots:
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            try:
                os.kill(pid, sig); print('signalled')
            except OSError as e:
                print(type(e).__name__)
        for path in (f'/proc/{pid}/mem', f'/proc/{pid}/fd/1', f'/proc/{pid}/environ'):
            try:
                open(path, 'rb').read(1); print('opened')
            except OSError as e:
                print(type(e).__name__)
    print(socket.gethostname())
    """
    out = _run(resident, code).stdout.split()
    assert out[0] == "3"  # the runner, its zygote and the call's cleaner, waiting for its turn
    assert set(out[1:-1]) == {"PermissionError"} and len(out[1:-1]) == 15
    after = _census(resident)
    assert after["host"] == out[-1]  # still served by the same, intact runner
    _clean(after)
