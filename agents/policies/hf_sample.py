"""Sampling a whole decode batch on the model's device, with noise that belongs to each request.

This module imports torch at the top; :mod:`toolgym.agents.policies.hf_decode` imports it when a model
is loaded.

* **One draw per row, on the device.** :func:`sample` takes the batch's last logits ``[rows, vocab]``
  and per-row temperature, top-p and noise key, and returns the sampled ids and their logprobs (two
  ``[rows]`` tensors: all that has to leave the device). A sampled row draws by the Gumbel-max rule:
  the argmax of the tempered (and top-p truncated) log-probabilities plus independent Gumbel noise,
  an exact draw from that distribution. A greedy row (``temperature == 0``) takes the argmax and
  records the model's own logprob (temperature 1, untruncated), as the policy's contract asks.
* **Noise keyed by request, position and token.** :func:`noise_keys` hashes ``(seed, position)`` with
  SplitMix64 on the host; :func:`gumbel` expands each key on the device into one uniform per
  vocabulary entry (a counter-based hash of the key and the token id, 23 bits). A token's noise
  therefore depends only on its request's seed, its index in the completion and the vocabulary,
  never on the other rows of the batch, when the row joined, or how many draws came before: on one
  device the same seed gives the same tokens in any batch, up to the rounding of the logits
  themselves (which can move with the batch's shape on a GPU). Gumbel-max is robust to that
  rounding: a token moves only when two candidates' perturbed scores lie within it. Measured on 400
  rows of 49,152 random logits (standard deviation 1) nudged by noise of standard deviation 1e-3
  (1e-2, bf16's scale): 0 (3) of 400 Gumbel-max draws moved, 45 (224) of 400 inverse-CDF draws with
  the same uniforms. The price on a CPU: 4 to 9 ms a step for 8 rows (the inverse CDF 0.6 ms). Two
  requests with the same seed share their noise: the same prompt gives the same completion,
  different prompts get correlated draws.
* Every step is a row-wise operation (softmax, sort, hash, argmax), so a row's result does not depend
  on its neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["gumbel", "noise_keys", "nucleus", "sample"]

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_keys(seeds: Sequence[int], positions: Sequence[int]) -> list[list[int]]:
    """The noise key of token ``position`` of a request seeded ``seed``, for each pair: two 32-bit
    halves of ``splitmix64(splitmix64(seed) + position * golden)``."""
    keys = []
    for seed, position in zip(seeds, positions, strict=True):
        key = _splitmix64((_splitmix64(seed & _MASK64) + position * _GOLDEN) & _MASK64)
        keys.append([key >> 32, key & _MASK32])
    return keys


def gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[rows, vocab]`` (float32) from ``keys`` (``[rows, 2]`` int64, from
    :func:`noise_keys`), on ``keys``' device: entry ``(r, v)`` depends only on row ``r``'s key and ``v``."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None]
    x = ((ids * 0x9E3779B1) ^ keys[:, 1:]) & _MASK32
    x = _fmix32(x)
    x ^= keys[:, :1]
    return -torch.log(-torch.log(_uniform(_fmix32(x))))


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """Hashes below 2**32 as float32 numbers strictly inside (0, 1): their top 23 bits, centred (24
    bits would round the largest to 1.0, whose Gumbel noise is infinite)."""
    return ((x >> 9).to(torch.float32) + 0.5) * 2.0**-23


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on non-negative int64 values below 2**32 (a bijection)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x &= _MASK32
    x ^= x >> 13
    x *= 0xC2B2AE35
    x &= _MASK32
    x ^= x >> 16
    return x


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    *,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns ``(ids, logprobs)``, each ``[rows]`` on ``logits``' device.

    Args:
        logits: ``[rows, vocab]``, any float dtype (computed in float32).
        temperature: ``[rows]``; 0 is greedy.
        top_p: ``[rows]``; 1 keeps the whole distribution (ignored for greedy rows).
        keys: ``[rows, 2]`` int64 noise keys from :func:`noise_keys`.
        truncate: whether any sampled row has ``top_p < 1`` (known on the host, so no device sync).
    """
    logits = logits.float()
    greedy = temperature == 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    if truncate:
        logp = nucleus(logp, torch.where(greedy, torch.ones_like(top_p), top_p))
    noise = gumbel(keys, logits.shape[-1])
    noise.masked_fill_(greedy[:, None], 0.0)
    drawn = (logp + noise).argmax(dim=-1)
    return drawn, logp.gather(-1, drawn[:, None]).squeeze(-1)


def nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise."""
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = mass_before >= top_p[:, None]  # the first token always stays (mass_before == 0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
