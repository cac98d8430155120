"""Session server, inside the container: owns an episode's globals, runs one cell per connection.

Runs as the sandbox user, started detached: ``python3 -c <this file's text> <socket path>``. Each
connection carries the client's stdio (``SCM_RIGHTS``), a ``<cpu seconds>\\n`` header and the cell's
source; the cell runs with those fds as 0/1/2 and the server answers one status byte (see
``repl_client``). The value of a final bare expression is printed, as in a REPL.

Limits. Before each cell the CPU-time soft limit is set to the CPU already used plus the cell's
allowance; the kernel's SIGXCPU then interrupts the cell (status 152) and the interpreter's state is
kept. Code a cell leaves running (a spinning thread) draws on the same allowance after the cell
returns; when it runs out between cells the server ends itself and writes why to ``<socket>.exit``,
which the next client reports. A write past the file size limit raises ``OSError(EFBIG)``; uncaught,
it ends the cell with status 153. The server's own stdio is ``/dev/null`` so that no cell can reach an
output channel other than its client's (capped) stream. Imported as a module it does nothing.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import os
import resource
import signal
import socket
import sys
import traceback

EXIT_CPU = 152
EXIT_FSIZE = 153


class CPUTimeExceeded(BaseException):
    """Raised by the SIGXCPU handler: the CPU-time allowance is spent."""


def on_sigxcpu(signum: int, frame: object) -> None:
    raise CPUTimeExceeded


def run_cell(src: str, ns: dict[str, object]) -> None:
    tree = ast.parse(src, "<cell>")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), ns)
        if value is not None:
            print(repr(value))


def allow_cpu(seconds: int) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + seconds + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def serve_one(conn: socket.socket, ns: dict[str, object]) -> None:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    chunks = [data]
    while True:
        b = conn.recv(1 << 16)
        if not b:
            break
        chunks.append(b)
    header, _, src = b"".join(chunks).partition(b"\n")
    flush()
    saved = [os.dup(i) for i in range(3)]
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    status = 0
    try:
        allow_cpu(int(header))
        run_cell(src.decode("utf-8", "replace"), ns)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except CPUTimeExceeded:
        status = EXIT_CPU
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        status = EXIT_FSIZE if isinstance(exc, OSError) and exc.errno == errno.EFBIG else 1
    flush()
    for i, fd in enumerate(saved):
        os.dup2(fd, i)
        os.close(fd)
    with contextlib.suppress(OSError):
        conn.sendall(bytes([status & 255]))
        conn.close()


def main() -> None:
    path = sys.argv[1]
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    signal.signal(signal.SIGXCPU, on_sigxcpu)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    os.rename(path + ".tmp", path)
    srv.listen(8)
    ns: dict[str, object] = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        while True:
            conn, _ = srv.accept()
            serve_one(conn, ns)
    except CPUTimeExceeded:
        # Outside a cell: code left running in the background spent the allowance. End the session.
        with open(path + ".exit", "w") as f:
            f.write("code left running after a cell used up the CPU-time limit\n")
        os._exit(EXIT_CPU)


if __name__ == "__main__":
    main()
