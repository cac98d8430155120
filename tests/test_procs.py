"""A run killed outright leaves its policy's processes running; the next run here stops them, and only
them: the record is private to the user, and a process is stopped only if it is exactly the one recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolgym.procs import descendants, describe, process_record, record_processes, stop_leftovers

# A parent that starts a long-lived child (as a run starts its vLLM engine), prints its pid, waits.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture(autouse=True)
def private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own per-user runtime folder (where the records live)."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _sleeper(**kwargs) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **kwargs)


def _plant(run: Path, processes: list[dict], **fields) -> Path:  # type: ignore[no-untyped-def]
    """Write ``run``'s private record as a killed owner would have left it, listing ``processes``."""
    record_processes(run, [])
    path = process_record(run)
    record = json.loads(path.read_text())
    record.update(owner={**record["owner"], "pid": 999_999_999}, processes=processes, **fields)
    path.write_text(json.dumps(record))
    return path


def test_the_processes_of_a_killed_owner_are_stopped_and_nothing_else(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        assert child in descendants(owner.pid) and child in descendants()  # below the owner, and us
        record_processes(run, [child])
        assert not list(run.iterdir())  # nothing in the run directory: the record is private
        # written by us, the owner, still running: nothing is stopped
        assert stop_leftovers(run) == [] and _alive(child)
        # the record as the owner would have written it; the owner then killed outright
        path = process_record(run)
        record = json.loads(path.read_text())
        record["owner"] = describe(owner.pid)
        path.write_text(json.dumps(record))
        assert stop_leftovers(run) == []  # the owner still runs
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _alive(child)  # orphaned, as a killed run's engine is
        assert stop_leftovers(run) == [child]
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
        assert not path.exists() and stop_leftovers(run) == []  # done with: the record is gone
    finally:
        owner.kill()
        owner.wait()


@pytest.mark.parametrize(
    "change",
    [
        {"started": 1},  # a reused pid: another start time
        {"exe": "/usr/bin/vllm"},
        {"cmdline": ["python", "-m", "vllm.entrypoints.openai.api_server"]},
        {"uids": [12345, 12345]},
    ],
    ids=["start-time", "executable", "command-line", "user"],
)
def test_a_listed_process_that_is_not_exactly_the_recorded_one_is_left_alone(tmp_path: Path, change) -> None:
    victim = _sleeper()
    try:
        entry = describe(victim.pid)
        assert entry is not None
        _plant(tmp_path, [{**entry, **change}])
        assert stop_leftovers(tmp_path) == [] and _alive(victim.pid)
        _plant(tmp_path, [entry])  # exactly it: stopped (the test can fail)
        assert stop_leftovers(tmp_path) == [victim.pid]
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.skipif(os.getuid() != 0, reason="starting a process as another user needs root")
def test_a_process_of_another_user_is_never_signalled(tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "600"], user=65534, group=65534, cwd="/")
    try:
        deadline = time.monotonic() + 10
        while (entry := describe(other.pid)) is None or entry["uids"] != [65534, 65534]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        me = os.getuid()
        for listed in (entry, {**entry, "uids": [me, me]}):  # as it is, or claimed to be ours
            _plant(tmp_path, [listed])
            assert stop_leftovers(tmp_path) == [] and _alive(other.pid)
    finally:
        other.kill()
        other.wait()


def test_a_record_of_another_directory_or_boot_stops_nothing(tmp_path: Path) -> None:
    victim = _sleeper()
    try:
        entry = describe(victim.pid)
        assert entry is not None
        _plant(tmp_path, [entry], run_dir=str(tmp_path / "elsewhere"))
        assert stop_leftovers(tmp_path) == []
        _plant(tmp_path, [entry], boot_id="another boot")
        assert stop_leftovers(tmp_path) == []
        process_record(tmp_path).write_text("{not json")
        assert stop_leftovers(tmp_path) == []
        assert stop_leftovers(tmp_path / "missing") == []
        assert _alive(victim.pid)
    finally:
        victim.kill()
        victim.wait()


def test_a_record_folder_that_is_not_private_is_not_trusted(tmp_path: Path, private: Path, caplog) -> None:
    victim = _sleeper()
    try:
        entry = describe(victim.pid)
        assert entry is not None
        _plant(tmp_path, [entry])
        folder = process_record(tmp_path).parent
        folder.chmod(0o777)  # another user could have written the record
        assert stop_leftovers(tmp_path) == [] and _alive(victim.pid)
        assert "is not private" in caplog.text
        record_processes(tmp_path, [victim.pid])  # nothing is recorded there either
        assert "are not recorded" in caplog.text
        if os.getuid() == 0:
            folder.chmod(0o700)
            os.chown(folder, 65534, 65534)  # owned by another user
            assert stop_leftovers(tmp_path) == [] and _alive(victim.pid)
            os.chown(folder, 0, 0)
        folder.chmod(0o700)
        folder.rename(private / "moved")
        (private / "toolgym").symlink_to(private / "moved")  # a link in its place
        assert stop_leftovers(tmp_path) == [] and _alive(victim.pid)
    finally:
        victim.kill()
        victim.wait()
