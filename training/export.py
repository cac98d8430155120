"""Inference exports: each checkpoint also writes a Hugging Face model directory of the trained policy.

The layout, the manifest and the checks a reader applies are documented in
:mod:`toolgym.agents.policies.run_exports` (the reader side, used by ``run:DIR`` policy specs). This module writes:

* :func:`export_model` — one export: ``save_pretrained`` weights (safetensors, the model's dtype),
  the tokenizer (with toolgym's ChatML template for a ``hermes`` policy; any other chat format keeps
  the model's own template, and the manifest records the format), and ``toolgym-export.json`` last, all in a hidden
  temporary directory that is fsynced and renamed into place, then ``latest.json`` (replaced
  atomically), then pruning to the newest ``keep`` exports. A kill at any moment leaves complete
  exports only (plus, at worst, a hidden temporary directory that the next export removes).
* :func:`export_checkpoint` — the trainer's hook after each checkpoint; a no-op for models that are
  not transformers models (the ``tiny`` test policy).
* :func:`export_from_checkpoint` — ``toolgym export RUN``: an export from ``RUN/checkpoint.pt`` for
  runs that have none (older runs, or one whose export was deleted or corrupted).

Exports at steps above the one being written belong to a history the run no longer has (a run
restarted without its checkpoint) and are removed with a warning, so ``run:DIR`` never resolves to
weights of another run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from toolgym.agents.chat.formats import resolve_chat_format
from toolgym.agents.policies.models import CACHE_FILES, HASHED_MAX_BYTES, require_hf
from toolgym.agents.policies.run_exports import (
    CHAT_TEMPLATE,
    EXPORT_DIR,
    EXPORT_MANIFEST,
    LATEST,
    chat_tokens,
    list_exports,
    step_dir_name,
)
from toolgym.agents.policies.spec import resolve_model_dir
from toolgym.errors import ConfigError
from toolgym.file_table import file_table, sha256_file
from toolgym.run_files import run_folder, write_atomic
from toolgym.training.checkpoint import load_checkpoint
from toolgym.training.config import LoraConfig, renamed_keys
from toolgym.training.learn.lora import apply_lora, is_lora, plain_state_dict

__all__ = ["DEFAULT_KEEP", "export_checkpoint", "export_from_checkpoint", "export_model"]

log = logging.getLogger(__name__)

#: Exports kept per run besides step 0 (the warm start's, always kept): SmolLM2-135M in fp32 is ~540 MB each.
DEFAULT_KEEP = 2


def base_model_info(model_dir: str | Path) -> dict[str, Any]:
    """Name and hash of the weights a run started from, carried through exports of exports.

    The embedded SmolLM2 cache records the GGUF it was converted from; an export records its own base;
    any other directory is named by path, with the sha256 of its ``config.json``.
    """
    model_dir = Path(model_dir)
    for name, read in (
        (EXPORT_MANIFEST, lambda m: m.get("base_model")),
        (CACHE_FILES, lambda m: {"name": m.get("source"), "sha256": m.get("source_sha256")}),
    ):
        path = model_dir / name
        if path.is_file():
            try:
                info = read(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, json.JSONDecodeError, AttributeError) as exc:
                log.warning("cannot read %s (%s); naming the base model by path", path, exc)
                break
            if isinstance(info, dict) and info.get("name"):
                return info
    config = model_dir / "config.json"
    return {"name": str(model_dir), "sha256": sha256_file(config) if config.is_file() else None}


def export_model(
    run_dir: str | Path,
    model: Any,
    tokenizer: Any,
    *,
    step: int,
    policy_version: int | None = None,
    base_model: dict[str, Any] | None = None,
    keep: int = DEFAULT_KEEP,
    chat_format: str = "hermes",
) -> Path:
    """Write ``RUN/export/step-NNNNNN`` atomically, point ``latest.json`` at it, prune old exports.

    Args:
        run_dir: the training run directory.
        model: a transformers ``PreTrainedModel`` (anything with ``save_pretrained`` and ``config``).
        tokenizer: its Hugging Face tokenizer; saved with :data:`~toolgym.agents.policies.run_exports.CHAT_TEMPLATE`
            for ``hermes``, with its own template for any other format.
        step: the optimizer step these weights are from.
        policy_version: the weight version rollouts report for them (default ``step``).
        base_model: what the run started from (see :func:`base_model_info`).
        keep: exports to keep (the newest ones; at least 1).
        chat_format: the chat format the policy was trained with (its resolved name), recorded so that
            the export renders the same way wherever it is loaded.

    Returns:
        The export directory.
    """
    if keep < 1:
        raise ConfigError(f"keep must be >= 1 (the export just written is always kept), got {keep}")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    root = run_folder(run_dir, EXPORT_DIR)  # a link on it would write (and prune) another run's exports
    _remove_temporaries(root)
    name = step_dir_name(step)
    final = root / name
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; an export is meant to be shared like any model dir

        # LoRA adapters are merged in: an export is an ordinary model directory
        state = plain_state_dict(model) if is_lora(model) else None
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
        # NOTE: the tokenizer may be a live policy's; its own template is restored (toolgym renders
        # prompts with its chat format, never with a template saved here).
        previous = tokenizer.chat_template
        if chat_format == "hermes":
            tokenizer.chat_template = CHAT_TEMPLATE
        try:
            tokenizer.save_pretrained(tmp)
        finally:
            tokenizer.chat_template = previous
        _write_manifest(tmp, model, tokenizer, step, policy_version, base_model, chat_format)
        _fsync_tree(tmp)
        _replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _write_latest(root, step, name)
    _prune(root, step, keep)
    log.info("exported step %d to %s in %.1f s", step, final, time.perf_counter() - start)
    return final


def export_checkpoint(
    run_dir: str | Path, model: Any, policy: Any, *, step: int, keep: int = DEFAULT_KEEP
) -> Path | None:
    """The trainer's hook: export the learner's ``model`` after a checkpoint, if it is a transformers model.

    The tokenizer is the policy's (``policy.tokenizer.hf``) or loaded from ``policy.model_dir``; the base
    model is read from ``policy.model_dir``. Returns ``None`` (and logs why) for other models.
    """
    model_dir = getattr(policy, "model_dir", None)
    if not hasattr(model, "save_pretrained") or model_dir is None:
        log.debug("no inference export for %s: not a transformers model", type(model).__name__)
        return None
    tokenizer = getattr(getattr(policy, "tokenizer", None), "hf", None)
    if tokenizer is None:
        _, transformers = require_hf("exporting a trained policy")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return export_model(
        run_dir,
        model,
        tokenizer,
        step=step,
        policy_version=int(getattr(policy, "policy_version", step)),
        base_model=base_model_info(model_dir),
        keep=keep,
        chat_format=str(getattr(getattr(policy, "chat_format", None), "name", "hermes")),
    )


def export_from_checkpoint(run_dir: str | Path, *, keep: int = DEFAULT_KEEP) -> Path:
    """Write an export from ``RUN/checkpoint.pt`` (``toolgym export RUN``).

    The base model comes from the run's ``config.json`` (``policy.model``, empty = the embedded
    SmolLM2); the checkpoint's weights must fit it exactly.

    Raises:
        ConfigError: no checkpoint or config, a ``tiny`` run (it has no Hugging Face model), or weights
            that do not fit the base model (a checkpoint of another model family).
    """
    run_dir = Path(run_dir)
    checkpoint, config_path = run_dir / "checkpoint.pt", run_dir / "config.json"
    if not checkpoint.is_file() or not config_path.is_file():
        raise ConfigError(
            f"{run_dir} has no checkpoint.pt and config.json; pass the --out of a `toolgym train` run"
        )
    try:
        stored = renamed_keys(json.loads(config_path.read_text(encoding="utf-8")))  # a record of any release
        policy_config = stored["policy"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{config_path} is unreadable ({exc})") from None
    kind = policy_config.get("kind", "hf")
    if kind == "tiny":
        raise ConfigError(
            f"{run_dir} trained a policy.kind = 'tiny' test model, which has no Hugging Face export"
        )
    torch, transformers = require_hf("exporting a checkpoint")

    state = load_checkpoint(run_dir)
    assert state is not None  # checked above
    model_dir = resolve_model_dir(policy_config.get("model") or None)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = stored.get("train", {}).get("lora", {})
    if int(lora.get("rank", 0)):  # the checkpoint holds the adapters; the export merges them
        settings = LoraConfig(
            rank=int(lora["rank"]),
            alpha=float(lora.get("alpha", 16.0)),
            targets=tuple(lora.get("targets", LoraConfig().targets)),
        )
        apply_lora(model, settings)
    try:
        model.load_state_dict(state["model"], strict=True)
    except (RuntimeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:300]
        raise ConfigError(
            f"the weights in {checkpoint} do not fit the base model {model_dir} ({first}); the run's "
            "config.json names another model than the one it trained"
        ) from None
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    chat_format = resolve_chat_format(
        policy_config.get("chat_format", "auto"), tokenizer, model_dir=model_dir
    )
    return export_model(
        run_dir,
        model,
        tokenizer,
        step=int(state["step"]),
        policy_version=int(state["policy_version"]),
        base_model=base_model_info(model_dir),
        keep=keep,
        chat_format=chat_format.name,
    )


# ----------------------------------------------------------------------------- helpers
def _write_manifest(
    directory: Path,
    model: Any,
    tokenizer: Any,
    step: int,
    policy_version: int | None,
    base_model: dict[str, Any] | None,
    chat_format: str,
) -> None:
    files = file_table(directory, exclude=(EXPORT_MANIFEST,), hash_max_bytes=HASHED_MAX_BYTES)
    dtype = next((str(p.dtype).removeprefix("torch.") for p in model.parameters()), "unknown")
    manifest = {
        "format": 1,
        "step": step,
        "policy_version": step if policy_version is None else policy_version,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "base_model": base_model or {},
        "architecture": (list(getattr(model.config, "architectures", None) or []) or [type(model).__name__])[
            0
        ],
        "dtype": dtype,
        "vocab_size": int(model.config.vocab_size),
        "chat_format": chat_format,
        "chat_tokens": {m: _token_id(tokenizer, m) for m in chat_tokens(chat_format)},
        "files": files,
    }
    write_atomic(directory / EXPORT_MANIFEST, json.dumps(manifest, indent=2))


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of a special token, or ``None`` when the vocabulary lacks it (a non-ChatML model, which
    the reader then refuses with that reason)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _fsync_tree(directory: Path) -> None:
    """Flush every file and the directory itself, so a rename never publishes unwritten data."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (the same step, re-run after a resume) is
    moved aside first and removed after."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_latest(root: Path, step: int, name: str) -> None:
    write_atomic(root / LATEST, json.dumps({"step": step, "dir": name}) + "\n")  # never through a link


def _prune(root: Path, step: int, keep: int) -> None:
    exports = list_exports(root.parent)
    for other, path in exports.items():
        if other > step:
            log.warning(
                "removing export %s: newer than step %d, it belongs to an earlier run history", path, step
            )
            shutil.rmtree(path, ignore_errors=True)
    # step 0 is the warm start's export (the held-out control arm, ``warm_start.reuse``): always kept
    older = [s for s in exports if 0 < s <= step]
    for other in older[: max(len(older) - keep, 0)]:
        shutil.rmtree(exports[other], ignore_errors=True)


def _remove_temporaries(root: Path) -> None:
    """Temporary directories of interrupted exports (a kill mid-write); none is ever complete."""
    for path in root.iterdir():
        if path.name.startswith(".step-") and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
