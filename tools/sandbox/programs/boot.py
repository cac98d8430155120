"""One-shot run, inside the container: read the program from stdin, limit its CPU time, run it.

Runs as the sandbox user, started by ``python3 -c <this file's text> <cpu seconds>``. Protocol on
stdin: ``<n>\\n`` then ``n`` bytes of UTF-8 source; everything after belongs to the program's own stdin
(it is read unbuffered here, so none of it is consumed). The source is written to ``main.py`` so
tracebacks show its lines, then executed as ``__main__``.

Exit statuses the host reads as limits: 152 (128 + SIGXCPU, the CPU-time limit: the kernel's default
action for SIGXCPU gives it) and 153 (128 + SIGXFSZ: Python ignores SIGXFSZ, so a write past the file
size limit raises ``OSError(EFBIG)``; an uncaught one ends the program with this status). 125 means
the protocol itself was broken. Imported as a module it does nothing.
"""

from __future__ import annotations

import errno
import os
import resource
import sys
import traceback

EXIT_CPU = 152
EXIT_FSIZE = 153


def read_source() -> bytes:
    header = b""
    while not header.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            sys.exit(125)
        header += c
    left, parts = int(header), []
    while left:
        b = os.read(0, min(left, 1 << 16))
        if not b:
            sys.exit(125)
        parts.append(b)
        left -= len(b)
    return b"".join(parts)


def main() -> None:
    cpu_s = int(sys.argv[1])
    src = read_source()
    with open("main.py", "wb") as f:
        f.write(src)
    # Soft limit: SIGXCPU (default action ends the process); hard limit one second later: SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    sys.argv = ["main.py"]
    program = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(src, "main.py", "exec"), program)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.stderr.flush()
        too_big = isinstance(exc, OSError) and exc.errno == errno.EFBIG
        os._exit(EXIT_FSIZE if too_big else 1)


if __name__ == "__main__":
    main()
