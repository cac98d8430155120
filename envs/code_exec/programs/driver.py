"""One hidden-test call, inside the verifier's container: load the candidate, make one call, report.

Started by the runner as the unprivileged candidate user, one isolated interpreter per call:
``python3 -I -B <harness dir>/driver.py <result fd>``, the job (JSON) on stdin. It prepares the call
(own working directory, CPU-time limit, first in line for the OOM killer, silenced stdio), runs the
candidate's code, then makes the call (``entry`` with encoded ``args``/``kwargs``, or an MBPP
expression ``expr`` after ``setup``) and writes ``<nonce>\\n<json>`` to the result pipe. The candidate
shares this process, so it can write to that pipe too: whatever it writes there is only a claim about
its own return value, which is exactly what the host scores anyway. Imported as a module it does nothing.
"""

from __future__ import annotations

import json
import os
import resource
import sys


def prepare(job: dict) -> None:
    with open("/proc/self/oom_score_adj", "w") as f:  # raising it needs no privilege
        f.write("1000")
    os.mkdir(job["dir"], 0o700)
    os.chdir(job["dir"])
    cpu_s = int(job["cpu"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)


def call(job: dict, dec, enc_result) -> dict:  # type: ignore[no-untyped-def]
    try:
        ns = {"__name__": "candidate", "__builtins__": __builtins__}
        exec(compile(job["code"], "candidate.py", "exec"), ns)
        if "expr" in job:
            for name in job.get("modules", ()):
                ns.setdefault(name, __import__(name))
            exec(compile(job.get("setup", ""), "setup.py", "exec"), ns)
            value = eval(compile(job["expr"], "test.py", "eval"), ns)
        else:
            value = ns[job["entry"]](*dec(job["args"]), **dec(job["kwargs"]))
        return {"ok": True, "value": enc_result(value)}
    except BaseException as exc:
        return {"ok": False, "error": type(exc).__name__}


def main() -> None:
    result_fd = int(sys.argv[1])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from codec import dec, enc_result  # the runner put toolgym's codec beside this file

    job = json.loads(sys.stdin.read())
    try:
        prepare(job)
    except OSError as exc:
        out = {"ok": False, "error": f"no_room: {exc.strerror}"}
    else:
        out = call(job, dec, enc_result)
    data = (job["nonce"] + "\n" + json.dumps(out)).encode()
    while data:
        data = data[os.write(result_fd, data) :]
    os.close(result_fd)


if __name__ == "__main__":
    main()
