"""Inference exports: complete or absent, pruned, validated, loadable, written by the trainer.

Most tests use a tiny randomly initialised Llama with a real byte-level BPE tokenizer that has the
ChatML markers (seconds); the end-to-end test at the bottom uses the real SmolLM2.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import ByteLevelBPETokenizer

from toolgym.agents.chat.chatml import IM_END, IM_START, ChatMLTemplate
from toolgym.agents.policies.run_exports import (
    EXPORT_MANIFEST,
    export_problem,
    list_exports,
    read_manifest,
    resolve_run_export,
)
from toolgym.agents.policies.spec import parse_policy_spec
from toolgym.errors import ConfigError
from toolgym.training.export import export_from_checkpoint, export_model


def tiny_tokenizer(chatml: bool = True) -> transformers.PreTrainedTokenizerFast:
    specials = [IM_START, IM_END] if chatml else ["<s>", "</s>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world"], vocab_size=300, special_tokens=specials, show_progress=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=specials[1])


def tiny_model(vocab: int, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny():
    tokenizer = tiny_tokenizer()
    return tiny_model(len(tokenizer)), tokenizer


def test_export_is_a_loadable_hf_dir_with_manifest_and_chat_template(tmp_path, tiny):
    model, tokenizer = tiny
    path = export_model(tmp_path, model, tokenizer, step=3, base_model={"name": "tiny", "sha256": "ab"})
    assert path == tmp_path / "export" / "step-000003"
    assert export_problem(path) is None
    manifest = read_manifest(path)
    assert manifest["step"] == 3 and manifest["policy_version"] == 3
    assert manifest["base_model"] == {"name": "tiny", "sha256": "ab"}
    assert manifest["vocab_size"] == len(tokenizer) and manifest["dtype"] == "float32"
    assert manifest["chat_tokens"] == {IM_START: tokenizer.convert_tokens_to_ids(IM_START), IM_END: 1}
    assert json.loads((tmp_path / "export" / "latest.json").read_text()) == {"step": 3, "dir": "step-000003"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    reloaded = transformers.AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "r"},
    ]
    text = reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ChatMLTemplate().start(messages)
    assert tokenizer.chat_template is None  # the caller's (possibly live) tokenizer is left as it was


def test_only_the_last_k_exports_are_kept_and_latest_points_at_the_newest(tmp_path, tiny):
    model, tokenizer = tiny
    for step in (1, 2, 3, 4):
        export_model(tmp_path, model, tokenizer, step=step, keep=2)
    assert list(list_exports(tmp_path)) == [3, 4]
    assert resolve_run_export(tmp_path) == tmp_path / "export" / "step-000004"
    assert resolve_run_export(tmp_path, 3) == tmp_path / "export" / "step-000003"
    step_dir = tmp_path / "export" / "step-000003"
    assert resolve_run_export(step_dir) == step_dir  # an export directory names itself
    with pytest.raises(ConfigError, match="is a single export; drop '@3'"):
        resolve_run_export(step_dir, 3)
    with pytest.raises(ConfigError, match="no export for step 1; available steps: 3, 4"):
        resolve_run_export(tmp_path, 1)


def test_the_warm_start_export_at_step_0_is_never_pruned(tmp_path, tiny):
    # step 0 is the warm-started policy: the held-out control arm and warm_start.reuse read it at the end
    model, tokenizer = tiny
    for step in (0, 3, 6, 9):
        export_model(tmp_path, model, tokenizer, step=step, keep=2)
    assert list(list_exports(tmp_path)) == [0, 6, 9]
    assert resolve_run_export(tmp_path, 0) == tmp_path / "export" / "step-000000"


def test_exports_newer_than_the_step_written_belong_to_another_history(tmp_path, tiny):
    model, tokenizer = tiny
    export_model(tmp_path, model, tokenizer, step=9)
    export_model(tmp_path, model, tokenizer, step=1)  # a run restarted from scratch in the same dir
    assert list(list_exports(tmp_path)) == [1]


def test_a_crash_mid_export_leaves_the_previous_export_and_no_partial_dir(tmp_path, tiny, monkeypatch):
    model, tokenizer = tiny
    export_model(tmp_path, model, tokenizer, step=1)

    def crash(directory, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # like a kill between two writes

    monkeypatch.setattr(model, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        export_model(tmp_path, model, tokenizer, step=2)
    assert list(list_exports(tmp_path)) == [1]
    assert [p.name for p in (tmp_path / "export").iterdir() if p.is_dir()] == ["step-000001"]
    assert resolve_run_export(tmp_path).name == "step-000001"


def test_a_leftover_temporary_dir_is_ignored_then_removed(tmp_path, tiny):
    model, tokenizer = tiny
    leftover = tmp_path / "export" / ".step-000002.tmp-dead"
    leftover.mkdir(parents=True)
    (leftover / EXPORT_MANIFEST).write_text("{}")
    assert list_exports(tmp_path) == {}
    export_model(tmp_path, model, tokenizer, step=2)
    assert not leftover.exists()


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 16), "model.safetensors has 16 bytes"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda d: (d / "config.json").write_text((d / "config.json").read_text() + " "), "config.json has"),
        (lambda d: (d / EXPORT_MANIFEST).write_text("{not json"), "unreadable"),
    ],
)
def test_a_damaged_export_is_refused_with_the_reason_and_the_fix(tmp_path, tiny, tamper, reason):
    model, tokenizer = tiny
    path = export_model(tmp_path, model, tokenizer, step=5)
    tamper(path)
    with pytest.raises(ConfigError) as info:
        parse_policy_spec(f"run:{tmp_path}@5").model_dir()
    assert reason in str(info.value) and "toolgym export" in str(info.value)


def test_an_export_of_another_model_family_is_refused(tmp_path):
    tokenizer = tiny_tokenizer(chatml=False)
    export_model(tmp_path, tiny_model(len(tokenizer)), tokenizer, step=1)
    with pytest.raises(ConfigError, match=re.escape("has no '<|im_start|>' token")):
        resolve_run_export(tmp_path)


def test_export_from_checkpoint_refuses_weights_of_another_model(tmp_path):
    from toolgym.training.checkpoint import save_checkpoint

    base = tmp_path / "base"
    tokenizer = tiny_tokenizer()
    tiny_model(len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"policy": {"kind": "hf", "model": str(base)}}))
    other = tiny_model(len(tokenizer) + 8)  # another vocabulary: another family
    save_checkpoint(run, {"model": other.state_dict(), "step": 2, "policy_version": 2})
    with pytest.raises(ConfigError, match="do not fit the base model"):
        export_from_checkpoint(run)
    good = tiny_model(len(tokenizer), seed=1)
    save_checkpoint(run, {"model": good.state_dict(), "step": 2, "policy_version": 2})
    path = export_from_checkpoint(run)
    assert read_manifest(path)["base_model"]["name"] == str(base)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(loaded.model.embed_tokens.weight, good.model.embed_tokens.weight)


def test_tiny_run_has_no_export(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"policy": {"kind": "tiny"}}))
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="'tiny' test model, which has no Hugging Face export"):
        export_from_checkpoint(tmp_path)


async def test_the_trainer_exports_each_checkpoint_and_the_export_serves_as_a_policy(tmp_path):
    """Two training steps of an HFPolicy on the toy env: two exports whose weights are the trained ones."""
    from toolgym.agents.policies.hf import HFPolicy
    from toolgym.training.config import load_config
    from toolgym.training.trainer import Trainer

    base = tmp_path / "base"
    tokenizer = tiny_tokenizer()
    tiny_model(len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    config = load_config(
        None,
        [
            "env.id=toy_env:toolgym-test/Letters-v0",
            f"policy.model={base}",
            "sampling.max_tokens=6",
            "train.steps=3",
            "train.tasks_per_step=1",
            "train.group_size=2",
            "train.optim.lr=0.05",
            "train.rollouts.max_off_policy_steps=0",
            "train.skip_zero_variance=false",
        ],
    )
    policy = HFPolicy(base, seed=0)
    trainer = Trainer(config, tmp_path / "run", policy=policy)
    try:
        await trainer.run()
    finally:
        trainer.close()
    assert list(list_exports(tmp_path / "run")) == [2, 3]
    path = resolve_run_export(tmp_path / "run")
    manifest = read_manifest(path)
    assert manifest["step"] == 3 and manifest["policy_version"] == 3
    assert manifest["base_model"]["name"] == str(base)
    exported = HFPolicy(f"run:{tmp_path / 'run'}")  # the spec form, as train's policy.model takes it
    try:
        for name, tensor in policy.model.state_dict().items():
            assert torch.equal(exported.model.state_dict()[name], tensor), name
        base_model = transformers.AutoModelForCausalLM.from_pretrained(base)
        assert not torch.equal(base_model.model.embed_tokens.weight, policy.model.model.embed_tokens.weight)
    finally:
        exported.close()


@pytest.mark.model
def test_smollm2_checkpoint_to_export_to_eval_and_compare(tmp_path, capsys):
    """The real model: checkpoint -> `toolgym export` -> `toolgym eval --policy run:DIR` -> compare.

    The checkpoint holds SmolLM2's own weights, so the exported policy must sample exactly the tokens
    the embedded model samples (greedy): the export loses nothing.
    """
    from safetensors.torch import load_file

    from toolgym.agents.policies.models import smollm2_path
    from toolgym.cli import main
    from toolgym.training.checkpoint import save_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    weights = load_file(smollm2_path() / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied, as in model.state_dict()
    save_checkpoint(run, {"model": weights, "step": 4, "policy_version": 4})
    del weights
    (run / "config.json").write_text(json.dumps({"policy": {"kind": "hf", "model": ""}}))
    start = time.perf_counter()
    assert main(["export", str(run)]) == 0
    print(f"export from checkpoint: {time.perf_counter() - start:.1f} s")
    export = resolve_run_export(run)
    manifest = read_manifest(export)
    assert manifest["step"] == 4 and manifest["base_model"]["name"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    common = ["--env", "toolgym/SearchQA-v0", "--n", "1", "--harness", "bare", "--seed", "1"]
    common += ["--env-arg", "max_turns=1", "--max-tokens", "12"]
    assert main(["eval", *common, "--policy", f"run:{run}", "--out", str(tmp_path / "b")]) == 0
    record = json.loads((tmp_path / "b" / "eval.json").read_text())
    assert record["status"] == "complete" and record["settings"]["policy_info"]["export"]["step"] == 4
    out = "\n".join(capsys.readouterr().out.splitlines())
    assert "toolgym compare RUN_A" in out
    assert main(["eval", *common, "--policy", "smollm2", "--out", str(tmp_path / "a")]) == 0
    trained = [json.loads(x) for x in (tmp_path / "b" / "trajectories-bare.jsonl").read_text().splitlines()]
    base = [json.loads(x) for x in (tmp_path / "a" / "trajectories-bare.jsonl").read_text().splitlines()]
    key = lambda t: t["task_id"]  # noqa: E731
    assert [t["token_ids"] for t in sorted(trained, key=key)] == [
        t["token_ids"] for t in sorted(base, key=key)
    ]
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "paired reward difference B - A on bare: +0.000" in out
    assert f'note: the runs differ in policy ("smollm2" vs "run:{run}")' in out
