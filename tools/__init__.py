"""toolgym.tools: tools and their backends (search indexes, the Docker sandbox, the paper store).

Public names are imported lazily (:mod:`toolgym.lazy`): ``import toolgym.tools`` imports neither
numpy-heavy index code nor the docker SDK until a name is used.
"""

from __future__ import annotations

from toolgym.lazy import lazy_exports

_EXPORTS = {
    "build_index": "toolgym.tools.search.index_build",
    "load_index": "toolgym.tools.search.index",
    "Index": "toolgym.tools.search.index",
    "Hit": "toolgym.tools.search.index",
    "DockerSandbox": "toolgym.tools.sandbox",
    "SandboxSession": "toolgym.tools.sandbox",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
