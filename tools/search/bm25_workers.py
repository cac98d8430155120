"""The default backend's analysis workers: a build's documents analysed on every CPU.

A worker is a plain ``python -c`` subprocess (``WORKER_CODE``) reading tasks (a range of document
positions) on stdin and writing pickled results on stdout, not a ``multiprocessing`` pool: a build
then never re-imports the caller's ``__main__`` script and works from an unguarded script, a notebook
or a process that runs a JVM. Task j goes to worker j mod n and results are read in task order, so
what :mod:`toolgym.tools.search.bm25_build` makes of them does not depend on the number of workers.
``TOOLGYM_INDEX_WORKERS`` sets that number (:func:`worker_count`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import subprocess
import sys
import traceback
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from toolgym.errors import BackendError
from toolgym.tools.search.bm25 import analyze
from toolgym.tools.search.doc_store import DocumentStore

__all__ = ["WORKER_CODE", "Workers", "analyse_range", "worker_count", "worker_main"]

#: Collections smaller than this are analysed in the building process.
PARALLEL_MIN_DOCS = 20_000


def worker_count(n_docs: int) -> int:
    """How many analysis processes a build of ``n_docs`` documents uses (0: analyse in-process)."""
    given = os.environ.get("TOOLGYM_INDEX_WORKERS")
    if given is not None:
        try:
            wanted = int(given)
        except ValueError:
            raise BackendError(f"TOOLGYM_INDEX_WORKERS must be an integer, got {given!r}") from None
        return wanted if wanted > 1 else 0
    if n_docs < PARALLEL_MIN_DOCS:
        return 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return min(cpus, 8) if cpus > 1 else 0


def analyse_range(store: DocumentStore, lo: int, hi: int) -> tuple[list[str], bytes, bytes]:
    """Terms of documents [lo, hi): (local vocabulary, int32 token ids, int32 lengths) as bytes."""
    local: dict[str, int] = {}
    tokens = array("i")
    lengths = array("i")
    for content in store.read_contents(lo, hi):
        terms = analyze(content)
        tokens.extend([local.setdefault(t, len(local)) for t in terms])
        lengths.append(len(terms))
    return list(local), tokens.tobytes(), lengths.tobytes()


#: What an analysis worker runs (``python -c``): a module constant, so tests can make one fail.
WORKER_CODE = "from toolgym.tools.search.bm25_workers import worker_main; worker_main()"
_HEADER = struct.Struct("<qq")
_FRAME = struct.Struct("<q")


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise EOFError
    return data


def worker_main() -> None:
    """Entry point of an analysis worker: tasks (lo, hi) on stdin, pickled results on stdout.

    A result frame is its length (int64) then the pickle; a negative length announces a traceback.
    """
    store = DocumentStore(Path(sys.argv[1]), with_ids=False)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            lo, hi = _HEADER.unpack(_read_exact(stdin, _HEADER.size))
        except EOFError:
            return
        try:
            payload = pickle.dumps(analyse_range(store, lo, hi), protocol=pickle.HIGHEST_PROTOCOL)
            stdout.write(_FRAME.pack(len(payload)) + payload)
        except Exception:  # report it to the parent, which raises it as a build error
            message = traceback.format_exc().encode("utf-8", "replace")
            stdout.write(_FRAME.pack(-len(message)) + message)
            stdout.flush()
            return
        stdout.flush()


class Workers:
    """Analysis subprocesses; task j goes to worker j mod n, so results come back in task order."""

    def __init__(self, n: int, store_path: Path) -> None:
        self._procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER_CODE, str(store_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for _ in range(n)
        ]

    def run(self, tasks: Sequence[tuple[int, int]]) -> Iterator[tuple[list[str], bytes, bytes]]:
        n = len(self._procs)
        sent = 0
        for j in range(len(tasks)):
            while sent < len(tasks) and sent < j + 2 * n:  # two tasks in flight per worker
                proc = self._procs[sent % n]
                assert proc.stdin is not None
                try:
                    proc.stdin.write(_HEADER.pack(*tasks[sent]))
                    proc.stdin.flush()
                except OSError:  # the pipe broke: the worker is gone
                    raise self._died(proc) from None
                sent += 1
            yield self._result(self._procs[j % n])

    @staticmethod
    def _result(proc: subprocess.Popen[bytes]) -> tuple[list[str], bytes, bytes]:
        assert proc.stdout is not None
        try:
            (size,) = _FRAME.unpack(_read_exact(proc.stdout, _FRAME.size))
            if size < 0:
                raise BackendError(
                    "an index build worker failed:\n" + _read_exact(proc.stdout, -size).decode("utf-8")
                )
            result: tuple[list[str], bytes, bytes] = pickle.loads(_read_exact(proc.stdout, size))
            return result
        except EOFError:
            raise Workers._died(proc) from None

    @staticmethod
    def _died(proc: subprocess.Popen[bytes]) -> BackendError:
        try:
            code: int | str = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = "unknown: it stopped answering"
        return BackendError(
            f"an index build worker died (exit status {code}); if the machine ran out of memory, "
            "set TOOLGYM_INDEX_WORKERS=1 (analysis in this process) and build again"
        )

    def close(self) -> None:
        for proc in self._procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):  # a dead worker's pipe
                    proc.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
