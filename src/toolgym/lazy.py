"""Lazy re-exports for package ``__init__`` files: public names without importing heavy modules.

``from toolgym.tools import DockerSandbox`` should work (the README names it there) without making
``import toolgym.tools`` import the docker SDK, and ``from toolgym.agents import HFPolicy`` without
``import toolgym.agents`` importing torch. A package lists ``name -> defining module`` once; the module
is imported on first access (PEP 562) and the value cached in the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` functions for ``package`` serving ``exports`` lazily.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the module that defines it (``"toolgym.tools.search.index"``).

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level. An unknown name raises
        ``AttributeError`` (so ``from package import submodule`` still finds submodules).
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
