"""Every ``bench/`` script and every ``python -m`` entry point runs end to end on a tiny budget.

Scripts nobody imports rot silently; these runs keep them working. Each uses the script's own budget
flags (few episodes, one round, seconds of load) and checks the line that carries its result, not the
numbers (a benchmark's figures on a tiny budget mean nothing). Heavy ones carry the markers of what
they need: ``docker`` (the engine and the sandbox image), ``pyserini`` (Lucene), ``slow``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY_ENV_DIR = ROOT / "tests" / "training"  # holds toy_env.py (toolgym-test/Letters-v0)


def run(*argv: str | Path, cwd: Path = ROOT, extra_path: Path | None = None) -> str:
    """Run ``python ARGV`` and return its stdout; a non-zero exit fails with the script's stderr."""
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, *map(str, argv)], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def need_docker() -> None:
    """Skip only when TOOLGYM_SKIP_DOCKER=1 asks for it (CI never sets it)."""
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1")


def _has_main_guard(path: Path) -> bool:
    """Whether the module has a top-level ``if __name__ == "__main__":`` (a ``python -m`` entry point)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
        ):
            return True
    return False


def test_every_script_and_entry_point_has_a_smoke_run():
    """A new bench script or ``__main__`` module must get a smoke run here."""
    covered = {
        "bench/arxiv_scale.py",
        "bench/chosen_logprobs.py",
        "bench/demo_learning.py",
        "bench/eval.py",
        "bench/learner.py",
        "bench/learner_memory.py",
        "bench/memory.py",
        "bench/async_rollouts.py",
        "bench/sandbox.py",
        "bench/sandbox_load.py",
        "bench/retrieval.py",
        "bench/search.py",
        "bench/search_scale.py",
        "bench/search_split.py",
        "bench/serve.py",
        "bench/train_rollouts.py",
        "bench/weight_sync.py",
        "bench/gpu.py",
        "bench/gpu_smoke.sh",
        "bench/gpu_pack.sh",
        "src/toolgym/cli/__main__.py",
        "src/toolgym/__main__.py",  # tests/training/distributed/test_learners.py: python -m toolgym train (and torchrun)
        "training/distributed/worker.py",  # the learner processes those tests start
        "envs/code_exec/__main__.py",
        "envs/search_qa/hard.py",
        "tools/sandbox/image.py",
    }
    # programs that run inside sandbox containers are not entry points of the host package
    in_container = ("envs/code_exec/programs/", "tools/sandbox/programs/")
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "bench").glob("*") if p.suffix in (".py", ".sh")}
    for folder in ("src/toolgym", "envs", "tools", "agents", "training"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if not rel.startswith(in_container) and _has_main_guard(path):
                found.add(rel)
    missing = sorted(found - covered)
    assert not missing, f"add a smoke run to tests/test_scripts.py for: {missing}"


def test_cli_module_lists_the_environments():
    out = run("-m", "toolgym.cli", "envs")
    assert "toolgym/SearchQA-v0" in out and "toolgym/CodeExec-v0" in out


@pytest.mark.model
@pytest.mark.slow
def test_gpu_smoke_runs_its_transformers_path_on_cpu_from_a_packed_model_shape(tmp_path: Path):
    """The GPU recipe's dry run: gpu_pack.sh writes the embedded model's shape (no weights; the wheels
    need a package index, so not here), gpu_smoke.sh builds a random model of it and runs the demo's
    transformers path (warm start, GRPO, held-out) on CPU, shrunk (2 decoder layers, few tokens), and
    prints its figures."""
    env = dict(
        os.environ,
        TOOLGYM_SMOKE_PACK=str(tmp_path / "pack"),
        TOOLGYM_PACK_WHEELS="0",
        TOOLGYM_SMOKE_DEVICE="cpu",
        TOOLGYM_SMOKE_ENGINE="hf",
        PYTHON=sys.executable,
        TMPDIR=str(tmp_path),
    )
    pack = subprocess.run(["bash", "bench/gpu_pack.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert pack.returncode == 0, pack.stderr[-3000:]
    shape = tmp_path / "pack" / "model-shape"
    assert (shape / "config.json").is_file() and (shape / "tokenizer.json").is_file()
    assert not list(shape.glob("*.safetensors")), "the shape travels without the weights"
    config = json.loads((shape / "config.json").read_text())
    assert config["num_hidden_layers"] == 30, config  # SmolLM2-135M's 30 decoder layers
    # the packed shape cut to 2 of its 30 decoder layers: the recipe runs the same code on the same
    # architecture, at a fraction of the CPU time (a random model's tokens mean nothing either way)
    (shape / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    out_dir = tmp_path / "run"
    shrink = [
        "warm_start.tasks=2",
        "warm_start.epochs=1",
        "train.steps=1",
        "train.group_size=2",
        "heldout.n=1",
        "heldout.max_tokens=16",
        'heldout.harnesses=["bare"]',
    ]  # every phase runs, on few tokens (a random model never stops before its token limit; the
    # rollouts keep the demo's turn length, which the reference rule's demonstrations need)
    smoke = subprocess.run(
        ["bash", "bench/gpu_smoke.sh", str(out_dir), *shrink],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert smoke.returncode == 0, smoke.stdout[-2000:] + smoke.stderr[-3000:]
    trained = re.search(r"learner: (\d+) trained tokens", smoke.stdout)
    assert trained and int(trained.group(1)) > 0, smoke.stdout[-2000:]  # its groups train without reward
    assert "weight sync per step (s):" in smoke.stdout and "gpu_smoke: done in" in smoke.stdout
    config = json.loads((out_dir / "config.json").read_text())
    assert config["policy"]["model"] == str(tmp_path / "toolgym-smoke-model")
    assert config["policy"]["kind"] == "hf" and config["policy"]["learner_device"] == "cpu"


def test_the_gpu_scripts_parse():
    for script in ("gpu_smoke.sh", "gpu_pack.sh"):
        out = subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_bench_rollout():
    out = run(
        "bench/async_rollouts.py", "--episodes", "2", "--concurrency", "2", "--latency", "0.01", "--rounds", "1",
        "--hidden", "16",
    )  # fmt: skip
    assert "speed-up (sync / async):" in out


@pytest.mark.slow
def test_training_module_and_bench_demo_learning(tmp_path):
    run_dir = tmp_path / "run"
    run(
        "-m", "toolgym.cli", "train", "--out", run_dir,
        "env.id=toy_env:toolgym-test/Letters-v0", "policy.kind=tiny", "policy.hidden=16",
        "sampling.max_tokens=8", "train.steps=2", "train.tasks_per_step=1", "train.group_size=2",
        "train.rollouts.max_off_policy_steps=0",
        extra_path=TOY_ENV_DIR,
    )  # fmt: skip
    out = run("bench/demo_learning.py", run_dir, "--resamples", "100")
    assert "first fifth (steps 1-1" in out and "last fifth (steps 2-2" in out


@pytest.mark.slow
@pytest.mark.model
def test_bench_eval():
    # one policy (the default HFPolicy): each costs a model load and its episodes; an in-process vLLM
    # engine would take minutes to start
    out = run(
        "bench/eval.py", "--n", "1", "--policies", "hf-after", "--max-tokens", "8", "--max-turns", "1",
        "--concurrency", "1",
    )  # fmt: skip
    assert "| hf-after |" in out and "prefix cache:" in out


@pytest.mark.model
def test_bench_gpu_smoke_on_cpu(tmp_path):
    # --smoke: the 135M shape, 4 episodes of 2 turns, the samplers side by side
    out = run("bench/gpu.py", "--device", "cpu", "--smoke", "--out", tmp_path / "rows.json")
    assert "| 135m | 4 | continuous |" in out and "| 135m | 4 | generate |" in out
    rows = {r["sampler"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert rows.keys() == {"generate", "static", "continuous-sdpa", "continuous"}
    # every sampler did the same work: each turn's own tokens, however the batch ran
    assert len({r["tokens"] for r in rows.values()}) == 1
    assert rows["continuous"]["alone_differs"] == "0/2 requests"  # on CPU: the same tokens alone


@pytest.mark.slow
def test_bench_learner(tmp_path):
    # --smoke: the demo's environment and learner step on a group of 2, with the tiny byte-level model
    out = run(
        "bench/learner.py", "--smoke", "--rounds", "1", "--trajectories", tmp_path / "group.jsonl",
        "--modes", "full-unshared,full-group,full-step,lora-step,full-step-2,full-step-tokens,full-step-checkpoint",
    )  # fmt: skip
    assert "| lora-step |" in out and "x the speed of full-unshared" in out
    rows = {r.split("|")[1].strip(): r.split("|") for r in out.splitlines() if r.startswith("| full-")}
    # micro-batches by a token budget, checkpointed layers: the same loss and gradient norm (float rounding)
    for mode in ("full-step-tokens", "full-step-checkpoint"):
        for column in (-3, -2):
            assert float(rows[mode][column]) == pytest.approx(float(rows["full-step"][column]), abs=1e-5)
    assert "| full-step-2 |" in out and "weights to the learners" in out


def test_bench_memory_sums_a_commands_process_tree(tmp_path):
    # a parent holding ~300 MB starts a child holding ~200 MB: the peak is their sum, each named
    child = "x = bytearray(200_000_000); import time; time.sleep(1.5)"
    timeline = tmp_path / "timeline.tsv"
    parent = (
        "import subprocess, sys, time; x = bytearray(300_000_000); "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); p.wait(); sys.exit(3)"
    )
    out = subprocess.run(
        [sys.executable, "bench/memory.py", "--interval", "0.05", "--timeline", timeline, "--", sys.executable, "-c", parent],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 3, out.stderr  # the command's own exit status
    peak = re.search(r"memory: peak ([\d.]+) GB summed over 2 process\(es\)", out.stdout)
    assert peak and 0.5 <= float(peak.group(1)) < 0.8, out.stdout
    lines = [line.split("\t") for line in timeline.read_text().splitlines()]
    assert lines and max(float(line[1]) for line in lines) <= float(peak.group(1))


@pytest.mark.slow
def test_bench_learner_memory():
    # --smoke: the tiny model, one pass of 2 x 128 tokens: the estimate and the measured rise side by side
    out = run("bench/learner_memory.py", "--smoke")
    row = next(r.split("|") for r in out.splitlines() if r.startswith("| demo |"))
    assert row[2].strip() == "256" and float(row[6].replace(",", "")) > 0  # tokens a pass, estimate
    assert "x)" in row[7]


@pytest.mark.slow
@pytest.mark.model
def test_bench_chosen_logprobs():
    # the embedded model, two short sequences: both paths run in processes of their own and agree
    out = run("bench/chosen_logprobs.py", "--rows", "2", "--length", "48")
    table = [r.split("|") for r in out.splitlines() if r.startswith(("| chunked", "| softmax"))]
    rows = {r[1].strip(): r for r in table}
    assert set(rows) == {"chunked", "softmax"} and "x the softmax path's peak RSS" in out
    for column in (-4, -3, -2):  # logprob sum, mean entropy, gradient norm
        assert float(rows["chunked"][column]) == pytest.approx(float(rows["softmax"][column]), rel=1e-5)


@pytest.mark.slow
@pytest.mark.model
def test_bench_weight_sync():
    # --smoke: a 2-layer random model through the in-process engine and the server, two pushes each
    out = run("bench/weight_sync.py", "--smoke", "--rounds", "2")
    assert "| random-smoke |" in out and "x the in-process engine's" in out


@pytest.mark.slow
def test_bench_train_rollouts():
    # --smoke: the trainer's own rollouts and step, one step of the tiny policy on the learn config's env
    out = run("bench/train_rollouts.py", "--smoke")
    assert "| tiny |" in out and "rollout episodes/min" in out


@pytest.mark.slow
@pytest.mark.pyserini
def test_bench_search():
    out = run("bench/search.py", "--smoke", "--rounds", "1", "--threads", "1")
    assert "MRR@10" in out and "throughput ratio default / pyserini:" in out


@pytest.mark.slow
def test_bench_arxiv_scale():
    out = run("bench/arxiv_scale.py", "--sizes", "200,400", "--compare-max", "400")
    assert "same bans: True" in out and "growth exponents (200 -> 400 records):" in out


@pytest.mark.slow
def test_bench_search_scale():
    out = run(
        "bench/search_scale.py", "--sizes", "300,900", "--queries", "20", "--rounds", "1", "--turns", "2"
    )
    # The two backends return the same hits (ids, order, shown scores) for every query.
    assert out.count("identical top-10 hit lists: 20/20 of the quality subset, 20/20 of all queries") == 2, (
        out
    )
    assert "growth exponents (300 -> 900 passages):" in out


def test_bench_search_split():
    out = run("bench/search_split.py", "--n", "5")
    assert "| hard | test | copy | 5 |" in out and "| hard | test | reformulate | 5 | 1.000 |" in out, out
    assert "search_split: 60 episodes in" in out and "| hard | test | scripted | 5 |" in out


@pytest.mark.slow
def test_search_qa_hard_module_rebuilds_the_question_set(tmp_path):
    out = run("-m", "toolgym.envs.search_qa.hard", "--out", tmp_path / "hard.jsonl")
    assert "wrote 453 questions" in out and (tmp_path / "hard.jsonl").is_file()


@pytest.mark.docker
def test_bench_serve():
    need_docker()
    out = run("bench/serve.py", "--steps", "2", "--code-steps", "1", "--episodes", "4")
    assert "SearchQA search" in out and "CodeExec python" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["8"], ["64"])]
    assert [r[0] for r in rows] == ["1", "8", "64"] and all(r[2] == "0" for r in rows)  # no errors


@pytest.mark.slow
@pytest.mark.docker
def test_bench_sandbox():
    need_docker()
    args = ["--calls", "1", "--throughput-calls", "1", "--verify-calls", "1", "--pool-size", "1"]
    out = run("bench/sandbox.py", *args)
    assert "speed-up (exec / resident)" in out and "4 worker(s): exec" in out and "exec / resident:" in out


@pytest.mark.slow
@pytest.mark.docker
def test_bench_sandbox_load():
    need_docker()
    out = run("bench/sandbox_load.py", "--workers", "1", "--duration-s", "2", "--flood-s", "0.5")
    assert "leaked containers after close: 0" in out


@pytest.mark.docker
def test_code_exec_module_scores_a_reference_solution():
    need_docker()
    out = run("-m", "toolgym.envs.code_exec", "--dataset", "humaneval", "--limit", "1", "--workers", "1")
    assert re.search(r"^1/1 reference solutions score 1 in ", out, re.MULTILINE), out


@pytest.mark.docker
def test_sandbox_image_module_keeps_the_built_image():
    need_docker()
    out = run("-m", "toolgym.tools.sandbox.image")
    assert "already exists" in out


@pytest.mark.slow
def test_bench_retrieval_and_its_agent_pairing(tiny_encoder, tmp_path, monkeypatch):
    """--smoke with the tiny encoder (every part: SearchQA, ArxivRefs, a scale run with an HNSW graph),
    then --agents over two scripted evaluations that differ only in the retriever."""
    import json

    from toolgym.envs.search_qa import default_corpus, default_questions

    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path / "cache"))
    out = run("bench/retrieval.py", "--smoke", "--encoder", tiny_encoder)
    assert "| dense (exact) |" in out and "| dense (hnsw) |" in out and "hnsw_recall@10_vs_exact" in out
    assert "| hybrid (rrf) |" in out and "| hybrid (rrf, hnsw) |" in out and "load average" in out

    corpus, questions = tmp_path / "docs.jsonl", tmp_path / "questions.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in default_corpus()[:40]))
    rows = [
        {
            "id": t.id,
            "question": t.metadata["question"],
            "answers": t.reference,
            "gold_doc": t.metadata["gold_doc"],
        }
        for t in default_questions()
        if t.metadata["gold_doc"] < "xq0040"
    ][:4]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [
        "--env",
        "toolgym/SearchQA-v0",
        "--env-arg",
        f"corpus={corpus}",
        "--env-arg",
        f"questions={questions}",
    ]
    common += ["--policy", "scripted", "--harness", "bare,scaffold", "--n", "4"]
    run("-m", "toolgym.cli", "eval", *common, "--out", tmp_path / "bm25")
    dense = ["--env-arg", "retriever=dense", "--env-arg", f"encoder={tiny_encoder}"]
    run("-m", "toolgym.cli", "eval", *common, *dense, "--out", tmp_path / "dense")
    out = run("bench/retrieval.py", "--agents", tmp_path / "bm25", tmp_path / "dense")
    assert "(dense) -" in out and "bare: n=4" in out and "pooled: n=4" in out
