"""The chunked log-probabilities of chosen tokens equal the log-softmax path's, values and gradients."""

from __future__ import annotations

import pytest
import torch

import toolgym.training.learn.chosen_logprobs as chosen
from toolgym.training.learn.chosen_logprobs import Hidden, Logits, chosen_logprobs, lm_parts, run_rows


def tiny_llama(tie: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=301,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).float().eval()


def graph_names(tensor: torch.Tensor, depth: int = 3) -> str:
    """The names of the autograd nodes nearest ``tensor``."""
    names, node = [], tensor.grad_fn
    for _ in range(depth):
        if node is None:
            break
        names.append(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    return " ".join(names)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("tie", "temperature", "frozen_head"), [(True, 1.0, False), (False, 0.7, False), (False, 1.0, True)]
)
def test_chunked_values_and_gradients_equal_the_log_softmax_path(
    monkeypatch, tie, temperature, frozen_head
) -> None:
    monkeypatch.setattr(
        chosen, "CHUNK_BYTES", 4 * 301 * 3
    )  # 3 rows a chunk: several chunks and a ragged last
    monkeypatch.setattr(chosen, "WHOLE_BYTES", 0)  # every batch of rows is chunked
    model = tiny_llama(tie)
    if frozen_head:
        model.lm_head.weight.requires_grad_(False)
    ids = torch.randint(0, 301, (3, 9))
    keep = torch.tensor([0, 2, 3, 7])  # rows read by a loss mask; row j predicts token j + 1
    targets = ids[:, 1:][:, keep]
    weights = torch.randn(3, len(keep))

    reference = Logits(model(input_ids=ids, logits_to_keep=keep).logits)
    want, want_ent = chosen_logprobs(reference, targets, temperature=temperature, entropy=True)
    (want * weights).sum().backward()
    want_grads = grads(model)
    model.zero_grad()

    rows, _ = run_rows(model, keep, input_ids=ids)
    assert isinstance(rows, Hidden) and rows.states.shape == (3, 4, 32)
    got, got_ent = chosen_logprobs(rows, targets, temperature=temperature, entropy=True)
    (got * weights).sum().backward()
    got_grads = grads(model)

    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=2e-6)
    assert set(got_grads) == set(want_grads) and (model.lm_head.weight.grad is None) == frozen_head
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_without_a_plain_output_layer_keeps_its_logits() -> None:
    model = tiny_llama(False)
    model.lm_head = torch.nn.Linear(32, 301, bias=True)  # a bias: not logits = hidden @ W.T alone
    assert lm_parts(model) is None
    rows, _ = run_rows(model, None, input_ids=torch.randint(0, 301, (1, 5)))
    assert isinstance(rows, Logits) and rows.logits.shape == (1, 5, 301)
    assert lm_parts(torch.nn.Linear(3, 3)) is None


def test_rows_whose_logits_are_small_are_scored_whole_with_the_same_values(monkeypatch) -> None:
    model = tiny_llama(False)
    ids = torch.randint(0, 301, (2, 6))
    rows, _ = run_rows(model, None, input_ids=ids)
    targets = ids.roll(-1, dims=1)
    whole, _ = chosen_logprobs(rows, targets)  # 12 rows of 301: far under WHOLE_BYTES
    assert "Chosen" not in graph_names(whole)
    monkeypatch.setattr(chosen, "WHOLE_BYTES", 0)
    chunked, _ = chosen_logprobs(rows, targets)
    assert "_ChosenBackward" in graph_names(chunked)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=2e-6)
