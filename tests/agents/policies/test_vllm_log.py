"""The engine's log configuration as pure logic: which messages are demoted, where each line goes.

The engine itself (its start-up and a weight reload writing to a run's ``engine.log``, the console
quiet, the log-probabilities still the learner's) is tested in ``test_vllm_policy.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from toolgym.agents.policies.vllm_log import (
    NOTICES,
    RELOAD_LOGGER,
    EngineLogFile,
    Notices,
    demoted_on,
    engine_log_config,
    python_warnings,
    reload_notices,
    user_configures_logging,
)
from toolgym.errors import ConfigError


def record(message: str, level: int = logging.WARNING, name: str = "vllm.x") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_a_known_notice_is_demoted_with_its_reason_and_anything_else_is_left_alone() -> None:
    notices = Notices()
    known = record("Enforce eager set, disabling torch.compile, CUDAGraphs")
    assert notices.filter(known) and known.levelno == logging.INFO and known.levelname == "INFO"
    assert "[not a problem: eager mode is toolgym's CPU default" in known.getMessage()
    unknown = record("KV cache is too small for max_model_len")
    assert notices.filter(unknown) and unknown.levelno == logging.WARNING
    assert unknown.getMessage() == "KV cache is too small for max_model_len"
    error = record("Enforce eager set", level=logging.ERROR)  # an error is never demoted
    assert notices.filter(error) and error.levelno == logging.ERROR
    assert notices.demoted == 1


def test_every_notice_names_a_reason() -> None:
    assert all(n.starts and len(n.reason) > 20 for n in NOTICES)
    assert len({n.starts for n in NOTICES}) == len(NOTICES)


def test_only_layers_without_checkpoint_weights_have_their_reload_warning_demoted() -> None:
    reload_log = logging.getLogger(RELOAD_LOGGER)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            seen.append(rec)

    handler = Keep(level=logging.DEBUG)
    reload_log.addHandler(handler)
    reload_log.setLevel(logging.DEBUG)
    try:
        with demoted_on(RELOAD_LOGGER, reload_notices(tied_head=True)) as tied:
            for layer in ("RotaryEmbedding", "ParallelLMHead", "LlamaDecoderLayer"):
                reload_log.warning("%s: Failed to load weights", layer)
        with demoted_on(RELOAD_LOGGER, reload_notices(tied_head=False)) as untied:
            reload_log.warning("%s: Failed to load weights", "ParallelLMHead")
        reload_log.warning("%s: Failed to load weights", "RotaryEmbedding")  # outside a reload
    finally:
        reload_log.removeHandler(handler)
        reload_log.setLevel(logging.NOTSET)
    levels = [(r.getMessage().split(":")[0], r.levelname) for r in seen]
    assert levels == [
        ("RotaryEmbedding", "INFO"),
        ("ParallelLMHead", "INFO"),
        ("LlamaDecoderLayer", "WARNING"),  # a layer that kept its old weights: a real failure
        ("ParallelLMHead", "WARNING"),  # an untied head that did not load: a real failure
        ("RotaryEmbedding", "WARNING"),
    ]
    assert (tied.demoted, untied.demoted) == (2, 0)
    assert not logging.getLogger(RELOAD_LOGGER).filters  # the filter leaves with the reload


def test_the_console_gets_warnings_and_the_file_gets_everything(tmp_path) -> None:
    """Applied as the engine processes apply it (a fresh interpreter, ``dictConfig``)."""
    log_file = tmp_path / "engine.log"
    config = tmp_path / "logging.json"
    config.write_text(json.dumps(engine_log_config(log_file, "WARNING", "ext://sys.stdout")))
    script = (
        "import json, logging, logging.config, sys\n"
        "logging.config.dictConfig(json.load(open(sys.argv[1])))\n"
        "log = logging.getLogger('vllm.engine.core')\n"
        "log.info('Initializing a V1 LLM engine')\n"
        "log.warning('Model Runner V2 requires Triton; using the V1 model runner instead.')\n"
        "log.warning('KV cache is too small')\n"
        "log.error('EngineCore failed')\n"
        "logging.getLogger('toolgym.x').warning('not the engine')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(config)], capture_output=True, text=True, timeout=60, check=True
    )
    console = run.stdout.splitlines()
    assert [line.split("] ", 1)[1] for line in console] == ["KV cache is too small", "EngineCore failed"]
    assert "WARNING" in console[0] and "ERROR" in console[1]
    assert "not the engine" in run.stderr  # other loggers keep their own handlers
    written = log_file.read_text().splitlines()
    assert [line.split("] ", 1)[1].split(" [not a problem")[0] for line in written] == [
        "Initializing a V1 LLM engine",
        "Model Runner V2 requires Triton; using the V1 model runner instead.",
        "KV cache is too small",
        "EngineCore failed",
    ]
    assert " INFO " in written[1] and "[not a problem: vLLM's CPU build" in written[1]


def test_the_log_file_is_never_written_through_a_link(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "engine.log").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        EngineLogFile(str(tmp_path / "engine.log"))
    assert target.read_text() == ""


def test_the_users_warning_filters_and_logging_setup_are_kept(monkeypatch) -> None:
    ours = "ignore::FutureWarning:vllm.triton_utils.dispatcher"
    assert python_warnings(None) == ours
    assert python_warnings("error::DeprecationWarning") == f"error::DeprecationWarning,{ours}"
    for name in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.delenv(name, raising=False)
    assert not user_configures_logging({"max_num_seqs": 4})
    assert user_configures_logging({"log_config_file": "mine.json"})
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert user_configures_logging({})
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", os.devnull)
    assert user_configures_logging({})
