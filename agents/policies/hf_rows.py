"""A generation request of HFPolicy and its row while it decodes: the ids, logprobs and ending.

Both of HFPolicy's schedulers (:mod:`toolgym.agents.policies.hf_decode`, continuous; the static batches
in :mod:`toolgym.agents.policies.hf`) keep a :class:`Row` per request and end it the same way: on one
of the format's end-of-turn ids, on a stop string in the decoded ids, or at ``max_tokens``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from toolgym.core import Completion, SamplingParams

__all__ = ["Request", "Row"]


@dataclass
class Request:
    """A prompt, its sampling parameters and seed, and the future its caller awaits."""

    prompt: list[int]
    sampling: SamplingParams
    seed: int
    future: concurrent.futures.Future[Completion] = field(default_factory=concurrent.futures.Future)


@dataclass
class Row:
    """Decoding state of one request."""

    request: Request
    max_tokens: int
    generator: Any = None  # the static scheduler's per-row torch.Generator
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None

    def record(
        self, token: int, logprob: float, stop_ids: Collection[int], decode: Callable[[Sequence[int]], str]
    ) -> None:
        """Append a sampled token and its logprob; set :attr:`finish` when the row has ended."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        stop = self.request.sampling.stop
        if token in stop_ids or stop and any(s in decode(self.ids) for s in stop):
            self.finish = "stop"
        elif len(self.ids) >= self.max_tokens:
            self.finish = "length"

    def completion(
        self, version: int, stop_ids: Collection[int], decode: Callable[[Sequence[int]], str]
    ) -> Completion:
        """The finished row as a :class:`~toolgym.core.Completion` sampled with weight ``version``."""
        ended_on_eos = self.finish == "stop" and self.ids[-1] in stop_ids
        return Completion(
            token_ids=tuple(self.ids),
            logprobs=tuple(self.logprobs),
            text=decode(self.ids[:-1] if ended_on_eos else self.ids),
            finish_reason="stop" if self.finish == "stop" else "length",
            policy_version=version,
        )
