"""Chat formats on tiny random models of each architecture (no downloads): ``auto`` picks the format,
episodes round-trip render -> sample -> parse -> observation token-exactly over three turns, malformed
calls in each syntax become observations, reasoning stays out of the action and is counted and capped,
a history-rewriting template opens a new segment (or is refused), exports keep their format, and the
embedded SmolLM2 path renders exactly as before."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import transformers
from tiny_chat_models import CHATML, QWEN3, ForcedPolicy, LookupEnv, build_model_dir, rescored, tokenizer_for

from toolgym.agents.chat.chatml import IM_END, ChatMLTemplate
from toolgym.agents.chat.formats import REQUIRED, detect_chat_format, resolve_chat_format
from toolgym.agents.eval.reverify import replay
from toolgym.agents.harness import ScaffoldHarness, get_harness
from toolgym.agents.policies.base import ChatPolicy
from toolgym.agents.policies.hf import HFPolicy, HFTokenizer
from toolgym.agents.policies.models import smollm2_path
from toolgym.agents.rollout import run_episode
from toolgym.call_formats import get_call_format
from toolgym.core import SamplingParams
from toolgym.errors import ConfigError
from toolgym.parsing import format_tool_call, parse
from toolgym.training.learn.grpo import check_token_receipt

SAMPLING = SamplingParams(max_tokens=128, temperature=1.0, seed=0)
#: architecture -> the format ``auto`` must pick for it
EXPECTED = {
    "llama": "llama3",
    "qwen2": "hermes",
    "qwen3": "hermes",
    "mistral": "mistral",
    "gemma": "template:hermes",
    "gpt-oss": "harmony",
}
#: a call format -> malformed turns in it (for llama3 also a well-formed call in another model's format)
MALFORMED = {
    "hermes": ['<tool_call>{"name": "search", "arguments": {"query": </tool_call>'],
    "llama3": [format_tool_call("search", {"query": "x"}), '{"name": "search", "parameters": {"query": '],
    "mistral": ['[TOOL_CALLS][{"name": "search", "arguments": {"query": 1}}]'],
    "harmony": ['<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": '],
}
THOUGHT = "I should look it up."


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    built: dict[str, object] = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build_model_dir(kind, tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


def check_exact(policy, trajectory) -> None:
    """The learner's receipt check passes on every segment, and the model run over each whole segment
    gives back exactly the logprobs the sampler recorded: nothing was re-tokenised."""
    for view in trajectory.segment_views():
        check_token_receipt(view)
    pairs = rescored(policy, trajectory)
    assert pairs and max(abs(a - b) for a, b in pairs) < 1e-4


def reasoning(policy) -> str:
    r = policy.chat_format.reasoning
    if r is None:
        return ""
    if r.open.startswith("<|channel|>"):  # harmony: an analysis message before the action
        return f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
    decoy = format_tool_call("answer", {"answer": "0"})  # a call inside the reasoning is never parsed
    return f"{r.open}\n{THOUGHT} {decoy}\n{r.close}\n\n"


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(EXPECTED))
async def test_each_architecture_gets_its_format_and_an_episode_round_trips_token_exactly(kind, model_dirs):
    policy = ForcedPolicy(model_dirs(kind))
    try:
        fmt = policy.chat_format
        assert fmt.name == EXPECTED[kind]
        calls = get_call_format(fmt.call_format)
        think = reasoning(policy)
        turns = [
            *(think + b for b in MALFORMED[fmt.call_format]),
            think + calls.format_call("search", {"query": "x"}),
            think + calls.format_call("answer", {"answer": "42"}),
        ]
        policy.script(*turns)
        env = LookupEnv()
        trajectory = await run_episode(env, policy, get_harness("bare"), seed=0, sampling=SAMPLING)
        assert (trajectory.status, trajectory.stop_reason, trajectory.reward) == ("ok", "answer", 1.0)
        results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        bad = len(MALFORMED[fmt.call_format])
        assert all(r.startswith("Error: ") for r in results[:bad])  # malformed calls: observations
        assert results[bad:] == ["x: x is 42"]
        if fmt.call_format == "llama3":
            assert "written in the llama3 format" in results[0]  # a call in another model's format
        assert [m["content"] for m in trajectory.messages if m["role"] == "assistant"][-len(turns) :] == [
            t.removesuffix("<|call|>") for t in turns
        ]
        check_exact(policy, trajectory)  # three sampled turns
        transcript = policy.tokenizer.decode(trajectory.token_ids)
        assert calls.format_call("search", {"query": "y"}) in transcript  # the worked example, in its syntax
        if fmt.reasoning is not None:
            assert trajectory.metrics["tokens/thinking"] > 0
        else:
            assert "tokens/thinking" not in trajectory.metrics
        if kind == "gemma":
            assert trajectory.metrics["episode/rewrites"] == 0.0 and not trajectory.segments
        elif (
            kind != "gpt-oss"
        ):  # own renderers: the turn-by-turn tokens are the whole conversation's rendering
            history = list(trajectory.messages)
            assert transcript == fmt.start(history[:-1]) + history[-1]["content"] + fmt.stop_tokens[0]

        # and a real draw from the random model: whatever it writes, the environment answers with messages
        free = await policy.generate(
            policy.render(trajectory.messages[:4]), SamplingParams(max_tokens=8, seed=1)
        )
        assert 1 <= len(free.token_ids) <= 8 and len(free.logprobs) == len(free.token_ids)
        parsed = parse(fmt.split_reasoning(free.text)[1], {"search": {}}, call_format=calls)
        assert isinstance(parsed.errors, tuple)
    finally:
        policy.close()


async def test_the_scaffold_hint_shows_the_episodes_call_syntax(model_dirs):
    """After a failed call the scaffold's hint shows a call in the model's syntax (here llama3's), on
    a compacting scaffold too; with ChatML models it is the hermes text, as always. Re-verification
    replays the episode in its syntax."""
    policy = ForcedPolicy(model_dirs("llama"))
    try:
        calls = get_call_format("llama3")
        policy.script(MALFORMED["llama3"][1], calls.format_call("answer", {"answer": "42"}))
        env = LookupEnv()
        trajectory = await run_episode(
            env, policy, get_harness("scaffold+compact"), seed=0, sampling=SAMPLING
        )
        assert trajectory.reward == 1.0
        hints = [m["content"] for m in trajectory.messages if m["role"] == "user" and "Hint:" in m["content"]]
        assert len(hints) == 1 and calls.format_call("<tool>", {"<argument>": "..."}) in hints[0]
        assert "<tool_call>" not in hints[0]
        again = replay(LookupEnv(), trajectory)  # toolgym reverify finds the syntax the episode was played in
        assert (again.reward, again.status, again.observation_diff) == (1.0, "ok", "")
    finally:
        policy.close()
    assert ScaffoldHarness().hint() == ScaffoldHarness.HINT and "<tool_call>" in ScaffoldHarness.HINT
    with pytest.raises(ConfigError, match="Did you mean 'llama3'"):
        ScaffoldHarness().for_call_format("llama")


async def test_a_template_that_drops_earlier_reasoning_opens_a_new_segment(model_dirs):
    policy = ForcedPolicy(model_dirs("qwen3"), chat_format="template")
    try:
        fmt = policy.chat_format
        assert fmt.name == "template:hermes" and fmt.reasoning is not None and fmt.checks_history
        think = f"<think>\n{THOUGHT}\n</think>\n\n"
        policy.script(
            think + format_tool_call("search", {"query": "x"}),
            think + format_tool_call("answer", {"answer": "42"}),
        )
        # the scaffold's budget note makes the tool results a new user query: the template then drops
        # the <think> block of the turn before it
        trajectory = await run_episode(
            LookupEnv(), policy, get_harness("scaffold"), seed=0, sampling=SAMPLING
        )
        assert trajectory.reward == 1.0 and trajectory.metrics["episode/rewrites"] == 1.0
        (second,) = trajectory.segments
        assert second.start_turn == 2
        first_text = policy.tokenizer.decode(trajectory.token_ids)
        assert THOUGHT in first_text  # the first segment keeps the reasoning exactly as sampled
        opening = second.token_ids[: second.loss_mask.index(1)]
        assert policy.tokenizer.decode(opening) == fmt.start(
            list(second.context)
        )  # the template's own rendering
        assert THOUGHT not in policy.tokenizer.decode(opening)
        check_exact(policy, trajectory)  # each segment trains on what it sampled

        # without a new user query the template keeps the block: one segment, appended turn by turn
        policy.script(
            think + format_tool_call("search", {"query": "x"}),
            think + format_tool_call("answer", {"answer": "42"}),
        )
        kept = await run_episode(LookupEnv(), policy, get_harness("bare"), seed=0, sampling=SAMPLING)
        assert kept.metrics["episode/rewrites"] == 0.0 and not kept.segments

        policy.chat_format = dataclasses.replace(fmt, on_rewrite="refuse")
        policy.script(think + format_tool_call("search", {"query": "x"}))
        with pytest.raises(
            ConfigError, match=r"rewrites the history of turn 1: drops the reasoning \(<think>...</think>\)"
        ):
            await run_episode(LookupEnv(), policy, get_harness("scaffold"), seed=0, sampling=SAMPLING)
    finally:
        policy.close()


async def test_a_thinking_budget_closes_an_unfinished_block_with_untrained_tokens(model_dirs):
    policy = ForcedPolicy(model_dirs("qwen3"), thinking_budget=6)
    try:
        tok = policy.tokenizer
        long_thought = tok.encode("<think>\n" + "step " * 30)
        short_thought = tok.encode("<think>\nok\n</think>")
        policy.script_ids(long_thought)  # turn 1: cut at the budget
        policy.script(format_tool_call("search", {"query": "x"}))  # ... then the action
        policy.script_ids(short_thought)  # turn 2: the block ends within the budget
        policy.script("\n\n" + format_tool_call("answer", {"answer": "42"}))
        trajectory = await run_episode(LookupEnv(), policy, get_harness("bare"), seed=0, sampling=SAMPLING)
        assert trajectory.reward == 1.0
        assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["x: x is 42"]
        assert trajectory.metrics["episode/thinking_cut"] == 1.0
        assert trajectory.metrics["tokens/thinking"] == 6 + 1 + len(
            short_thought
        )  # 6 sampled + the forced </think>
        forced = tok.encode("</think>\n\n")
        ids, mask = list(trajectory.token_ids), list(trajectory.loss_mask)
        at = next(i for i in range(len(ids)) if ids[i : i + len(forced)] == forced and mask[i - 1] == 1)
        assert ids[at - 6 : at] == long_thought[:6] and mask[at - 6 : at] == [1] * 6
        assert mask[at : at + len(forced)] == [0] * len(forced)  # the rollout's tokens: never trained
        check_exact(policy, trajectory)
    finally:
        policy.close()


def test_the_embedded_model_renders_byte_identically_through_the_hermes_format():
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_path())
    fmt = resolve_chat_format("auto", hf)
    assert (fmt.name, fmt.call_format, fmt.stop_tokens, fmt.reasoning) == (
        "hermes",
        "hermes",
        (IM_END,),
        None,
    )
    assert detect_chat_format(hf)[0] == "hermes"
    new, old = ChatPolicy(HFTokenizer(hf, fmt.stop_tokens), chat_format=fmt), ChatPolicy(HFTokenizer(hf))
    opening = [{"role": "system", "content": "tools"}, {"role": "user", "content": "q?"}]
    later = [
        {"role": "tool", "name": "search", "content": "r1"},
        {"role": "tool", "name": "search", "content": "r2"},
        {"role": "user", "content": "note"},
    ]
    expected = hf.encode(ChatMLTemplate().start(opening), add_special_tokens=False)
    assert new.render(opening) == old.render(opening) == expected
    for close in (False, True):
        text = ChatMLTemplate().continuation(later, close_turn=close)
        assert new.render(later, continuation=True, close_turn=close) == hf.encode(
            text, add_special_tokens=False
        )
    sampling = SamplingParams(max_tokens=5)
    assert new.complete("hello world, a long turn", sampling) == old.complete(
        "hello world, a long turn", sampling
    )


# ----------------------------------------------------------------- bad input


def test_a_tokenizer_without_template_or_known_tokens_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    bare = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    with pytest.raises(
        ConfigError, match="cannot tell this model's chat format: its tokenizer has no chat template"
    ):
        resolve_chat_format("auto", bare)
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        resolve_chat_format("template", bare)


def test_a_format_whose_special_tokens_are_missing_is_refused_naming_them(model_dirs):
    with pytest.raises(
        ConfigError,
        match="chat format 'llama3' needs the special tokens .* lacks <\\|begin_of_text\\|>, <\\|start_header_id\\|>",
    ):
        resolve_chat_format("llama3", tokenizer_for("qwen2"))
    with pytest.raises(ConfigError, match="chat format 'harmony' needs .* lacks <\\|start\\|>"):
        HFPolicy(model_dirs("llama"), chat_format="harmony")  # refused before the weights load
    with pytest.raises(ConfigError, match="unknown chat format 'lama3'. Did you mean 'llama3'?"):
        resolve_chat_format("lama3", tokenizer_for("llama"))


def test_a_template_failing_the_prefix_check_is_refused():
    counting = "{{- messages | length }} messages\n" + CHATML  # every earlier turn changes as the chat grows
    with pytest.raises(ConfigError, match="the chat template fails the prefix check: .*2 messages"):
        resolve_chat_format("template", tokenizer_for("qwen2", counting))
    plain_end = "{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] + '\\n\\n' -}}{%- endfor -%}"
    with pytest.raises(ConfigError, match="ends an assistant turn with '\\\\n\\\\n', not a special token"):
        resolve_chat_format("template", tokenizer_for("qwen2", plain_end))


def test_a_thinking_budget_needs_reasoning_markers():
    with pytest.raises(ConfigError, match="a thinking budget needs reasoning markers"):
        resolve_chat_format("auto", tokenizer_for("qwen2"), thinking_budget=8)
    fmt = resolve_chat_format("auto", tokenizer_for("qwen3", QWEN3), thinking_budget=8)
    assert fmt.name == "hermes" and fmt.thinking_budget == 8


def test_the_training_config_names_a_known_format():
    from toolgym.training.config import HFPolicyConfig, TinyPolicyConfig

    assert HFPolicyConfig().chat_format == "auto"
    with pytest.raises(ConfigError, match="Did you mean 'harmony'"):
        HFPolicyConfig(chat_format="harmon")
    with pytest.raises(ConfigError, match="'tiny' renders ChatML"):
        TinyPolicyConfig(chat_format="llama3")


# ----------------------------------------------------------------- exports


def test_an_export_keeps_the_format_it_was_trained_with(tmp_path, model_dirs):
    from toolgym.agents.policies.run_exports import export_problem, read_manifest
    from toolgym.training.export import export_checkpoint, export_model

    base = model_dirs("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    trained = SimpleNamespace(
        model_dir=base,
        tokenizer=SimpleNamespace(hf=tokenizer),
        chat_format=SimpleNamespace(name="llama3"),
        policy_version=2,
    )
    path = export_checkpoint(tmp_path, model, trained, step=2)
    assert path is not None and export_problem(path) is None
    manifest = read_manifest(path)
    assert manifest["chat_format"] == "llama3"
    assert manifest["chat_tokens"] == {t: tokenizer.convert_tokens_to_ids(t) for t in REQUIRED["llama3"]}
    exported = transformers.AutoTokenizer.from_pretrained(path)
    assert exported.chat_template == tokenizer.chat_template  # the model's own template, not ChatML
    assert detect_chat_format(exported, path) == ("llama3", "recorded in toolgym-export.json")
    policy = HFPolicy(f"run:{tmp_path}")
    assert policy.chat_format.name == "llama3"
    policy.close()

    (path / "toolgym-export.json").write_text(json.dumps({**manifest, "chat_format": "harmony"}))
    assert (
        export_problem(path)
        == "the tokenizer has no '<|start|>' token, which its chat format 'harmony' needs"
    )
    hermes = export_model(tmp_path / "other", model, tokenizer, step=1)  # the default: ChatML, as always
    assert read_manifest(hermes)["chat_format"] == "hermes" and export_problem(hermes) is None


def test_every_name_a_config_accepts_has_its_renderer() -> None:
    """The config checks ``policy.chat_format`` against :mod:`toolgym.chat_format_names` without loading
    a renderer: the renderers registered are exactly those names, and every accepted name resolves."""
    from toolgym.agents.chat.formats import RENDERERS
    from toolgym.chat_format_names import CHAT_FORMATS, RENDERER_NAMES

    assert tuple(RENDERERS) == RENDERER_NAMES
    assert set(CHAT_FORMATS) == {"auto", "template", *RENDERERS, *(f"template:{c}" for c in RENDERERS)}
