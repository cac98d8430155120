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
* **Seeds.** A request's sampling noise comes from its own ``torch.Generator``: ``SamplingParams.seed``
  when set, else one drawn from the policy ``seed`` and a request counter (so a seeded policy replays
  the same samples for the same sequence of requests), else fresh entropy. In :meth:`generate_batch`,
  row ``i`` of a seeded request uses a seed derived from ``(seed, i)``, so a group of identical
  prompts still gets distinct samples.
* **Micro-batching.** :meth:`generate` never runs the model on the event loop. Requests go to one
  worker thread that waits ``batch_wait_s`` for more requests, left-pads up to ``max_batch`` prompts
  and decodes them together with a KV cache; each row keeps its own sampling parameters. A batch runs
  to completion before the next one starts (no continuous batching).
* **Prefix cache** (``prefix_cache=True``, the default). An episode's requests share one growing
  token sequence, and all episodes of an environment share their system prompt, tool schemas and
  worked example; re-prefilling all of that every turn was most of the cost of an evaluation. The
  worker keeps the keys/values of recent sequences (:class:`~toolgym.agents.policies.prefix_cache.PrefixCache`,
  least recently used first out, bounded by ``prefix_cache_bytes`` and ``prefix_cache_entries``) and
  prefills each prompt alone on top of its longest cached prefix, then decodes the batch together
  from buffers allocated once (:mod:`toolgym.agents.policies.hf_cache`). After a batch, each row's prompt plus
  its sampled ids is stored (replacing the entry it extends). Positions are absolute from each row's
  first token in both paths, so the cached path computes the same function as the uncached one; the
  two differ only by floating-point rounding (other matrix shapes, about 1e-6 in the logits), which
  can flip a greedy choice only between near-tied tokens. The cache is cleared whenever
  ``policy_version`` changes. ``prefix_cache=False`` prefills the whole batch, left-padded, each turn.
  Models whose cache is not plain full attention (sliding windows, recurrent layers) always run
  uncached.
* **Logits** are computed for the last position only (``logits_to_keep=1``): the full prefill logits
  (``batch x prompt x vocab`` floats, gigabytes for long prompts) were never used.
* **Weight updates.** The worker holds :attr:`HFPolicy.weights_lock` for a whole batch; a trainer that
  updates ``policy.model`` in place takes the same lock and then increments ``policy_version``, so no
  completion mixes two weight versions and each reports the version it was sampled with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolgym.agents.policies import hf_cache
from toolgym.agents.policies.base import ChatPolicy
from toolgym.agents.policies.hf_cache import DecodeCache, prefill_row
from toolgym.agents.policies.hf_tokenizer import HFTokenizer, chat_tokenizer
from toolgym.agents.policies.models import require_hf
from toolgym.agents.policies.prefix_cache import PrefixCache
from toolgym.agents.policies.spec import resolve_model_dir
from toolgym.core import Completion, SamplingParams
from toolgym.errors import ConfigError, check_choice

__all__ = ["HFPolicy", "HFTokenizer", "chat_tokenizer"]  # the tokenizer pair re-exported: its old home

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")
_SEED_MOD = 2**63 - 1


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    future: concurrent.futures.Future[Completion] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Row:
    """Decoding state of one request inside a batch."""

    request: _Request
    max_tokens: int
    generator: Any
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


class HFPolicy(ChatPolicy):
    """A transformers causal LM as a toolgym :class:`~toolgym.core.Policy` (see the module docstring).

    Args:
        model: ``None`` for the embedded SmolLM2 (converted and cached on first use), a local Hugging
            Face model directory, or a ``.gguf`` file.
        device: torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        threads: when set, ``torch.set_num_threads(threads)`` (process-wide). On small shared CPUs one
            thread per process is fastest under load.
        max_batch: most prompts decoded together.
        seed: base seed for requests whose ``SamplingParams.seed`` is unset.
        batch_wait_s: how long the worker waits for more requests before starting a batch.
        prefix_cache: reuse the keys/values of cached token prefixes (see the module docstring).
        prefix_cache_bytes: most bytes of cached keys/values (default 1 GiB: for SmolLM2 in fp32,
            45 KiB per token, so about 23k tokens, a dozen 2k-token episodes).
        prefix_cache_entries: most cached sequences.
        chat_format: the chat format (``auto``, a name, ``template`` or ``template:CALLS``; see
            :mod:`toolgym.agents.chat.formats`).
        thinking_budget: most reasoning tokens per turn (a format with reasoning markers only).

    Attributes:
        model: the torch module (eval mode). A trainer may update its weights in place (under
            ``weights_lock``) and then bump ``policy_version``.
        tokenizer: an :class:`HFTokenizer`.
        eos_token_id: the id of the format's end-of-turn token (``<|im_end|>``); ``stop_ids`` all of them.
        chat_format: the resolved :class:`~toolgym.agents.chat.formats.ChatFormat`.
        policy_version: weight updates seen; stamped on every completion.
        weights_lock: held by the generation worker for the duration of each batch.
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
    ) -> None:
        torch, transformers = require_hf("HFPolicy")
        check_choice("dtype", dtype, _DTYPES)
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
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
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=getattr(torch, dtype)
        )
        self.model.to(self.device)
        self.model.eval()
        logger.info("loaded %s on %s in %.1f s", self.model_dir, self.device, time.perf_counter() - start)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.stop_ids = frozenset(self.tokenizer.stop_ids)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.policy_version = 0
        self.max_batch = max_batch
        self.seed = seed
        self.batch_wait_s = batch_wait_s
        self.weights_lock = threading.RLock()
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._counter = 0
        self._closed = False
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache:
            if hf_cache.plain_layers(self.model):
                self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_cache_entries)
            else:
                logger.warning("%s has no plain full-attention KV cache: prefix cache off", self.model_dir)

    tokenizer: HFTokenizer

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

    def _submit(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> _Request:
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
        request = _Request(prompt=prompt, sampling=sampling, seed=seed)
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
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            live = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                completions = self._run_batch(live)
            except BaseException as exc:  # noqa: BLE001 - delivered to every waiting caller, not swallowed
                for request in live:
                    request.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            for request, completion in zip(live, completions, strict=True):
                request.future.set_result(completion)

    def _run_batch(self, requests: list[_Request]) -> list[Completion]:
        torch = self._torch
        rows = []
        for r in requests:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(r.seed)
            rows.append(_Row(r, min(r.sampling.max_tokens, self.max_context - len(r.prompt)), generator))
        pad = self.tokenizer.pad_token_id
        with self.weights_lock, torch.inference_mode():
            version = self.policy_version
            if self.prefix_cache is not None:
                self.prefix_cache.check_version(version)
                logits, past, attention, decode = self._prefill_cached(rows)
            else:
                logits, past, attention = self._prefill_padded(requests)
                decode = None
            positions = torch.tensor([[len(r.prompt) - 1] for r in requests], device=self.device)
            steps = 0
            while True:
                next_ids = [
                    self._sample_row(row, logits[i]) if row.finish is None else pad
                    for i, row in enumerate(rows)
                ]
                if all(row.finish is not None for row in rows):
                    break
                attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=-1)
                positions = positions + 1
                step = torch.tensor(next_ids, dtype=torch.long, device=self.device)[:, None]
                out = self.model(
                    input_ids=step,
                    attention_mask=attention,
                    position_ids=positions,
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                logits = out.logits[:, -1, :].float().cpu()
                steps += 1
            if decode is not None and self.prefix_cache is not None:
                for i, row in enumerate(rows):
                    # NOTE: the last sampled id was never fed to the model, so it has no keys/values.
                    fed = len(row.ids) - 1
                    self.prefix_cache.insert(row.request.prompt + row.ids[:fed], decode.row(i, fed))
        return [self._completion(row, version) for row in rows]

    def _prefill_padded(self, requests: list[_Request]) -> tuple[Any, Any, Any]:
        """Prefill the whole batch at once, left-padded: last logits, the cache, the attention mask."""
        torch = self._torch
        width = max(len(r.prompt) for r in requests)
        input_ids = torch.full((len(requests), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            # NOTE: left padding, masked out, with positions counted from each row's first real token,
            # so a row's logits do not depend on the other prompts in its batch.
            input_ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt, dtype=torch.long)
            attention[i, width - len(r.prompt) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        input_ids, attention, positions = (t.to(self.device) for t in (input_ids, attention, positions))
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float().cpu(), out.past_key_values, attention

    def _prefill_cached(self, rows: list[_Row]) -> tuple[Any, Any, Any, Any]:
        """Prefill each prompt on its longest cached prefix; the batch's decode cache from the rows."""

        cache = self.prefix_cache
        assert cache is not None
        last, kvs = [], []
        for row in rows:
            prompt = row.request.prompt
            cached, prefix = cache.lookup(prompt, limit=len(prompt) - 1)
            if len(prompt) > 1 and cached < len(prompt) - 1:
                # NOTE (determinism): the last prompt token always runs alone on the keys/values of
                # the rest, so a repeated request (all but its last token cached) repeats exactly the
                # computation of the first one and gets bit-identical logprobs.
                _, prefix = prefill_row(self.model, prompt[:-1], cached, prefix, self.device)
                cached = len(prompt) - 1
            logits, layers = prefill_row(self.model, prompt, cached, prefix, self.device)
            # Stored at once, so a later row of this batch with the same prompt (a GRPO group) reuses it.
            cache.insert(prompt, layers)
            last.append(logits.float().cpu())
            kvs.append(layers)
        decode = DecodeCache(kvs, extra=max(row.max_tokens for row in rows))
        return self._torch.stack(last), decode.cache, decode.attention_mask, decode

    def _sample_row(self, row: _Row, logits: Any) -> int:
        """Draw one token for ``row`` from its logits, record it, and update the row's finish state."""
        torch = self._torch
        sampling = row.request.sampling
        if sampling.temperature == 0:
            token = int(torch.argmax(logits))
            logprob = float(torch.log_softmax(logits, dim=-1)[token])
        else:
            logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
            if sampling.top_p < 1.0:
                logp = _nucleus(torch, logp, sampling.top_p)
            token = int(torch.multinomial(logp.exp(), 1, generator=row.generator))
            logprob = float(logp[token])
        row.ids.append(token)
        row.logprobs.append(logprob)
        if (
            token in self.stop_ids
            or sampling.stop
            and any(s in self.tokenizer.decode(row.ids) for s in sampling.stop)
        ):
            row.finish = "stop"
        elif len(row.ids) >= row.max_tokens:
            row.finish = "length"
        return token

    def _completion(self, row: _Row, version: int) -> Completion:
        ended_on_eos = row.finish == "stop" and row.ids[-1] in self.stop_ids
        text = self.tokenizer.decode(row.ids[:-1] if ended_on_eos else row.ids)
        return Completion(
            token_ids=tuple(row.ids),
            logprobs=tuple(row.logprobs),
            text=text,
            finish_reason="stop" if row.finish == "stop" else "length",
            policy_version=version,
        )


def _nucleus(torch: Any, logp: Any, top_p: float) -> Any:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise."""
    sorted_logp, order = torch.sort(logp, descending=True)
    mass_before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()
    drop_sorted = mass_before >= top_p  # the first token always stays (mass_before == 0)
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def _mix(seed: int, index: int) -> int:
    """A per-request seed from a base seed and an index (splitmix-style; stable across runs)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % _SEED_MOD
