"""The document store of a search index: titles and texts on disk, read by position or by id.

Files (see :mod:`toolgym.tools.search.index` for the whole index layout)::

    docs.bin             UTF-8 titles and texts back to back
    docs_offsets.npy     int64, 2N + 1 entries: title i starts at [2i], its text at [2i + 1], ends at [2i + 2]
    docs_ids.bin, docs_ids_offsets.npy, docs_ids_slots.npy
                         external ids by position, and position by id (:mod:`toolgym.tools.search.string_table`)

:class:`DocumentWriter` appends documents while a build streams its corpus (so no corpus is ever held
in memory as a whole); :class:`DocumentStore` opens the files memory-mapped in O(1), whatever the
collection's size, and is what both the index and the parallel BM25 build read documents through.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from toolgym.tools.search.string_table import StringTable, string_table_files, write_string_table

__all__ = ["DOC_FILES", "DocumentStore", "DocumentWriter"]

DOC_FILES = ("docs.bin", "docs_offsets.npy", *string_table_files("docs_ids"))


class DocumentWriter:
    """Appends ``(title, text)`` pairs to ``docs.bin`` under ``out``; :meth:`finish` writes the rest."""

    def __init__(self, out: Path) -> None:
        self._out = out
        self._fh = open(out / DOC_FILES[0], "wb")  # noqa: SIM115 -- closed by finish()
        self._offsets = array("q", [0])
        self._pos = 0

    def add(self, title: str, text: str) -> None:
        """Append one document (its position is the number added before it).

        Raises:
            UnicodeEncodeError: a lone surrogate in ``title`` or ``text`` (nothing is written then).
        """
        parts = (title.encode("utf-8"), text.encode("utf-8"))
        for data in parts:
            self._fh.write(data)
            self._pos += len(data)
            self._offsets.append(self._pos)

    def finish(self, ids: Sequence[str]) -> list[str]:
        """Close the text file and write the offsets and the id table; returns the file names."""
        self._fh.close()
        np.save(self._out / DOC_FILES[1], np.frombuffer(self._offsets, dtype=np.int64))
        write_string_table(ids, self._out, "docs_ids")
        return list(DOC_FILES)

    def close(self) -> None:
        """Close the text file without finishing (a failed build)."""
        self._fh.close()


class DocumentStore:
    """The stored documents of the index directory ``path``; read-only and thread-safe.

    Raises:
        OSError, ValueError: a file is missing or unreadable (callers turn this into BackendError).
    """

    def __init__(self, path: Path, *, with_ids: bool = True) -> None:
        self._path = path
        self._offsets = np.asarray(np.load(path / DOC_FILES[1], mmap_mode="r"))
        self._text: np.ndarray | None = (
            np.memmap(path / DOC_FILES[0], dtype=np.uint8, mode="r") if int(self._offsets[-1]) else None
        )
        self.ids: StringTable | None = StringTable(path, "docs_ids") if with_ids else None

    def __len__(self) -> int:
        return (len(self._offsets) - 1) // 2

    def raw(self, position: int) -> tuple[bytes, bytes]:
        """The UTF-8 bytes of the title and text of the document at ``position``."""
        start, mid, end = (int(x) for x in self._offsets[2 * position : 2 * position + 3])
        if self._text is None:
            return b"", b""
        return self._text[start:mid].tobytes(), self._text[mid:end].tobytes()

    def content(self, position: int) -> str:
        """What is indexed for the document at ``position``: title, a newline, then text."""
        title, text = self.raw(position)
        return f"{title.decode('utf-8')}\n{text.decode('utf-8')}"

    def contents(self, lo: int = 0, hi: int | None = None) -> Iterator[str]:
        """:meth:`content` of positions ``lo`` up to ``hi`` (default: the end), in order."""
        for position in range(lo, len(self) if hi is None else hi):
            yield self.content(position)

    def read_contents(self, lo: int, hi: int) -> list[str]:
        """:meth:`content` of positions [lo, hi) read with one ``pread`` instead of the memory map.

        What a bulk reader wants: the pages read do not stay mapped into this process, so reading
        the whole store does not grow its resident memory by the size of the store.
        """
        offsets = [int(x) for x in self._offsets[2 * lo : 2 * hi + 1]]
        with open(self._path / DOC_FILES[0], "rb") as fh:
            data = os.pread(fh.fileno(), offsets[-1] - offsets[0], offsets[0])
        base = offsets[0]
        return [
            f"{data[offsets[2 * i] - base : offsets[2 * i + 1] - base].decode('utf-8')}\n"
            f"{data[offsets[2 * i + 1] - base : offsets[2 * i + 2] - base].decode('utf-8')}"
            for i in range(hi - lo)
        ]
