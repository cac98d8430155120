"""Config help: every field has its line, nothing describes a field that does not exist, the schema holds."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass

import jsonschema
import pytest

from toolgym.cli import main
from toolgym.training.config import RunConfig, resolve_config_path
from toolgym.training.config.help import attribute_docs, config_fields, config_schema, config_sections
from toolgym.training.config.policy import POLICY_KINDS


def test_every_field_of_every_section_has_help_and_no_help_is_stale() -> None:
    fields = config_fields()
    assert {f.section for f in fields} == {
        "env",
        "policy",
        "sampling",
        "train",
        "train.loss",
        "train.optim",
        "train.lora",
        "train.batching",
        "train.rollouts",
        "train.learners",
        "curriculum",
        "warm_start",
        "heldout",
        "mixture",
    }
    undocumented = [f.key for f in fields if not f.help]
    assert not undocumented, f"add an Attributes: entry for {undocumented}"
    tables = [*config_sections(RunConfig), *(("policy", c) for c in POLICY_KINDS.values())]
    for section, cls in tables:
        stale = set(attribute_docs(cls)) - {f.name for f in dataclasses.fields(cls)}
        assert not stale, f"[{section}] documents fields that do not exist: {sorted(stale)}"
    policy = {f.name: f for f in fields if f.section == "policy"}
    assert policy["kv_cache_gib"].help.startswith("(kind = vllm or vllm-server)")
    assert policy["hidden"].help.startswith("(kind = tiny)") and not policy["model"].help.startswith("(")


@dataclass
class Example:
    """A section.

    Attributes:
        lr, betas: AdamW settings. Second sentence
            continues here.
        steps: how many (e.g. 3).

    Raises:
        nothing: not an attribute.
    """

    lr: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    steps: int = 1


@dataclass
class Outer:
    """Top."""

    example: Example = dataclasses.field(default_factory=Example)


def test_attribute_entries_may_name_several_fields_and_continue_over_lines() -> None:
    docs = attribute_docs(Example)
    assert docs == {
        "lr": "AdamW settings. Second sentence continues here.",
        "betas": "AdamW settings. Second sentence continues here.",
        "steps": "how many (e.g. 3).",
    }

    rows = {f.key: f for f in config_fields(Outer)}
    assert rows["example.lr"].help == "AdamW settings."  # the first sentence only
    assert rows["example.steps"].help == "how many (e.g. 3)."
    assert rows["example.betas"].kind == "array" and rows["example.steps"].default == 1


def test_help_config_prints_each_field_with_type_and_default(capsys) -> None:
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "[train]" in out and "  steps = 20   (integer)" in out and "optimizer steps to run." in out
    assert '  harnesses = ["bare", "scaffold"]   (array)' in out


def test_the_schema_accepts_the_shipped_configs_and_refuses_unknown_or_mistyped_keys(capsys) -> None:
    assert main(["train", "--help-config", "json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == json.loads(json.dumps(config_schema()))
    jsonschema.Draft202012Validator.check_schema(schema)
    for name in ("demo", "gpu", "learn"):
        data = tomllib.loads(resolve_config_path(name).read_text(encoding="utf-8"))
        jsonschema.validate(data, schema)
    with pytest.raises(jsonschema.ValidationError, match="stepz"):
        jsonschema.validate({"train": {"stepz": 3}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="'three' is not of type 'integer'"):
        jsonschema.validate({"train": {"steps": "three"}}, schema)
    assert schema["properties"]["train"]["properties"]["steps"]["description"] == "optimizer steps to run."
    assert schema["properties"]["train"]["properties"]["optim"]["properties"]["lr"]["type"] == "number"
    with pytest.raises(jsonschema.ValidationError, match="'sgd' is not one of|lrr"):
        jsonschema.validate({"train": {"optim": {"lrr": 1.0}}}, schema)
