"""Weight sync from the trainer's model to a vLLM engine, in place, after each optimizer step.

On CPU with :class:`~toolgym.agents.policies.hf.HFPolicy` the policy *shares* the trainer's module, so
the sync is the version bump under the weights lock (see :mod:`toolgym.training.trainer`). A vLLM
engine holds its own copy of the weights in another process; :class:`VLLMWeightSync` writes the
trainer's ``state_dict`` to one safetensors file (in ``/dev/shm`` when the machine has it, so the
bytes never touch a disk) and asks the engine to reload from it
(:meth:`toolgym.agents.policies.vllm.VLLMPolicy.load_weights`: pause, reload in place, relabel the
version, resume; the engine is never restarted).

Why a file and not tensors: vLLM's ``collective_rpc`` serialises its arguments, so passing a state
dict by value would pickle every tensor through a socket; a path costs nothing and the worker memory
maps the file. A multi-GPU deployment would swap this for an NCCL transport; the contract
(``sync(model, version)``) stays.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from toolgym.agents.policies.vllm import SERVING_DTYPES, VLLMPolicy
from toolgym.agents.policies.vllm_server import VLLMServerPolicy
from toolgym.core import ServedPolicy
from toolgym.errors import ConfigError, check_choice
from toolgym.training.learn.lora import plain_state_dict

__all__ = ["VLLMWeightSync", "export_weights", "file_dtype"]

logger = logging.getLogger(__name__)


def _check_dtype(dtype: str) -> None:
    check_choice("the export dtype", dtype, SERVING_DTYPES)


def file_dtype(serving_dtype: str, learner_device: str) -> str:
    """The dtype the trainer writes weight files in: the engine's own on a CUDA learner (the cast runs
    on the GPU and halves the bytes copied to the host and written for bf16), fp32 on a CPU learner.

    On CPU the cast costs more than the bytes it saves: a random 1.0 B model pushed into a bf16
    engine synced in 11.8 s from an fp32 file vs 13.2 s from a bf16 one (export 7.3 s vs 8.9 s;
    ``bench/weight_sync.py --files float32,engine``, bench/README.md). The engine rounds an fp32 file
    to its dtype on load, so both end with the same weights.
    """
    _check_dtype(serving_dtype)
    return serving_dtype if str(learner_device).startswith("cuda") else "float32"


def export_weights(model: Any, path: str | Path, dtype: str = "float32") -> Path:
    """Write a transformers model's weights to ``path`` as safetensors, with the checkpoint's names.

    ``dtype``: the floating-point type written (the engine's serving dtype: an fp32 learner's weights
    written as bfloat16 are half the bytes, and the engine would have rounded them the same way on
    load); other tensors are written as they are.

    LoRA adapters are merged in (:func:`~toolgym.training.learn.lora.plain_state_dict`). A tied output head
    (``lm_head.weight`` sharing the embedding's storage) is left out, as
    ``save_pretrained`` does; the engine re-ties it. The file appears atomically (written beside, then
    renamed), so a reader never sees half a file.
    """
    import torch
    from safetensors.torch import save_file

    _check_dtype(dtype)
    cast = getattr(torch, dtype)
    path = Path(path)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    tensors = {}

    for name, tensor in plain_state_dict(model).items():  # LoRA adapters merged in
        if tied and name == "lm_head.weight":
            continue
        tensor = tensor.detach()
        if tensor.is_floating_point() and tensor.dtype != cast:
            tensor = tensor.to(cast)
        tensors[name] = tensor.to("cpu").contiguous()
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return path


class VLLMWeightSync:
    """Pushes a trainer model's weights into a running :class:`VLLMPolicy` (or a vLLM server,
    :class:`~toolgym.agents.policies.vllm_server.VLLMServerPolicy`, on this machine) after each step.

    Args:
        policy: the engine to update.
        directory: where the transfer file lives; default a fresh folder in ``base``. Removed by
            :meth:`close` when this object made it.
        dtype: the engine's serving dtype (``policy.dtype``); the file is written in it.
        base: where that fresh folder is made (``policy.weights_dir``: a directory a vLLM server on
            another machine also sees); default ``/dev/shm`` (RAM) when it exists, else the system
            temp dir.
    """

    def __init__(
        self,
        policy: ServedPolicy,
        directory: str | Path | None = None,
        *,
        dtype: str = "float32",
        base: str | Path | None = None,
    ) -> None:
        if not isinstance(policy, VLLMPolicy | VLLMServerPolicy):
            raise ConfigError(
                f"VLLMWeightSync needs a VLLMPolicy or a VLLMServerPolicy, got {type(policy).__name__}"
            )
        _check_dtype(dtype)
        self.policy, self.dtype = policy, dtype
        if directory is None:
            shm = Path("/dev/shm")
            if base is None and shm.is_dir() and os.access(shm, os.W_OK):
                base = shm
            if base is not None and not Path(base).is_dir():
                raise ConfigError(f"policy.weights_dir {str(base)!r} is not a directory")
            self.directory = Path(tempfile.mkdtemp(prefix="toolgym-weights-", dir=base))
            self._owned = True
        else:
            self.directory = Path(directory)
            self.directory.mkdir(parents=True, exist_ok=True)
            self._owned = False

    def sync(self, model: Any, version: int) -> dict[str, float]:
        """Copy ``model``'s weights into the engine and label them ``version`` (blocking).

        Returns timings: ``time/weight_export``, ``time/weight_load`` (inside the worker) and
        ``time/weight_sync`` (the whole call), in seconds.
        """
        start = time.perf_counter()
        path = export_weights(model, self.directory / "weights.safetensors", self.dtype)
        exported = time.perf_counter()
        try:
            result = self.policy.load_weights(path, version)
        finally:
            path.unlink(missing_ok=True)
        return {
            "time/weight_export": exported - start,
            "time/weight_load": float(result["seconds"]),
            "time/weight_sync": time.perf_counter() - start,
        }

    def close(self) -> None:
        """Remove the transfer folder (when this object made it). Idempotent."""
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> VLLMWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
