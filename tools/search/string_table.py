"""A read-only table of strings on disk: position -> string and string -> position, without loading it.

Why: a search index maps its vocabulary (terms -> term ids) and its document ids (external id <->
internal position). Holding those as Python lists and dicts costs a JSON parse and a dict build on
every open: about a second and a hundred megabytes per million strings, paid by every process before
its first query. Here the strings stay in three memory-mapped files and each lookup touches a few
pages:

* ``<name>.bin`` — the UTF-8 strings back to back;
* ``<name>_offsets.npy`` — int64, where each string starts (one more entry: the end);
* ``<name>_slots.npy`` — an open-addressing hash table (linear probing, at most half full) of
  positions, -1 where empty, keyed by CRC-32 of the UTF-8 bytes.

Opening is O(1); ``find`` and ``get`` are O(1) expected. The table is immutable: build it once with
:func:`write_string_table`. Strings round-trip exactly, lone surrogates included (``surrogatepass``).
"""

from __future__ import annotations

import mmap
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["StringTable", "string_table_files", "write_string_table"]


def string_table_files(name: str) -> tuple[str, str, str]:
    """The three file names a table called ``name`` consists of."""
    return f"{name}.bin", f"{name}_offsets.npy", f"{name}_slots.npy"


def write_string_table(strings: Sequence[str], out: Path, name: str) -> list[str]:
    """Write ``strings`` (unique) as the table ``name`` under ``out``; returns the file names.

    Raises:
        ValueError: a string occurs twice (a table maps each string to one position).
    """
    blob_name, offsets_name, slots_name = string_table_files(name)
    encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    with open(out / blob_name, "wb") as fh:
        for part in encoded:
            fh.write(part)
    np.save(out / offsets_name, offsets)

    size = 1 << max(3, (2 * len(encoded)).bit_length())
    mask = size - 1
    slots = [-1] * size
    crc32 = zlib.crc32
    for position, data in enumerate(encoded):
        slot = crc32(data) & mask
        while slots[slot] >= 0:
            if encoded[slots[slot]] == data:
                raise ValueError(f"{name}: {strings[position]!r} occurs twice")
            slot = (slot + 1) & mask
        slots[slot] = position
    np.save(out / slots_name, np.asarray(slots, dtype=np.int64))
    return [blob_name, offsets_name, slots_name]


def _int64_view(path: Path) -> tuple[mmap.mmap | None, memoryview]:
    """A 1-d int64 ``.npy`` file as a memoryview over a memory map (indexing gives Python ints)."""
    with open(path, "rb") as fh:
        major, _ = np.lib.format.read_magic(fh)
        read_header = (
            np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(fh)
        offset = fh.tell()
        if dtype != np.dtype("<i8") or fortran or len(shape) != 1:
            raise ValueError(f"{path}: expected a 1-d little-endian int64 array, got {dtype} {shape}")
        if shape[0] == 0:
            return None, memoryview(b"").cast("q")
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mapped)[offset : offset + 8 * shape[0]].cast("q")
    return mapped, view


class StringTable:
    """The table ``name`` under ``path`` (see the module docstring); read-only and thread-safe.

    Raises:
        OSError, ValueError: a file is missing or does not hold a table.
    """

    def __init__(self, path: Path, name: str) -> None:
        blob_name, offsets_name, slots_name = string_table_files(name)
        self._maps: list[mmap.mmap] = []
        offsets_map, self._offsets = _int64_view(path / offsets_name)
        slots_map, self._slots = _int64_view(path / slots_name)
        self._maps += [m for m in (offsets_map, slots_map) if m is not None]
        self._n = len(self._offsets) - 1
        self._mask = len(self._slots) - 1
        if self._n < 0 or len(self._slots) & self._mask or len(self._slots) < 2 * self._n:
            raise ValueError(f"{path / slots_name}: not a hash table of {max(self._n, 0)} entries")
        self._blob: mmap.mmap | bytes = b""
        if self._offsets[self._n]:
            with open(path / blob_name, "rb") as fh:
                self._blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if len(self._blob) != self._offsets[self._n]:
                raise ValueError(
                    f"{path / blob_name}: {len(self._blob)} bytes, the offsets say {self._offsets[self._n]}"
                )

    def __len__(self) -> int:
        return self._n

    def get(self, position: int) -> str:
        """The string at ``position`` (0 <= position < len).

        Raises:
            IndexError: ``position`` is out of range.
            UnicodeDecodeError: the file holds bytes that are not UTF-8 (it changed on disk).
        """
        if not 0 <= position < self._n:
            raise IndexError(position)
        return self._blob[self._offsets[position] : self._offsets[position + 1]].decode(
            "utf-8", "surrogatepass"
        )

    def find(self, text: str) -> int:
        """The position of ``text``, or -1 when the table does not hold it."""
        data = text.encode("utf-8", "surrogatepass")
        slots, offsets, blob, mask = self._slots, self._offsets, self._blob, self._mask
        slot = zlib.crc32(data) & mask
        for _ in range(len(slots)):  # at most half full, so an empty slot ends every probe
            position = slots[slot]
            if position < 0:
                return -1
            if blob[offsets[position] : offsets[position + 1]] == data:
                return position
            slot = (slot + 1) & mask
        return -1

    def all(self) -> list[str]:
        """Every string in position order (reads the whole table: for tests and small tables)."""
        return [self.get(i) for i in range(self._n)]
