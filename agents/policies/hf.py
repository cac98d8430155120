"""The transformers policy: token-in/token-out generation with logprobs, micro-batched, CPU or GPU.

``HFPolicy()`` with no argument runs the embedded SmolLM2-135M-Instruct (see
:mod:`toolgym.agents.policies.models`); ``HFPolicy("path/to/dir")`` runs any local Hugging Face causal LM. Its
prompts are rendered in the model's chat format (``chat_format="auto"`` picks it from the tokenizer
and logs which: :mod:`toolgym.agents.chat.formats`); for SmolLM2 and every ChatML model that is
``hermes``, :class:`~toolgym.agents.chat.chatml.ChatMLTemplate` (SmolLM2's own template ignores tools).

Decisions recorded here (each is part of the contract):

* **Logprobs** are those of the distribution the token was actually drawn from: the raw logits
  divided by the temperature, restricted to the top-p nucleus and renormalised. That is the behaviour
  policy an importance ratio needs. Greedy decoding (``temperature == 0``) draws from a point mass
  whose logprob is always 0, which carries no information, so for greedy tokens we record the model's
  own (temperature 1, untruncated) logprob instead.
* **Ending.** ``finish_reason == "stop"`` when the model samples one of its format's end-of-turn
  tokens (``<|im_end|>`` for ChatML; kept as the last id,
  removed from ``text``) or when the decoded completion contains one of ``SamplingParams.stop``; for a
  stop string every sampled id is kept (so the trained tokens are exactly the sampled ones) and
  ``text`` is the decoded ids, stop string included. ``"length"`` when ``max_tokens`` (capped by the
  model's context) ran out.
* **Seeds.** Every request has a seed: ``SamplingParams.seed`` when set, else one drawn from the
  policy ``seed`` and a request counter (so a seeded policy replays the same samples for the same
  sequence of requests), else fresh entropy. In :meth:`generate_batch`, row ``i`` of a seeded request
  uses a seed derived from ``(seed, i)``, so a group of identical prompts still gets distinct samples.
  Under continuous batching a token's noise is a function of the seed and the token's index in the
  completion (:mod:`toolgym.agents.policies.hf_sample`), drawn for the whole batch on the device: the
  same seed gives the same tokens whatever shares the batch. Two requests with the same seed share
  their noise (the same prompt gives the same completion). The static batches draw each row from its
  own ``torch.Generator`` on the host (other numbers for the same seed).
* **Continuous batching** (``batching="continuous"``, the default). :meth:`generate` never runs the
  model on the event loop. Requests go to one worker thread that keeps up to ``max_batch`` rows in
  flight (and, with ``max_batch_tokens``, no more than that token budget holds: the rows' count times
  the longest row's prompt and completion): between two decode steps new requests join (each prefilled alone on its cached prefix) and
  finished rows leave, so a caller gets its completion as soon as its row ends and an episode's next
  turn never waits for another episode's long turn (:mod:`toolgym.agents.policies.hf_decode`). When
  the worker is idle it waits ``batch_wait_s`` for more requests before the first step.
  ``batching="static"`` is the earlier scheduler: the worker left-pads up to ``max_batch`` prompts and
  decodes them to the end of the last one, sampling row by row on the host; it serves models whose
  cache is not plain full attention (sliding windows, recurrent layers), for which continuous
  batching falls back to it with a warning.
* **Prefix cache** (``prefix_cache=True``, the default). An episode's requests share one growing
  token sequence, and all episodes of an environment share their system prompt, tool schemas and
  worked example; re-prefilling all of that every turn was most of the cost of an evaluation. The
  worker keeps the keys/values of recent sequences (:class:`~toolgym.agents.policies.prefix_cache.PrefixCache`,
  least recently used first out, bounded by ``prefix_cache_bytes`` and ``prefix_cache_entries``) and
  prefills each prompt alone on top of its longest cached prefix, then decodes the rows together
  from buffers allocated once (:mod:`toolgym.agents.policies.hf_cache`,
  :mod:`toolgym.agents.policies.hf_slots`). When a row ends, its prompt plus its sampled ids is stored
  (replacing the entry it extends). Positions are absolute from each row's
  first token in both paths, so the cached path computes the same function as the uncached one; the
  two differ only by floating-point rounding (other matrix shapes, about 1e-6 in the logits), which
  can flip a greedy choice only between near-tied tokens. The cache is cleared whenever
  ``policy_version`` changes. ``prefix_cache=False`` prefills every prompt whole each turn (alone
  under continuous batching, the batch left-padded under static batches).
  Models whose cache is not plain full attention (sliding windows, recurrent layers) always run
  uncached.
* **Attention.** A grouped-query model that transformers would run with ``sdpa`` runs with
  :mod:`toolgym.agents.policies.hf_attention`'s grouped SDPA (no per-head copy of the keys and
  values at each step; the same function up to rounding); ``attn_implementation`` picks another.
* **Logits** are computed for the last position only (``logits_to_keep=1``): the full prefill logits
  (``batch x prompt x vocab`` floats, gigabytes for long prompts) were never used.
* **Weight updates.** The worker holds :attr:`HFPolicy.weights_lock` (a
  :class:`~toolgym.agents.policies.weights_lock.WeightsLock`) while rows are in flight; a trainer that
  updates ``policy.model`` in place takes the same lock and then increments ``policy_version``. A
  trainer waiting for the lock stops admissions until the rows in flight end, so no completion mixes
  two weight versions and each reports the version it was sampled with.
* **Out of memory** on the device while sampling stops with :class:`~toolgym.errors.RunStopped`
  naming the settings to lower (``max_batch``, ``max_batch_tokens``, the episode's ``max_total_tokens``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolgym.agents.policies import hf_cache
from toolgym.agents.policies.base import ChatPolicy
from toolgym.agents.policies.hf_attention import GROUPED_SDPA, uses_grouped_queries
from toolgym.agents.policies.hf_decode import ContinuousDecoder
from toolgym.agents.policies.hf_rows import Request, Row
from toolgym.agents.policies.hf_static import sample_row, static_batch
from toolgym.agents.policies.hf_tokenizer import HFTokenizer, chat_tokenizer
from toolgym.agents.policies.models import require_hf
from toolgym.agents.policies.prefix_cache import PrefixCache
from toolgym.agents.policies.spec import resolve_model_dir
from toolgym.agents.policies.weights_lock import WeightsLock
from toolgym.core import Completion, SamplingParams
from toolgym.errors import ConfigError, RunStopped, check_choice

__all__ = ["HFPolicy", "HFTokenizer", "chat_tokenizer"]  # the tokenizer pair re-exported: its old home

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")
_BATCHING = ("continuous", "static")
_SEED_MOD = 2**63 - 1


class HFPolicy(ChatPolicy):
    """A transformers causal LM as a toolgym :class:`~toolgym.core.Policy` (see the module docstring).

    Args:
        model: ``None`` for the embedded SmolLM2 (converted and cached on first use), a local Hugging
            Face model directory, or a ``.gguf`` file.
        device: torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        threads: when set, ``torch.set_num_threads(threads)`` (process-wide). On small shared CPUs one
            thread per process is fastest under load.
        max_batch: most rows decoded together.
        max_batch_tokens: a token budget for the rows in flight under continuous batching (0 = none,
            ``max_batch`` alone): a row joins only while the rows' count times the longest row's prompt
            and completion stays within it (a bound on the key/value slots), so a device holds many
            short rows or few long ones; a row alone always runs. Not with ``batching="static"``.
        seed: base seed for requests whose ``SamplingParams.seed`` is unset.
        batch_wait_s: how long the worker waits for more requests before starting a batch.
        prefix_cache: reuse the keys/values of cached token prefixes (see the module docstring).
        prefix_cache_bytes: most bytes of cached keys/values (default 1 GiB: for SmolLM2 in fp32,
            45 KiB per token, so about 23k tokens, a dozen 2k-token episodes).
        prefix_cache_entries: most cached sequences.
        chat_format: the chat format (``auto``, a name, ``template`` or ``template:CALLS``; see
            :mod:`toolgym.agents.chat.formats`).
        thinking_budget: most reasoning tokens per turn (a format with reasoning markers only).
        batching: ``"continuous"`` (rows join and leave between decode steps) or ``"static"`` (each
            batch runs to its last row's end; see the module docstring).
        attn_implementation: the model's attention kernel (transformers' ``attn_implementation``:
            ``"sdpa"``, ``"eager"``, ...); ``None``: transformers' choice, except that a grouped-query
            model it gives ``sdpa`` gets :mod:`toolgym.agents.policies.hf_attention`'s grouped SDPA.
            One the model or the device does not support is refused at start.

    Attributes:
        model: the torch module (eval mode). A trainer may update its weights in place (under
            ``weights_lock``) and then bump ``policy_version``.
        tokenizer: an :class:`HFTokenizer`.
        eos_token_id: the id of the format's end-of-turn token (``<|im_end|>``); ``stop_ids`` all of them.
        chat_format: the resolved :class:`~toolgym.agents.chat.formats.ChatFormat`.
        policy_version: weight updates seen; stamped on every completion.
        weights_lock: a :class:`~toolgym.agents.policies.weights_lock.WeightsLock`, held by the
            generation worker while rows are in flight.
        batching: the scheduler in use (``"static"`` for a model without a plain cache).
        decode_stats: the continuous scheduler's counters
            (:class:`~toolgym.agents.policies.hf_decode.DecodeStats`; ``None`` under static batches).
        prefix_cache: the :class:`~toolgym.agents.policies.prefix_cache.PrefixCache`, or ``None`` when off.
    """

    name = "hf"

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int | None = None,
        max_batch: int = 8,
        seed: int | None = None,
        batch_wait_s: float = 0.005,
        prefix_cache: bool = True,
        prefix_cache_bytes: int = 1 << 30,
        prefix_cache_entries: int = 64,
        chat_format: str = "auto",
        thinking_budget: int | None = None,
        batching: str = "continuous",
        attn_implementation: str | None = None,
        max_batch_tokens: int = 0,
    ) -> None:
        torch, transformers = require_hf("HFPolicy")
        check_choice("dtype", dtype, _DTYPES)
        check_choice("batching", batching, _BATCHING)
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch_tokens < 0:
            raise ConfigError(f"max_batch_tokens must be >= 0 (0 = no token budget), got {max_batch_tokens}")
        if max_batch_tokens and batching == "static":
            raise ConfigError(
                "max_batch_tokens bounds the rows in flight of continuous batching; batching='static' "
                "runs max_batch rows to their end: set batching='continuous' or max_batch_tokens=0"
            )
        if prefix_cache_bytes < 0 or prefix_cache_entries < 0:
            raise ConfigError(
                "prefix_cache_bytes and prefix_cache_entries must be >= 0 (0 stores nothing), got "
                f"{prefix_cache_bytes} and {prefix_cache_entries}; use prefix_cache=False to turn the cache off"
            )
        if threads is not None:
            if threads < 1:
                raise ConfigError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        self._torch = torch
        self.model_dir = resolve_model_dir(model)
        start = time.perf_counter()
        tokenizer, fmt = chat_tokenizer(self.model_dir, chat_format, thinking_budget)
        super().__init__(tokenizer, chat_format=fmt)
        try:
            self.device = torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(f"unknown device {device!r} ({exc}); use 'cpu' or 'cuda'") from exc
        self.model = _load_model(transformers, self.model_dir, getattr(torch, dtype), attn_implementation)
        self.model.to(self.device)
        self.model.eval()
        logger.info("loaded %s on %s in %.1f s", self.model_dir, self.device, time.perf_counter() - start)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.stop_ids = frozenset(self.tokenizer.stop_ids)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.policy_version = 0
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.seed = seed
        self.batch_wait_s = batch_wait_s
        self.weights_lock = WeightsLock()
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._counter = 0
        self._closed = False
        self.prefix_cache: PrefixCache | None = None
        plain = hf_cache.plain_layers(self.model)
        if prefix_cache:
            if plain:
                self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_cache_entries)
            else:
                logger.warning("%s has no plain full-attention KV cache: prefix cache off", self.model_dir)
        if batching == "continuous" and not plain:
            logger.warning(
                "%s has no plain full-attention KV cache: static batches%s",
                self.model_dir,
                f" of max_batch rows (max_batch_tokens={max_batch_tokens} unused)"
                if max_batch_tokens
                else "",
            )
            batching = "static"
        self.batching = batching
        self._decoder: Any = None  # the ContinuousDecoder, made by the worker

    tokenizer: HFTokenizer

    @property
    def in_flight(self) -> int:
        """Rows decoding now under continuous batching (0 under static batches)."""
        return 0 if self._decoder is None else len(self._decoder.rows)

    @property
    def decode_stats(self) -> Any:
        """The continuous scheduler's counters (``None`` under static batches or before a request)."""
        return None if self._decoder is None else self._decoder.stats

    # ----------------------------------------------------------------- public API
    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        """Continue ``token_ids``; concurrent calls are decoded together (see the module docstring)."""
        request = self._submit(token_ids, sampling, self._request_seed(sampling, None))
        return await asyncio.wrap_future(request.future)

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Completion]:
        """Continue several prompts with the same sampling parameters, in one or more batches."""
        requests = [self._submit(p, sampling, self._request_seed(sampling, i)) for i, p in enumerate(prompts)]
        return list(await asyncio.gather(*(asyncio.wrap_future(r.future) for r in requests)))

    def close(self) -> None:
        """Stop the worker thread (pending requests are still served first). Idempotent."""
        self._closed = True
        with self._start_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._queue.put(None)
            worker.join()

    def __enter__(self) -> HFPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- submission
    def _request_seed(self, sampling: SamplingParams, row: int | None) -> int:
        self._counter += 1
        if sampling.seed is not None:
            return sampling.seed if row is None else _mix(sampling.seed, row)
        if self.seed is not None:
            return _mix(self.seed, self._counter)
        return secrets.randbits(62)

    def _submit(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> Request:
        if self._closed:
            raise ConfigError("this HFPolicy is closed; make a new one")
        prompt = [int(t) for t in token_ids]
        sampling.check()
        if not prompt:
            raise ConfigError("generate() needs at least one prompt token (render the chat first)")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"prompt token ids must lie in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        if len(prompt) >= self.max_context:
            raise ConfigError(
                f"the prompt has {len(prompt)} tokens but the model's context is {self.max_context}; "
                "lower the episode's max_total_tokens"
            )
        request = Request(prompt=prompt, sampling=sampling, seed=seed)
        self._ensure_worker()
        self._queue.put(request)
        return request

    def _ensure_worker(self) -> None:
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="toolgym-hf-generate", daemon=True)
                self._worker.start()

    # ----------------------------------------------------------------- worker thread
    def _work(self) -> None:
        if self.batching == "continuous":
            self._work_continuous()
        else:
            self._work_static()

    def _collect(self, into: collections.deque[Request], until: int, wait: float) -> bool:
        """Move queued requests into ``into`` until it holds ``until`` of them or ``wait`` seconds
        passed (0: only those already queued). Returns whether :meth:`close` was seen."""
        deadline = time.monotonic() + wait
        while len(into) < until:
            try:
                item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return False
            if item is None:
                return True
            into.append(item)
        return False

    def _new_decoder(
        self, cls: type[ContinuousDecoder] = ContinuousDecoder, **extra: Any
    ) -> ContinuousDecoder:
        """The continuous scheduler's decoder (a subclass may choose tokens otherwise: ``cls``)."""
        return cls(
            self.model,
            self.device,
            max_batch=self.max_batch,
            max_batch_tokens=self.max_batch_tokens,
            stop_ids=self.stop_ids,
            decode=self.tokenizer.decode,
            pad_id=self.tokenizer.pad_token_id,
            max_context=self.max_context,
            prefix_cache=self.prefix_cache,
            **extra,
        )

    def _sample_row(self, row: Row, logits: Any) -> int:
        """The static batches' draw: one token for ``row`` on the host, from its own generator."""
        return sample_row(row, logits, stop_ids=self.stop_ids, decode=self.tokenizer.decode)

    def _work_continuous(self) -> None:
        """Keep up to ``max_batch`` rows in flight; admit between decode steps (see the module docstring)."""
        decoder = self._decoder = self._new_decoder()
        pending: collections.deque[Request] = collections.deque()
        stop = held = False
        version = 0
        try:
            while True:
                if held and not decoder.rows:
                    self.weights_lock.release()  # between two rows in flight a learner may step in
                    held = False
                if not decoder.rows and not pending:
                    if stop:
                        return
                    first = self._queue.get()
                    if first is None:
                        return
                    pending.append(first)
                    stop = self._collect(pending, self.max_batch, self.batch_wait_s)
                elif not stop:
                    stop = self._collect(pending, sys.maxsize, 0.0)
                if not held:
                    self.weights_lock.acquire_for_sampler()
                    held = True
                    version = self.policy_version
                    decoder.prefix_cache = self.prefix_cache
                    if self.prefix_cache is not None:
                        self.prefix_cache.check_version(version)
                admit: list[Request] = []
                while (
                    pending
                    and len(admit) < decoder.free
                    and not self.weights_lock.wanted
                    and decoder.fits([*admit, pending[0]])
                ):
                    request = pending.popleft()
                    if request.future.set_running_or_notify_cancel():
                        admit.append(request)
                for step in (functools.partial(decoder.admit, admit), decoder.step):
                    try:
                        with self._torch.inference_mode():
                            done = step()
                    except BaseException as exc:  # noqa: BLE001 - delivered to every waiting caller
                        self._fail(admit + [row.request for row in decoder.clear()], exc)
                        if not isinstance(exc, Exception):
                            raise
                        break
                    for row in done:
                        row.request.future.set_result(
                            row.completion(version, self.stop_ids, self.tokenizer.decode)
                        )
        finally:
            if held:
                self.weights_lock.release()

    def _work_static(self) -> None:
        """Decode batches of up to ``max_batch`` requests, each to its last row's end."""
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch: collections.deque[Request] = collections.deque([first])
            stop = self._collect(batch, self.max_batch, self.batch_wait_s)
            live = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                completions = self._run_batch(live)
            except BaseException as exc:  # noqa: BLE001 - delivered to every waiting caller, not swallowed
                self._fail(live, exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for request, completion in zip(live, completions, strict=True):
                request.future.set_result(completion)

    def _fail(self, requests: Sequence[Request], exc: BaseException) -> None:
        """Deliver ``exc`` to every request not yet answered (out of device memory: a message naming
        the settings to lower)."""
        if isinstance(exc, getattr(self._torch, "OutOfMemoryError", ())):
            stopped = RunStopped(
                f"the transformers sampler ran out of memory on {self.device} with up to "
                f"{self.max_batch} rows in flight ({str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                f"lower policy.max_batch (now {self.max_batch}), set or lower policy.max_batch_tokens "
                f"(now {self.max_batch_tokens or 'none'}) or the episode's max_total_tokens, or "
                "leave more of the device to the sampler; a training run resumes from its last checkpoint"
            )
            stopped.__cause__ = exc
            exc = stopped
        answered: set[int] = set()
        for request in requests:
            if id(request) not in answered and not request.future.done():
                answered.add(id(request))
                request.future.set_exception(exc)

    def _run_batch(self, requests: list[Request]) -> list[Completion]:
        with self.weights_lock, self._torch.inference_mode():
            version = self.policy_version
            if self.prefix_cache is not None:
                self.prefix_cache.check_version(version)
            rows = static_batch(
                self.model,
                self.device,
                requests,
                prefix_cache=self.prefix_cache,
                pad_id=self.tokenizer.pad_token_id,
                stop_ids=self.stop_ids,
                decode=self.tokenizer.decode,
                max_context=self.max_context,
                draw=self._sample_row,
            )
        return [row.completion(version, self.stop_ids, self.tokenizer.decode) for row in rows]


def _load_model(transformers: Any, model_dir: Path, dtype: Any, attn_implementation: str | None) -> Any:
    """The causal LM in ``model_dir``; an attention implementation it cannot use is a ConfigError.

    By default a grouped-query model that transformers gives ``sdpa`` gets
    :data:`~toolgym.agents.policies.hf_attention.GROUPED_SDPA` instead (the same function without
    copying the keys and values per query head)."""
    if attn_implementation is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if model.config._attn_implementation == "sdpa" and uses_grouped_queries(model.config):
            model.set_attn_implementation(GROUPED_SDPA)
        return model
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation
        )
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} cannot run this model here: "
            f"{str(exc).splitlines()[0]}; 'sdpa' and 'eager' run every transformers model"
        ) from exc


def _mix(seed: int, index: int) -> int:
    """A per-request seed from a base seed and an index (splitmix-style; stable across runs)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % _SEED_MOD
