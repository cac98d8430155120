"""Fixtures shared by tests in several folders, and the ``slow`` marker's rules.

``python -m pytest -q`` runs on two xdist workers (``-n 2 --dist loadgroup`` in pyproject.toml; ``-n 0``
for one process); ``python -m pytest -q -m "not slow"`` is the contributor's loop: every module's unit
tests, in minutes.
A test is ``slow`` when it is marked so, or when it needs a heavy part: a marker of
:data:`HEAVY_MARKERS` implies ``slow``. ``tests/test_layout.py`` keeps every test that reaches Docker
marked ``docker`` (its worker lane depends on it); at the end of a run, tests that took longer than
:data:`SLOW_S` without the ``slow`` marker are listed (mark them, or make them cheaper).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

#: markers that say a test needs a heavy part; each implies ``slow``
HEAVY_MARKERS = ("docker", "model", "pyserini", "gpu", "faults", "stops_docker")
#: seconds (setup and call) past which an unmarked test is listed at the end of the run
SLOW_S = 3.0
_UNMARKED: dict[str, float] = {}


#: test files whose tests start Ray instances: one worker runs them all, one after another (Ray's test
#: ``Cluster`` is joined by any ``ray.init`` without an address on the machine while it lives, and
#: two instances at once cost memory the other lane needs)
RAY_FILES = (
    "tests/training/distributed/test_learners.py",
    "tests/training/distributed/test_learner_placement.py",
    "tests/training/experiments/test_arms.py",
    "tests/training/sampling/test_ray_backend.py",
)


def _lane(item: pytest.Item) -> str:
    """The xdist group of a test: a worker runs a group's tests in order, one group at a time.

    Every Docker test shares one lane (the engine-restart test, last in it, must not pull Docker from
    under another test), Ray's tests another; every other test runs with its module, so a module's
    fixtures (an engine, a sandbox, an index) are made once.
    """
    if item.get_closest_marker("docker") or item.get_closest_marker("stops_docker"):
        return "docker"
    path = item.nodeid.split("::", 1)[0]
    return "ray" if path in RAY_FILES else path


#: the longest lanes (measured: bench/README.md, "The test suite"), handed out first so that no worker
#: starts a long lane when the other is nearly done; every other lane follows in collection order
LONG_LANES = (
    "ray",
    "tests/test_scripts.py",
    "tests/training/heldout/test_heldout.py",
    "docker",
    "tests/training/test_vllm_training.py",
    "tests/agents/policies/test_vllm_server.py",
    "tests/agents/policies/test_hf_policy.py",
    "tests/training/test_learning.py",
    "tests/training/test_resume.py",
    "tests/agents/policies/test_vllm_policy.py",
    "tests/agents/policies/test_http_policy.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not item.get_closest_marker("slow") and any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
            item.add_marker(pytest.mark.slow)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_lane(item)))
        first = {lane: i for i, lane in enumerate(LONG_LANES)}
        items.sort(key=lambda item: first.get(_lane(item), len(first)))  # stable: a lane keeps its order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when in ("setup", "call") and "slow" not in report.keywords:
        nodeid = report.nodeid.split("@", 1)[0]  # without xdist's group suffix
        _UNMARKED[nodeid] = _UNMARKED.get(nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    over = sorted(((s, n) for n, s in _UNMARKED.items() if s > SLOW_S), reverse=True)
    if over:
        terminalreporter.section(f"tests over {SLOW_S:g} s without the slow marker")
        for seconds, nodeid in over:
            terminalreporter.line(f"{seconds:7.1f}s {nodeid}")


def _running_children() -> set[int]:
    """Running child processes, minus multiprocessing's resource tracker (it lives as long as we do)."""
    import psutil

    alive = set()
    for p in psutil.Process().children(recursive=True):
        try:  # a zombie is an exited process the OS keeps until its parent reaps it: not running
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                alive.add(p.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return alive


@pytest.fixture(scope="session")
def running_children() -> Callable[[], set[int]]:
    """Call it for the pids of this process's running children (engine processes, workers)."""
    return _running_children


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> str:
    """A real, randomly initialised 2-layer BERT sentence encoder (32 wide, a 32-token window) with the
    shipped all-MiniLM-L6-v2's tokenizer: the dense machinery at test speed. Its vectors mean nothing;
    tests of retrieval quality use the shipped encoder."""
    import json
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from toolgym.tools.search.encoder import default_encoder_path

    out = tmp_path_factory.mktemp("tiny-encoder")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(out)
    source = default_encoder_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / name, out / name)
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    return str(out)
