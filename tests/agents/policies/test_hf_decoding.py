"""The pieces of HFPolicy's continuous batching on plain tensors: the device sampler and its per-request
noise, the slot cache's layout, the token budget's admission rule, and the weights lock that lets a
learner in."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from toolgym.agents.policies.hf_decode import ContinuousDecoder
from toolgym.agents.policies.hf_rows import Request, Row
from toolgym.agents.policies.hf_sample import gumbel, noise_keys, sample
from toolgym.agents.policies.hf_slots import SlotCache
from toolgym.agents.policies.weights_lock import WeightsLock
from toolgym.core import SamplingParams


def draw(logits, temperature, top_p, seeds, positions=None):
    rows = logits.shape[0]
    positions = positions if positions is not None else [0] * rows
    temperature = temperature if torch.is_tensor(temperature) else torch.full((rows,), float(temperature))
    top_p = top_p if torch.is_tensor(top_p) else torch.full((rows,), float(top_p))
    keys = torch.tensor(noise_keys(seeds, positions))
    return sample(logits, temperature, top_p, keys, truncate=bool((top_p < 1).any()))


# ----------------------------------------------------------------- noise


def test_the_noise_is_a_function_of_seed_position_and_token_alone():
    keys = torch.tensor(noise_keys([7, 7, 8, 7], [3, 4, 3, 3]))
    noise = gumbel(keys, 5000)
    assert noise.shape == (4, 5000) and torch.isfinite(noise).all()
    assert torch.equal(noise[0], noise[3])  # the same (seed, position)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert torch.equal(gumbel(keys[2:3], 5000)[0], noise[2])  # alone or in a batch
    assert torch.equal(
        gumbel(keys[:1], 3000)[0], noise[0, :3000]
    )  # entry v depends on v, not on the vocab's size


def test_the_extreme_hashes_give_finite_noise():
    from toolgym.agents.policies.hf_sample import _uniform

    u = _uniform(torch.tensor([0, 1, 2**31, 2**32 - 1], dtype=torch.int64))
    assert (u > 0).all() and (u < 1).all() and torch.isfinite(-torch.log(-torch.log(u))).all()
    keys = torch.tensor(noise_keys([0], [0]))  # this key's noise once reached 1.0 at token 40097
    assert torch.isfinite(gumbel(keys, 49152)).all()


def test_the_noise_is_standard_gumbel_and_uncorrelated():
    keys = torch.tensor(noise_keys(list(range(40)) * 5, [p for p in range(5) for _ in range(40)]))
    noise = gumbel(keys, 4096).double()
    # standard Gumbel: mean 0.5772 (Euler's constant), variance pi^2 / 6; P(g <= 0) = 1/e
    assert float(noise.mean()) == pytest.approx(0.5772, abs=0.01)
    assert float(noise.var()) == pytest.approx(math.pi**2 / 6, rel=0.02)
    assert float((noise <= 0).double().mean()) == pytest.approx(1 / math.e, abs=0.005)
    flat = noise.view(200, 4096)
    neighbours = torch.corrcoef(torch.stack([flat[:, :-1].flatten(), flat[:, 1:].flatten()]))[0, 1]
    positions = torch.corrcoef(torch.stack([flat[:40].flatten(), flat[40:80].flatten()]))[0, 1]
    assert abs(float(neighbours)) < 0.01 and abs(float(positions)) < 0.01


# ----------------------------------------------------------------- sampling


def test_greedy_rows_take_the_argmax_with_the_models_own_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    ids, logprobs = draw(logits, 0.0, 1.0, [0, 1])
    assert ids.tolist() == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)
    assert logprobs.tolist() == pytest.approx([float(expected[0, 1]), float(expected[1, 0])])


def test_samples_follow_the_tempered_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 20_000
    seeds, positions = [11] * n, list(range(n))
    ids, logprobs = draw(logits.expand(n, 4).clone(), 1.0, 1.0, seeds, positions)
    freq = torch.bincount(ids, minlength=4).double() / n
    assert freq.tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.015)
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[ids], atol=1e-6)
    # temperature 2 flattens the distribution and the recorded logprob is the tempered one
    ids2, logprobs2 = draw(logits.expand(n, 4).clone(), 2.0, 1.0, seeds, positions)
    tempered = torch.softmax(logits / 2.0, dim=-1)
    freq2 = torch.bincount(ids2, minlength=4).double() / n
    assert freq2.tolist() == pytest.approx(tempered.tolist(), abs=0.015)
    assert torch.allclose(logprobs2, torch.log(tempered)[ids2], atol=1e-6)


def test_top_p_keeps_the_nucleus_and_renormalises():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 5_000
    ids, logprobs = draw(logits.expand(n, 4).clone(), 1.0, 0.7, [5] * n, list(range(n)))
    assert set(ids.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 0.15 and 0.05 are cut
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.5, 0.3]) / 0.8)[ids], atol=1e-6)


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 3
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 1.0])
    seeds, positions = [1, 2, 3, 4, 5, 6], [0, 9, 4, 2, 7, 1]
    ids, logprobs = draw(logits, temperature, top_p, seeds, positions)
    for row in range(6):
        alone_ids, alone_logprobs = draw(
            logits[row : row + 1],
            temperature[row : row + 1],
            top_p[row : row + 1],
            seeds[row : row + 1],
            positions[row : row + 1],
        )
        assert alone_ids.item() == ids[row].item()
        assert alone_logprobs.item() == pytest.approx(logprobs[row].item(), abs=1e-6)  # kernels' rounding


def test_a_zero_mass_token_is_never_drawn():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]]).expand(2000, 4).clone()
    ids, logprobs = draw(logits, 1.0, 1.0, list(range(2000)))
    assert set(ids.tolist()) == {0, 1} and torch.isfinite(logprobs).all()


def test_rounding_of_the_logits_rarely_moves_a_draw():
    """What the batch's shape can do to the logits on a GPU: noise of 1e-3 on logits of standard
    deviation 1 moves few Gumbel-max draws (0 of 400 measured; the inverse CDF moved 45)."""
    torch.manual_seed(1)
    logits = torch.randn(200, 49152)
    nudged = logits + torch.randn_like(logits) * 1e-3
    a, _ = draw(logits, 1.0, 1.0, list(range(200)))
    b, _ = draw(nudged, 1.0, 1.0, list(range(200)))
    assert int((a != b).sum()) <= 2


# ----------------------------------------------------------------- slot cache


def kv(n: int, fill: float, layers: int = 2, heads: int = 2, dim: int = 3):
    return [
        (torch.full((heads, n, dim), fill + i), torch.full((heads, n, dim), -fill - i)) for i in range(layers)
    ]


def test_rows_are_right_aligned_with_room_on_both_sides():
    cache = SlotCache.build([kv(5, 1.0), kv(3, 2.0)], room_left=2, room_right=4)
    assert cache.length == 7 and cache.capacity == 11 and cache.starts == [2, 4]
    assert cache.attention_mask[:, :7].tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]]
    row = cache.row(1)
    assert row[1][0].shape == (2, 3, 3) and torch.equal(row[1][0], kv(3, 2.0)[1][0])
    assert torch.equal(cache.row(0, 2)[0][1], kv(2, 1.0)[0][1])


def test_a_row_joins_a_free_slot_only_when_it_fits():
    cache = SlotCache.build([kv(5, 1.0), kv(3, 2.0)], room_left=2, room_right=4)
    assert cache.join(kv(4, 9.0), tokens_to_come=1) is None  # no free slot
    cache.leave(0)
    assert cache.join(kv(8, 9.0), tokens_to_come=1) is None  # longer than the columns left of `length`
    assert cache.join(kv(4, 9.0), tokens_to_come=5) is None  # its tokens to come pass the capacity
    assert cache.join(kv(4, 9.0), tokens_to_come=4) == 0
    assert cache.starts[0] == 3 and cache.attention_mask[0, :7].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(cache.row(0)[0][0], kv(4, 9.0)[0][0])
    assert not cache.free


def test_a_decode_step_writes_one_column_for_every_slot():
    cache = SlotCache.build([kv(2, 1.0), kv(1, 2.0)], room_left=0, room_right=2)
    mask = cache.step_mask()
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    for layer in cache.layers:
        layer.update(torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3))
    cache.advance()
    assert cache.length == 3 and cache.capacity - cache.length == 1
    assert cache.row(1)[0][0].shape == (2, 2, 3)
    layer = cache.layers[0]
    layer.update(torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3))
    with pytest.raises(RuntimeError, match="one column in every layer"):
        cache.advance()


# ----------------------------------------------------------------- token budget


def request(prompt: int, max_tokens: int) -> Request:
    return Request([1] * prompt, SamplingParams(max_tokens=max_tokens), seed=0)


def decoder(budget: int, max_context: int = 50) -> ContinuousDecoder:
    return ContinuousDecoder(
        None,
        "cpu",
        max_batch=8,
        max_batch_tokens=budget,
        stop_ids=(),
        decode=str,
        pad_id=0,
        max_context=max_context,
        prefix_cache=None,
    )


def test_a_token_budget_counts_every_row_padded_to_the_longest():
    dec = decoder(budget=100, max_context=100)
    dec.rows[0] = Row(request(10, 20), max_tokens=20)  # 30 tokens when it ends
    assert dec.fits([request(20, 30)])  # 2 rows x 50 = 100
    assert not dec.fits([request(21, 30)])  # 2 x 51
    assert not dec.fits([request(5, 5), request(5, 5), request(5, 5)])  # 4 rows x 30 = 120
    assert dec.fits([request(5, 5), request(5, 5)])  # 3 x 30 = 90
    capped = decoder(budget=100, max_context=50)
    capped.rows[0] = Row(request(10, 20), max_tokens=20)
    assert capped.fits([request(40, 30)])  # the context caps its completion at 10: 2 x 50


def test_a_row_alone_always_runs_and_no_budget_admits_by_count_alone():
    assert decoder(budget=10).fits([request(40, 10)])  # 50 tokens over a budget of 10: alone it runs
    dec = decoder(budget=0)
    dec.rows[0] = Row(request(40, 10), max_tokens=10)
    assert dec.fits([request(40, 10)] * 7)


# ----------------------------------------------------------------- the weights lock


def test_a_waiting_learner_goes_before_the_sampler():
    lock = WeightsLock()
    order: list[str] = []
    lock.acquire_for_sampler()  # rows in flight

    def learner():
        with lock:
            order.append("learner")

    thread = threading.Thread(target=learner)
    thread.start()
    deadline = time.monotonic() + 10
    while not lock.wanted and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lock.wanted  # the sampler sees it and admits nothing new
    lock.release()  # the rows in flight have ended
    lock.acquire_for_sampler()  # waits until the learner is through
    order.append("sampler")
    lock.release()
    thread.join(timeout=10)
    assert order == ["learner", "sampler"] and not lock.wanted


def test_the_lock_is_reentrant_for_the_learner():
    lock = WeightsLock()
    with lock, lock:
        assert not lock.wanted
    lock.acquire_for_sampler()
    lock.release()


# ----------------------------------------------------------------- grouped-query attention


def tiny_gqa_model(attention: str):
    import transformers

    from toolgym.agents.policies.hf_attention import GROUPED_SDPA

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation(GROUPED_SDPA if attention == "grouped" else "sdpa")
    return model


def test_grouped_sdpa_computes_sdpas_function_and_gradients(monkeypatch):
    from toolgym.agents.policies import hf_attention
    from toolgym.agents.policies.hf_attention import uses_grouped_queries

    grouped, plain = tiny_gqa_model("grouped"), tiny_gqa_model("sdpa")
    assert uses_grouped_queries(grouped.config) and grouped.config._attn_implementation != "sdpa"
    ids = torch.randint(0, 64, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding: a mask reaches the attention, so the grouped path runs
    mask[2, :7] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    outs = []
    for model in (grouped, plain):
        if model is grouped:  # every call has a mask here: none may fall back to sdpa
            monkeypatch.setattr(hf_attention, "sdpa_attention_forward", None)
        else:
            monkeypatch.undo()
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        real = mask.bool()
        loss = out.logits[real].logsumexp(-1).mean()
        loss.backward()
        step = model(
            input_ids=ids[:, -1:],
            attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=-1),
            position_ids=positions[:, -1:] + 1,
            past_key_values=out.past_key_values,
        )
        grads = [p.grad.clone() for p in model.parameters()]
        outs.append((out.logits[real].detach(), step.logits.detach(), grads))
    (a_logits, a_step, a_grads), (b_logits, b_step, b_grads) = outs
    assert torch.allclose(a_logits, b_logits, atol=1e-5)
    assert torch.allclose(a_step, b_step, atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a_grads, b_grads, strict=True))


def test_grouped_sdpa_leaves_what_it_does_not_handle_to_sdpa(monkeypatch):
    from toolgym.agents.policies import hf_attention

    calls = []
    monkeypatch.setattr(
        hf_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or (None, None)
    )
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    hf_attention.grouped_sdpa_forward(module, q, kv, kv, None)  # a causal prefill without a mask
    hf_attention.grouped_sdpa_forward(module, q, kv, kv, torch.ones(1, 4, 3, 3, dtype=torch.bool))  # per head
    hf_attention.grouped_sdpa_forward(
        module, q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool), output_attentions=True
    )
    assert len(calls) == 3
    out, _ = hf_attention.grouped_sdpa_forward(module, q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    assert out.shape == (1, 3, 4, 8) and len(calls) == 3
