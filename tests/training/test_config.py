"""Config loading: TOML, dotted overrides, "did you mean" on wrong keys."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from toolgym.errors import ConfigError
from toolgym.training.config import load_config, to_dict


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_toml_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, '[train]\nsteps = 5\n[curriculum]\nstages = [["answer"], ["answer", "search"]]\n')
    cfg = load_config(
        path,
        ["train.group_size=8", "sampling.temperature=0.7", "env.harness=scaffold", "env.kwargs.max_turns=3"],
    )
    assert cfg.train.steps == 5 and cfg.train.group_size == 8
    assert cfg.sampling.temperature == 0.7 and cfg.env.harness == "scaffold"
    assert cfg.env.kwargs == {"max_turns": 3}
    assert cfg.curriculum.stages == (("answer",), ("answer", "search"))
    assert to_dict(cfg)["curriculum"]["stages"] == [["answer"], ["answer", "search"]]


def test_wrong_key_says_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"(?i)train\.stpes.*did you mean.*steps"):
        load_config(None, ["train.stpes=3"])
    with pytest.raises(ConfigError, match="(?i)did you mean.*sampling"):
        load_config(write(tmp_path, "[sampleing]\ntemperature = 1.0\n"))


def test_wrong_types_and_invariants() -> None:
    with pytest.raises(ConfigError, match="integer"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        load_config(None, ["train.group_size=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="temperature"):
        load_config(None, ["sampling.temperature=0"])


def test_shipped_demo_config_loads() -> None:
    demo = resources.files("toolgym.training") / "configs" / "demo.toml"
    cfg = load_config(Path(str(demo)))
    assert cfg.env.id == "toolgym/SearchQA-v0"
    assert len(cfg.curriculum.stages) >= 2


def test_shipped_config_by_name_and_did_you_mean():
    from toolgym.training.config import load_config

    assert load_config("demo").env.id == "toolgym/SearchQA-v0"
    with pytest.raises(ConfigError, match="Did you mean 'demo'"):
        load_config("dmeo")


def test_train_sub_tables_have_the_code_s_shape(tmp_path: Path) -> None:
    text = (
        "[train]\nsteps = 2\n[train.optim]\nlr = 3e-6\nschedule = 'cosine'\n[train.loss]\nagg = 'seq_mean'\n"
    )
    cfg = load_config(write(tmp_path, text), ["train.learners.count=1", "train.batching.micro_batch=2"])
    assert cfg.train.optim.lr == 3e-6 and cfg.train.optim.schedule == "cosine"
    assert cfg.train.loss.agg == "seq_mean" and cfg.train.batching.micro_batch == 2
    assert to_dict(cfg)["train"]["optim"]["lr"] == 3e-6
    with pytest.raises(
        ConfigError,
        match=r"train\.optim\.schedule must be one of constant, linear, cosine, got 'cosin'\. Did you mean 'cosine'",
    ):
        load_config(None, ["train.optim.schedule=cosin"])


def test_old_flat_keys_load_with_a_warning_naming_the_new_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[train]\nlr = 2e-6\nlearners = 1\nmicro_batch = 3\n[policy]\nkind = 'tiny'\ntiny_hidden = 16\n",
    )
    with pytest.warns(FutureWarning) as caught:
        cfg = load_config(path, ["train.lora_rank=0"])
    said = " ".join(str(w.message) for w in caught)
    for old, new in (
        ("train.lr", "train.optim.lr"),
        ("train.learners", "train.learners.count"),
        ("train.micro_batch", "train.batching.micro_batch"),
        ("policy.tiny_hidden", "policy.hidden"),
        ("train.lora_rank", "train.lora.rank"),
    ):
        assert f"config key {old} is now {new}" in said
    assert cfg.train.optim.lr == 2e-6 and cfg.train.batching.micro_batch == 3 and cfg.policy.hidden == 16
    twice = write(tmp_path, "[train]\nlr = 1e-6\n[train.optim]\nlr = 2e-6\n")
    with pytest.raises(
        ConfigError, match=r"train\.lr and train\.optim\.lr are the same setting, given twice"
    ):
        load_config(twice)
    with pytest.warns(FutureWarning):  # an override replaces the file's value, whatever its name
        cfg = load_config(write(tmp_path, "[train.optim]\nlr = 2e-6\n"), ["train.lr=1e-6"])
    assert cfg.train.optim.lr == 1e-6


def test_the_policy_table_is_the_table_of_its_kind() -> None:
    from toolgym.training.config import HFPolicyConfig, TinyPolicyConfig, VLLMServerPolicyConfig

    assert isinstance(load_config(None).policy, HFPolicyConfig)
    assert isinstance(load_config(None, ["policy.kind=tiny", "policy.layers=3"]).policy, TinyPolicyConfig)
    served = load_config(None, ["policy.kind=vllm-server", "policy.url=http://127.0.0.1:9"]).policy
    assert isinstance(served, VLLMServerPolicyConfig) and served.max_model_len == 2048
    with pytest.raises(
        ConfigError,
        match=r"policy\.kv_cache_gib is a setting of policy\.kind = 'vllm' or 'vllm-server', not 'hf'",
    ):
        load_config(None, ["policy.kv_cache_gib=2"])
    with pytest.raises(
        ConfigError,
        match=r"policy\.kind must be one of hf, vllm, vllm-server, tiny, got 'vlm'\. Did you mean 'vllm'",
    ):
        load_config(None, ["policy.kind=vlm"])
    with pytest.raises(ConfigError, match=r"unknown config key 'policy\.hiden'.*Did you mean 'hidden'"):
        load_config(None, ["policy.kind=tiny", "policy.hiden=3"])


def test_an_override_of_the_kind_leaves_out_the_file_s_settings_of_another_kind(
    tmp_path: Path, caplog
) -> None:
    from toolgym.training.config import TinyPolicyConfig

    path = write(tmp_path, '[policy]\nkind = "vllm"\nmax_model_len = 4096\nthreads = 2\n')
    with caplog.at_level("INFO"):
        cfg = load_config(path, ["policy.kind=tiny", "policy.hidden=32"])
    assert isinstance(cfg.policy, TinyPolicyConfig) and cfg.policy.hidden == 32 and cfg.policy.threads == 2
    assert "max_model_len of the earlier kind are not used" in caplog.text
    # a setting of another kind given on the command line is still refused by name
    with pytest.raises(ConfigError, match=r"policy\.max_model_len is a setting of .* not 'tiny'"):
        load_config(path, ["policy.kind=tiny", "policy.max_model_len=512"])
    # the later of two kinds wins, with what was given after it
    cfg = load_config(None, ["policy.kind=tiny", "policy.hidden=32", "policy.kind=hf", "policy.max_batch=4"])
    assert cfg.policy.kind == "hf" and cfg.policy.max_batch == 4
    assert cfg.policy.batching == "continuous" and cfg.policy.attn_implementation == ""
    cfg = load_config(None, ["policy.kind=hf", "policy.batching=static", "policy.attn_implementation=sdpa"])
    assert (cfg.policy.batching, cfg.policy.attn_implementation) == ("static", "sdpa")
    with pytest.raises(
        ConfigError, match=r"policy\.batching must be one of continuous, static, got 'dynamic'"
    ):
        load_config(None, ["policy.kind=hf", "policy.batching=dynamic"])
    assert (
        load_config(None, ["policy.kind=hf", "policy.max_batch_tokens=4096"]).policy.max_batch_tokens == 4096
    )
    with pytest.raises(ConfigError, match=r"policy\.max_batch_tokens bounds continuous batching"):
        load_config(None, ["policy.kind=hf", "policy.batching=static", "policy.max_batch_tokens=4096"])
    with pytest.raises(ConfigError, match=r"policy\.max_batch_tokens must be >= 0"):
        load_config(None, ["policy.kind=hf", "policy.max_batch_tokens=-1"])
    # without an override of the kind, the file's table is checked whole
    bad = write(tmp_path, '[policy]\nkind = "tiny"\nmax_model_len = 4096\n')
    with pytest.raises(ConfigError, match=r"policy\.max_model_len is a setting of .* not 'tiny'"):
        load_config(bad)


def test_a_stored_flat_config_record_reads_as_today_s_silently(recwarn) -> None:
    from toolgym.training.config import renamed_keys

    old = {"train": {"lr": 1e-5, "learners": 2, "steps": 3}, "policy": {"kind": "tiny", "tiny_layers": 1}}
    assert renamed_keys(old) == {
        "train": {"steps": 3, "optim": {"lr": 1e-5}, "learners": {"count": 2}},
        "policy": {"kind": "tiny", "layers": 1},
    }
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_a_micro_batch_token_budget_smaller_than_one_sequence_is_refused(tmp_path: Path) -> None:
    config = write(tmp_path, "[env]\nmax_total_tokens = 1024\n")
    with pytest.raises(ConfigError, match=r"micro_batch_tokens \(512\) is smaller than one sequence.*1024"):
        load_config(config, ["train.batching.micro_batch_tokens=512"])
    assert (
        load_config(config, ["train.batching.micro_batch_tokens=4096"]).train.batching.micro_batch_tokens
        == 4096
    )
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(config, ["train.batching.micro_batch_tokens=-1"])
