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
