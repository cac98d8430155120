"""Fixtures shared by tests in several folders."""

from __future__ import annotations

from collections.abc import Callable

import pytest


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
