"""Inference exports of training runs: their layout, their validation, and finding one by step.

Every training checkpoint also writes a plain Hugging Face model directory (the *inference export*) so
that a trained policy can be evaluated, served (``vllm serve DIR``) or trained further without the
training state. The writer is :mod:`toolgym.training.export`; this module is the reader, kept in
``toolgym.agents`` because policies (``run:DIR`` specs) resolve exports and agents never import
training code.

Layout of a run directory::

    RUN/checkpoint.pt                     training state (model, optimizer, curriculum, RNG)
    RUN/export/step-000012/               a complete export: config.json, model.safetensors,
                                          tokenizer files (a ``hermes`` export's with
                                          :data:`CHAT_TEMPLATE`; others keep the model's own),
                                          toolgym-export.json (the manifest, written last)
    RUN/export/latest.json                {"step": 12, "dir": "step-000012"}: the newest export
    RUN/export/.step-000013.tmp-...       an export being written (ignored by readers)

Contract:
    * an export directory appears under its final name only once complete (written in a hidden
      temporary directory and renamed), so a reader never sees half an export;
    * the manifest ``toolgym-export.json`` records the step, the policy version, the base model
      (name and sha256 of the file it was converted from), the vocabulary size, the chat format it was
      trained with (``chat_format``, :mod:`toolgym.agents.chat.formats`; absent in older exports:
      ``hermes``) and the ids of that format's special tokens (``chat_tokens``), and every file's size
      (plus the sha256 of every small file). A policy loading the export with ``chat_format="auto"``
      renders in the recorded format;
    * :func:`export_problem` checks all of that from JSON and file headers only (no torch), so a
      corrupt export or one from another model family fails at start-up with a reason, not mid-run.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from toolgym.agents.chat.chatml import IM_END, IM_START
from toolgym.agents.chat.formats import EXPORT_MANIFEST, REQUIRED
from toolgym.agents.policies.models import safetensors_problem
from toolgym.chat_format_names import CHAT_FORMATS
from toolgym.errors import ConfigError
from toolgym.file_table import table_problem
from toolgym.parsing import RESPONSE_CLOSE, RESPONSE_OPEN

__all__ = [
    "CHAT_TEMPLATE",
    "EXPORT_DIR",
    "EXPORT_MANIFEST",
    "LATEST",
    "chat_tokens",
    "export_problem",
    "list_exports",
    "read_manifest",
    "resolve_run_export",
    "step_dir_name",
]

logger = logging.getLogger(__name__)

EXPORT_DIR = "export"
LATEST = "latest.json"
#: The files an export must hold to be loadable by transformers and vLLM.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_STEP_DIR = re.compile(r"^step-(\d{6,})$")

#: Jinja form of :class:`~toolgym.agents.chat.chatml.ChatMLTemplate` (``start``), stored in every export's
#: tokenizer so ``apply_chat_template`` and ``vllm serve`` render conversations exactly as toolgym
#: does: tool results become one user turn of ``<tool_response>`` blocks, and a user note right after
#: them joins that turn. (SmolLM2's own template ignores tools.) Written with string concatenation
#: only, because transformers renders templates in an immutable sandbox.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(tool='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- set ns.tool = ns.tool + ('\\n' if ns.tool else '') + '" + RESPONSE_OPEN + "\\n' + message['content']"
    " + '\\n" + RESPONSE_CLOSE + "' -%}"
    "{%- elif message['role'] == 'user' and ns.tool -%}"
    "{{- '" + IM_START + "user\\n' + ns.tool + '\\n' + message['content'] + '" + IM_END + "\\n' -}}"
    "{%- set ns.tool = '' -%}"
    "{%- else -%}"
    "{%- if ns.tool -%}"
    "{{- '" + IM_START + "user\\n' + ns.tool + '" + IM_END + "\\n' -}}"
    "{%- set ns.tool = '' -%}"
    "{%- endif -%}"
    "{{- '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + IM_END + "\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.tool -%}{{- '" + IM_START + "user\\n' + ns.tool + '" + IM_END + "\\n' -}}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{- '" + IM_START + "assistant\\n' -}}{%- endif -%}"
)


def chat_tokens(chat_format: str) -> tuple[str, ...]:
    """The special tokens an export of ``chat_format`` records the ids of (a template format: none)."""
    return REQUIRED.get(chat_format.partition(":")[0], ())


def step_dir_name(step: int) -> str:
    """``step-000012``: zero-padded so a plain listing sorts by step."""
    return f"step-{step:06d}"


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The export manifest of ``directory``.

    Raises:
        ConfigError: it is missing or unreadable (the directory is not a complete toolgym export).
    """
    path = Path(directory) / EXPORT_MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{directory} has no {EXPORT_MANIFEST}: it is not a complete toolgym export"
        ) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc})") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return manifest


def export_problem(directory: str | Path) -> str | None:
    """Why ``directory`` is not a usable export, or ``None`` when it is (see the module docstring).

    Checks: a readable manifest with a step, the required files, each file's size (and the sha256 of
    small files) against the manifest, the safetensors header, and that the tokenizer has the ChatML
    markers as single tokens with the ids and vocabulary size the manifest and config record (the
    toolgym chat template needs them; a model of another family has other ids or none).
    """
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except ConfigError as exc:
        return str(exc)
    files = manifest.get("files")
    if not isinstance(manifest.get("step"), int) or not isinstance(files, dict):
        return f"{EXPORT_MANIFEST} lacks 'step' or 'files'"
    for name in REQUIRED_FILES:
        if name not in files:
            return f"{EXPORT_MANIFEST} does not list {name} (an export needs config, tokenizer and weights)"
    problem = table_problem(directory, files)
    if problem is not None:
        return problem
    problem = safetensors_problem(directory / "model.safetensors")
    if problem is not None:
        return problem
    return _tokenizer_problem(directory, manifest)


def _tokenizer_problem(directory: Path, manifest: dict[str, Any]) -> str | None:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        tokenizer = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"config.json or tokenizer.json is unreadable ({exc})"
    vocab = config.get("vocab_size")
    if vocab != manifest.get("vocab_size"):
        return f"config.json has vocab_size {vocab}, the manifest says {manifest.get('vocab_size')}"
    added = {t.get("content"): t.get("id") for t in tokenizer.get("added_tokens", []) if isinstance(t, dict)}
    expected = manifest.get("chat_tokens") or {}
    chat_format = manifest.get("chat_format", "hermes")
    if chat_format not in CHAT_FORMATS[1:]:
        return f"{EXPORT_MANIFEST} records an unknown chat format {chat_format!r}"
    for marker in chat_tokens(chat_format):
        if marker not in added:
            if marker in (IM_START, IM_END):
                return (
                    f"the tokenizer has no {marker!r} token: toolgym's ChatML template needs a model trained "
                    "on ChatML (SmolLM2, Qwen, Hermes)"
                )
            return f"the tokenizer has no {marker!r} token, which its chat format {chat_format!r} needs"
        token_id = added[marker]
        if (
            expected.get(marker) != token_id
            or not isinstance(vocab, int)
            or not isinstance(token_id, int)
            or token_id >= vocab
        ):
            return (
                f"the tokenizer maps {marker!r} to id {token_id}, but the manifest records "
                f"{expected.get(marker)} and the model has {vocab} ids: tokenizer and weights come from "
                "different model families"
            )
    return None


def list_exports(run_dir: str | Path) -> dict[int, Path]:
    """Complete exports of a run (those with a manifest), by step; temporary directories are ignored."""
    root = Path(run_dir) / EXPORT_DIR
    out: dict[int, Path] = {}
    if not root.is_dir():
        return out
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / EXPORT_MANIFEST).is_file():
            out[int(match.group(1))] = path
    return dict(sorted(out.items()))


def latest_step(run_dir: str | Path, exports: dict[int, Path]) -> int:
    """The step ``latest.json`` names, or the highest complete one when the pointer is stale."""
    pointer = Path(run_dir) / EXPORT_DIR / LATEST
    try:
        step = int(json.loads(pointer.read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.debug("no usable %s (%s); taking the highest exported step", pointer, exc)
        return max(exports)
    if step not in exports:
        logger.warning(
            "%s names step %d, which has no complete export; using step %d", pointer, step, max(exports)
        )
        return max(exports)
    return step


def resolve_run_export(run_dir: str | Path, step: int | None = None) -> Path:
    """The export directory for ``run:DIR`` (newest) or ``run:DIR@STEP``, checked by :func:`export_problem`.

    ``DIR`` may also be an export directory itself (one holding ``toolgym-export.json``).

    Raises:
        ConfigError: no such directory, no export in it, no export for ``step`` (the message lists the
            steps there are), or an export that fails its checks; each message says how to fix it.
    """
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise ConfigError(
            f"run directory {str(run)!r} does not exist; pass the --out of a `toolgym train` run"
        )
    if (run / EXPORT_MANIFEST).is_file():
        if step is not None:
            raise ConfigError(f"{run} is a single export; drop '@{step}' or pass its run directory")
        chosen = run
    else:
        exports = list_exports(run)
        if not exports:
            raise ConfigError(_no_export_message(run))
        if step is None:
            step = latest_step(run, exports)
        elif step not in exports:
            available = ", ".join(str(s) for s in exports)
            raise ConfigError(
                f"{run} has no export for step {step}; available steps: {available} (a run keeps only its "
                f"last few exports). Fix: run:{run}@{max(exports)}, or run:{run} for the newest"
            )
        chosen = exports[step]
    problem = export_problem(chosen)
    if problem is not None:
        raise ConfigError(
            f"export {chosen} is unusable: {problem}. Fix: write a fresh export from the run's checkpoint "
            f"with `toolgym export {run if chosen != run else chosen.parent.parent}`"
        )
    return chosen


def _no_export_message(run: Path) -> str:
    if (run / "checkpoint.pt").is_file():
        return (
            f"{run} has a training checkpoint but no inference export under {run / EXPORT_DIR}. "
            f"Fix: `toolgym export {run}` writes one from the checkpoint"
        )
    if (run / "eval.json").is_file():
        return f"{run} is an evaluation output, not a training run; pass the --out of `toolgym train`"
    return f"{run} holds no checkpoint and no export; train first: `toolgym train --out {run}`"
