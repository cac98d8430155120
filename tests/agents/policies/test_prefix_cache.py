"""PrefixCache bookkeeping: longest-prefix lookup, superseding, LRU eviction by bytes and entries."""

from __future__ import annotations

import pytest
import torch

from toolgym.agents.policies.prefix_cache import PrefixCache

LAYERS = 2
HEADS, DIM = 1, 2
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4  # keys + values, float32


def kv(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer keys/values whose entries encode (layer, token id), to check what a lookup returns."""
    out = []
    for layer in range(LAYERS):
        base = torch.tensor(ids, dtype=torch.float32)[None, :, None].expand(HEADS, len(ids), DIM)
        out.append(((base + 1000 * layer).contiguous(), (-base - 1000 * layer).contiguous()))
    return out


def test_lookup_returns_the_longest_common_prefix_and_its_keys():
    cache = PrefixCache(max_bytes=1 << 20, max_entries=8)
    cache.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.insert([1, 2, 9, 9, 9], kv([1, 2, 9, 9, 9]))
    n, layers = cache.lookup([1, 2, 3, 7, 7])
    assert n == 3
    assert [k[0, :, 0].tolist() for k, _ in layers] == [[1, 2, 3], [1001, 1002, 1003]]
    assert layers[1][1][0, :, 1].tolist() == [-1001, -1002, -1003]
    assert cache.lookup([5, 1, 2]) == (0, [])
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.reused_tokens, stats.prefilled_tokens) == (2, 1, 3, 2 + 3)


def test_limit_leaves_tokens_to_prefill():
    cache = PrefixCache(max_bytes=1 << 20, max_entries=8)
    cache.insert([1, 2, 3], kv([1, 2, 3]))
    assert cache.lookup([1, 2, 3], limit=2)[0] == 2
    assert cache.lookup([1, 2, 3, 4], limit=3)[0] == 3


def test_min_match_turns_short_matches_into_misses():
    cache = PrefixCache(max_bytes=1 << 20, max_entries=8, min_match=3)
    cache.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    assert cache.lookup([1, 2, 5])[0] == 0
    assert cache.lookup([1, 2, 3, 5])[0] == 3


def test_an_extending_sequence_supersedes_its_prefix_and_a_prefix_is_not_stored():
    cache = PrefixCache(max_bytes=1 << 20, max_entries=8)
    assert cache.insert([1, 2], kv([1, 2]))
    assert cache.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    assert len(cache) == 1 and cache.nbytes == 4 * TOKEN_BYTES
    assert not cache.insert([1, 2, 3], kv([1, 2, 3]))
    assert len(cache) == 1 and cache.stats().evictions == 0


def test_least_recently_used_is_evicted_first_under_the_byte_bound():
    cache = PrefixCache(max_bytes=9 * TOKEN_BYTES, max_entries=8)
    cache.insert([1, 1, 1], kv([1, 1, 1]))
    cache.insert([2, 2, 2], kv([2, 2, 2]))
    cache.insert([3, 3, 3], kv([3, 3, 3]))
    assert cache.lookup([1, 1, 1, 0])[0] == 3  # touch: [2, 2, 2] is now the oldest
    cache.insert([4, 4], kv([4, 4]))
    assert cache.lookup([2, 2, 2])[0] == 0
    assert all(cache.lookup([t] * 3)[0] for t in (1, 3))
    stats = cache.stats()
    assert stats.evictions == 1 and stats.entries == 3 and stats.bytes == 8 * TOKEN_BYTES <= cache.max_bytes


def test_the_entry_bound_evicts_too():
    cache = PrefixCache(max_bytes=1 << 20, max_entries=2)
    for t in (1, 2, 3):
        cache.insert([t, t], kv([t, t]))
    assert len(cache) == 2 and cache.lookup([1, 1])[0] == 0 and cache.stats().evictions == 1


def test_a_sequence_larger_than_the_bound_is_not_stored():
    cache = PrefixCache(max_bytes=3 * TOKEN_BYTES, max_entries=8)
    cache.insert([1, 2], kv([1, 2]))
    assert not cache.insert([5, 6, 7, 8], kv([5, 6, 7, 8]))
    assert len(cache) == 1 and cache.lookup([1, 2, 3])[0] == 2


def test_a_new_weight_version_clears_the_cache():
    cache = PrefixCache(max_bytes=1 << 20, max_entries=8)
    cache.check_version(0)
    cache.insert([1, 2, 3], kv([1, 2, 3]))
    cache.check_version(0)
    assert len(cache) == 1
    cache.check_version(1)
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup([1, 2, 3, 4]) == (0, [])


def test_mismatched_keys_are_rejected():
    cache = PrefixCache(max_bytes=1 << 20, max_entries=8)
    with pytest.raises(ValueError, match="3 positions for 2 ids"):
        cache.insert([1, 2], kv([1, 2, 3]))


def test_bad_bounds_are_rejected():
    with pytest.raises(ValueError, match="max_bytes >= 0"):
        PrefixCache(max_bytes=-1, max_entries=8)
