"""The hidden-test runner, inside a fresh verifier container: run each call, report every result.

Trusted. Started by the host as the container's root, which holds only CAP_SETUID, CAP_SETGID and
CAP_KILL (see ``toolgym.tools.sandbox.policy``): ``python3 -I -B -c <this file's text> <uid>:<gid>``,
the job (JSON) on stdin. Every call runs in its own interpreter (``driver.py``) under the candidate
user, the container's sandbox user named by the argument, a different uid: the candidate can neither signal, stop nor trace this process, nor read its memory or
files. After each call every process but this one and PID 1 is killed (CAP_KILL) and reaped (this
process is their subreaper), so nothing of one call survives into the next.

Results come back through a pipe per call, not files, so this root process never opens a path the
candidate controls. The report goes to stdout as one line, ``<job nonce> <json>``; a failure of the
runner itself is reported as ``{"harness_error": <traceback>}``. Imported as a module it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback

HARNESS_DIR = "/work/.harness"
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
MAX_RESULT = 1 << 22


def setup(job: dict) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.mkdir(HARNESS_DIR, 0o755)
    for name in ("driver", "codec"):
        fd = os.open(os.path.join(HARNESS_DIR, name + ".py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(job[name])


def others() -> list[int]:
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]


def kill_all() -> None:
    """SIGKILL every process but this one and PID 1, reap them, repeat until none is left."""
    for _ in range(200):
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not others():
            return
        time.sleep(0.005)
    raise RuntimeError(f"processes survive SIGKILL: {others()}")


def collect(r: int, proc: subprocess.Popen, timeout: float) -> tuple[str, bytes]:
    """Read the result pipe until the driver exits (or the deadline): ``(status, bytes read)``."""
    deadline = time.monotonic() + timeout
    os.set_blocking(r, False)
    chunks, size = [], 0
    while True:
        exited = proc.poll() is not None
        left = deadline - time.monotonic()
        if left <= 0 and not exited:
            return "timeout", b"".join(chunks)
        ready, _, _ = select.select([r], [], [], 0 if exited else min(left, 0.05))
        if not ready:
            if exited:  # drained; a child still holding the pipe has nothing more to say that counts
                break
            continue
        try:
            b = os.read(r, 1 << 16)
        except BlockingIOError:
            continue
        if not b:
            break
        if size < MAX_RESULT:
            chunks.append(b)
            size += len(b)
    proc.wait()
    if proc.returncode == -signal.SIGXCPU and not chunks:
        return "cpu_limit", b""
    return "ok", b"".join(chunks)


def run_call(job: dict, call: dict, index: int) -> dict:
    payload = dict(call, code=job["code"], dir=f"/work/call{index}", cpu=job["cpu"])
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            ["python3", "-I", "-B", os.path.join(HARNESS_DIR, "driver.py"), str(w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/work",
            user=job["uid"],
            group=job["gid"],
            extra_groups=[],
            start_new_session=True,
            pass_fds=(w,),
        )
    except OSError as exc:
        os.close(r)
        os.close(w)
        if exc.errno not in (errno.EAGAIN, errno.ENOMEM):
            raise  # e.g. EPERM from setuid: the harness is broken, not the candidate
        kill_all()
        return {"status": "spawn_failed"}
    os.close(w)
    try:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps(payload).encode())
        with contextlib.suppress(OSError):
            proc.stdin.close()
        status, data = collect(r, proc, job["timeout"])
    finally:
        kill_all()
        os.close(r)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1)
    if status != "ok":
        return {"status": status}
    tag, _, body = data.decode("utf-8", "replace").partition("\n")
    if tag != call["nonce"]:
        return {"status": "bad_tag" if data else "no_result"}
    try:
        result = json.loads(body)
    except ValueError:
        return {"status": "no_result"}
    return {"status": "ok", "result": result}


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    try:
        job["uid"], job["gid"] = (int(part) for part in sys.argv[1].split(":"))  # the sandbox user
        setup(job)
        report, stop = {}, False
        for i, call in enumerate(job["calls"]):
            if stop:
                report[call["id"]] = {"status": "skipped"}
                continue
            report[call["id"]] = run_call(job, call, i)
            stop = report[call["id"]]["status"] in ("timeout", "cpu_limit")
        line = json.dumps({"calls": report})
    except Exception:
        line = json.dumps({"harness_error": traceback.format_exc()})
    sys.stdout.write(job["nonce"] + " " + line + "\n")


if __name__ == "__main__":
    main()
