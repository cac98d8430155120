"""Type information for the C extension built from tools/search/_bm25kernel.c.

Every array argument is any object with the buffer protocol (numpy arrays, memory maps, bytes) and
a 1-d C-contiguous layout; the extension checks item sizes and consistency and raises ValueError.
"""

Buffer = object

class Ranker:
    def __init__(
        self,
        docbytes: Buffer,
        blockoff: Buffer,
        blockbase: Buffer,
        tfs: Buffer,
        norms: Buffer,
        normcache: Buffer,
        idrank: Buffer,
        indptr: Buffer,
        blockptr: Buffer,
        blockmax: Buffer,
        blocklast: Buffer,
        idf: Buffer,
        presence: Buffer,
        presptr: Buffer,
        presshift: Buffer,
        block: int,
    ) -> None: ...
    def search(self, term_ids: Buffer, boosts: Buffer, k: int, /) -> list[tuple[int, float]]: ...
