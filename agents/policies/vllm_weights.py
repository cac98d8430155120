"""The vLLM worker side of an in-place weight load: a worker extension and checkpoint tensor names.

vLLM mixes :class:`WeightLoaderExtension` into its worker class (``worker_extension_cls``), so its
methods run inside the engine's worker process; ``toolgym.agents.policies.vllm`` calls them by name.
"""

from __future__ import annotations

import time
from pathlib import Path

from toolgym.agents.policies.vllm_log import RELOAD_LOGGER, demoted_on, reload_notices

__all__ = ["WeightLoaderExtension", "check_weights_file", "checkpoint_names", "safetensors_names"]


def checkpoint_names(model_dir: Path) -> set[str]:
    """Tensor names of a Hugging Face safetensors checkpoint, read from the file headers only."""
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        names |= safetensors_names(path)
    return names


def safetensors_names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:  # reads the header only
        return set(fh.keys())


def check_weights_file(path: Path, model_dir: Path, serving: int, version: int) -> None:
    """Refuse a reload the engine would fail on or mislabel: a missing file, tensors that are not the
    served checkpoint's (the tied output head aside), or a version that does not grow (ConfigError)."""
    from toolgym.errors import ConfigError

    if not path.is_file():
        raise ConfigError(f"weights file {path} does not exist")
    expected = checkpoint_names(model_dir) - {"lm_head.weight"}
    got = safetensors_names(path) - {"lm_head.weight"}
    if got != expected:
        raise ConfigError(
            f"weights file {path} does not match the served checkpoint: missing "
            f"{sorted(expected - got)[:5]}, unexpected {sorted(got - expected)[:5]} (export the "
            "trainer model with toolgym.training.weight_sync.export_weights)"
        )
    if version <= serving:
        raise ConfigError(f"version must grow: serving {serving}, asked to load {version}")


class WeightLoaderExtension:
    """vLLM worker extension (``worker_extension_cls``): reload the weights from a safetensors file.

    vLLM mixes this class into its worker class, so its methods run inside the engine's worker process,
    with ``self`` the worker (``self.reload_weights``, ``self.model_runner``, ``self.vllm_config``).
    They are called through ``AsyncLLM.collective_rpc`` by name.
    """

    def toolgym_load_weights(self, path: str) -> dict[str, float]:
        """Load every tensor of the safetensors file ``path`` into the running model, in place.

        The file must hold exactly the tensor names of the model's original checkpoint (a tied output
        head may be absent); anything else is refused before a single weight changes, so a bad export
        can never leave a half-updated model. vLLM's "Failed to load weights" warnings for the layers
        without checkpoint weights of their own are demoted to INFO with their reason
        (:func:`~toolgym.agents.policies.vllm_log.reload_notices`); any other layer's stays a warning.
        Returns ``{"tensors": n, "seconds": t, "notices_demoted": k}``.
        """
        from safetensors.torch import load_file

        start = time.perf_counter()
        expected = getattr(self, "_toolgym_names", None)
        if expected is None:
            model_dir = Path(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
            expected = checkpoint_names(model_dir)
            self._toolgym_names = expected
        got = safetensors_names(Path(path))
        missing = sorted(expected - got - {"lm_head.weight"})
        unexpected = sorted(got - expected - {"lm_head.weight"})
        if missing or unexpected:
            raise ValueError(
                f"weights file {path} does not match the served checkpoint: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]} (export the trainer's state_dict with the model's own names)"
            )
        tensors = load_file(path, device="cpu")
        config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        notices = reload_notices(tied_head=bool(getattr(config, "tie_word_embeddings", False)))
        with demoted_on(RELOAD_LOGGER, notices) as demoted:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=iter(tensors.items()), is_checkpoint_format=True
            )
        self._toolgym_retie()
        return {
            "tensors": float(len(tensors)),
            "seconds": time.perf_counter() - start,
            "notices_demoted": float(demoted.demoted),
        }

    def _toolgym_retie(self) -> None:
        """Point a tied output head at the freshly loaded embedding again.

        The checkpoint has no ``lm_head.weight`` when the head is tied, so vLLM's layerwise reload
        finds nothing to load for it and puts the head's *old* kernel tensors back (on CPU the head
        also keeps a pre-packed GEMM weight): the head would silently keep the old embedding.
        """
        config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        if not getattr(config, "tie_word_embeddings", False):
            return
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        try:
            head = model.get_submodule("lm_head")
            embed = model.get_submodule("model.embed_tokens")
        except AttributeError as exc:
            raise ValueError(f"cannot re-tie the output head of {type(model).__name__}: {exc}") from exc
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
