"""A run killed outright leaves its policy's processes running; the next run here stops them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from toolgym.procs import descendants, record_processes, start_time, stop_leftovers

# A parent that starts a long-lived child (as a run starts its vLLM engine), prints its pid, waits.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_processes_of_a_killed_owner_are_stopped_and_nothing_else(tmp_path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        assert child in descendants(owner.pid) and child in descendants()  # below the owner, and us
        record = tmp_path / "processes.json"
        record_processes(record, [child])
        # written by us, the owner, still running: nothing is stopped
        assert stop_leftovers(record) == [] and _alive(child)
        # the record as the owner would have written it; the owner then killed outright
        data = json.loads(record.read_text())
        data["owner"] = {"pid": owner.pid, "started": start_time(owner.pid)}
        record.write_text(json.dumps(data))
        assert stop_leftovers(record) == []  # the owner still runs
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _alive(child)  # orphaned, as a killed run's engine is
        assert stop_leftovers(record) == [child]
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
        assert stop_leftovers(record) == []  # gone: nothing more to stop
    finally:
        owner.kill()
        owner.wait()


def test_a_reused_pid_or_an_unreadable_record_stops_nothing(tmp_path) -> None:
    me = os.getpid()
    record = tmp_path / "processes.json"
    # a listed pid whose start time differs is another process now (here: this very test)
    record.write_text(
        json.dumps(
            {
                "owner": {"pid": 999_999_999, "started": 1},
                "processes": [{"pid": me, "started": start_time(me) + 1}],
            }
        )
    )
    assert stop_leftovers(record) == []
    record.write_text("{not json")
    assert stop_leftovers(record) == []
    assert stop_leftovers(tmp_path / "missing.json") == []
