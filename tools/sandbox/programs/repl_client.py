"""Session client, inside the container: one per cell; hands its stdio to the session's server.

Runs as the sandbox user: ``python3 -c <this file's text> <socket path> <cpu seconds>``, the cell's
source on stdin. It passes the server its stdout and stderr (``SCM_RIGHTS``) so the cell's output
streams back through this exec, exactly like a one-shot run, and exits with the status the server
sends (0, 1 for an exception, 152 for the CPU-time limit, 153 for the file size limit). 124 means the
server is gone: the host then starts a fresh interpreter. Imported as a module it does nothing.
"""

from __future__ import annotations

import os
import socket
import sys
import time

EXIT_LOST = 124


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(500):
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            try:
                with open(path + ".exit") as f:
                    reason = f.read(200)
            except OSError:
                reason = ""
            if reason:
                sys.stderr.write(f"sandbox: the session's interpreter was stopped: {reason}\n")
                os._exit(EXIT_LOST)
            time.sleep(0.01)
    sys.stderr.write("sandbox: the session's interpreter is not running\n")
    os._exit(EXIT_LOST)


def main() -> None:
    path, cpu_s = sys.argv[1], int(sys.argv[2])
    src = sys.stdin.buffer.read()
    s = connect(path)
    null = os.open("/dev/null", os.O_RDONLY)
    socket.send_fds(s, [f"{cpu_s}\n".encode()], [null, 1, 2])
    s.sendall(src)
    s.shutdown(socket.SHUT_WR)
    status = s.recv(1)
    os._exit(status[0] if status else EXIT_LOST)


if __name__ == "__main__":
    main()
