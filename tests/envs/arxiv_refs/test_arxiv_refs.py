"""toolgym/ArxivRefs-v0: tasks, gold, reward, anti-leak rules, checker, scripted and BM25 episodes."""

from __future__ import annotations

import json

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import toolgym  # noqa: F401  (registers the ids)
from toolgym.agents.harness import BareHarness
from toolgym.agents.policies.base import RulePolicy, ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import SamplingParams
from toolgym.envs.arxiv_refs import (
    ArxivRefsEnv,
    baseline_rule,
    bm25_baseline,
    placeholder_queries,
    reference_rule,
    split_groups,
)
from toolgym.errors import ConfigError, ToolCallError
from toolgym.parsing import format_tool_call
from toolgym.splits import hash_split
from toolgym.tools.papers import near_duplicates

ENV_ID = "toolgym/ArxivRefs-v0"


def record(pid, *, title, body, bib=None, date="2022-01-10", doi=None, formulas=None):
    return {
        "paper_id": pid,
        "metadata": {"title": title, "authors": "Ada Lovelace", "update_date": date, "doi": doi},
        "abstract": {"text": f"Abstract of {title}."},
        "body_text": [{"section": s, "text": t, "cite_spans": []} for s, t in body],
        "bib_entries": {ref: {"bib_entry_raw": raw, "ids": ids} for ref, (raw, ids) in (bib or {}).items()},
        "ref_entries": {k: {"type": "formula", "latex": v} for k, v in (formulas or {}).items()},
    }


QUERY_BIB = {
    "r1": (
        "Grace Hopper. Compiling arithmetic expressions for early computers. J. ACM, 1952.",
        {"arxiv_id": ""},
    ),
    "r2": (
        "Edsger Dijkstra. A note on two problems in connexion with graphs. Numer. Math., 1959.",
        {"doi": "10.1007/BF01386390"},
    ),
    "r3": ("Claude Shannon. A mathematical theory of communication. Bell Syst. Tech. J., 1948.", {}),
    "r4": ("John Future. Results that appear only later in time. Journal of Tomorrow, 2030.", {}),
}
RELATED = (
    "Compilers for arithmetic go back to early work {{cite:r1}}. Shortest paths in graphs were solved "
    "by {{cite:r2}} and later refined {{cite:r2}}, {{cite:r3}}. Entropy {{formula:f1}} is classic {{cite:r3}}."
)


def corpus(tmp_path, extra=()):
    query = record(
        "2201.00001",
        title="Graphs, compilers and communication",
        date="2022-01-10",
        doi="10.5555/query",
        body=[
            ("Introduction", "Intro text without citations."),
            ("Related Work", RELATED),
            ("Method", "Our method uses {{cite:r4}}."),
        ],
        bib=QUERY_BIB,
        formulas={"f1": "H(X)"},
    )
    later = record(
        "2203.00009",
        title="Shortest paths in graphs revisited with compilers",
        date="2022-03-01",
        body=[("Related Work", "Graphs and shortest paths and compilers {{cite:q}}.")],
        bib={
            "q": ("Ada Lovelace. Graphs compilers communication survey. 2022.", {"arxiv_id": "2201.00001v2"})
        },
    )
    earlier = record(
        "2112.00005",
        title="Arithmetic expressions for computers",
        date="2021-12-01",
        body=[("Background", "Compiling arithmetic expressions {{cite:h}} is old.")],
        bib={"h": ("G. Hopper, “Compiling arithmetic expressions for early computers,” J. ACM (1952).", {})},
    )
    records = [query, later, earlier, *extra]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def small(tmp_path):
    env = ArxivRefsEnv(corpus(tmp_path))
    yield env
    env.close()


def task_of(env, paper_id):
    return next(t for t in env.tasks if t.metadata["paper_id"] == paper_id)


@pytest.fixture(scope="module")
def default_env():
    env = ArxivRefsEnv()
    yield env
    env.close()


# ----------------------------------------------------------------------------- tasks and gold


def test_default_counts(default_env):
    stats = default_env.stats
    assert stats["papers"] == 49 and stats["records"] == 1824
    assert stats["tasks"] == len(default_env.tasks) == 40
    assert stats["markers_unlinked"] == 0 and stats["markers_linked"] == stats["markers"] > 0
    assert all(t.reference for t in default_env.tasks)


def test_placeholders_numbered_by_first_appearance(small):
    prompt = task_of(small, "2201.00001").prompt
    assert "early work [CITATION 1]. Shortest paths" in prompt
    assert "solved by [CITATION 2] and later refined [CITATION 2], [CITATION 3]" in prompt
    assert "is classic [CITATION 3]" in prompt
    assert "{{" not in prompt and "[CITATION 4]" not in prompt


def test_formula_markers_render_readably(small):
    assert "Entropy $H(X)$ is classic" in task_of(small, "2201.00001").prompt


def test_gold_is_the_cited_collection_ids(small):
    c = small.collection
    task = task_of(small, "2201.00001")
    expected = {c.ref_ids[("2201.00001", r)] for r in ("r1", "r2", "r3")}
    assert set(task.reference) == expected
    # r1 is the same work the earlier paper cites (title match): one record, linked from both
    assert c.ref_ids[("2201.00001", "r1")] == c.ref_ids[("2112.00005", "h")]


def test_context_rule_falls_back_and_is_configurable(tmp_path):
    fallback = record(
        "2201.00003",
        title="Only an intro",
        body=[("Introduction", "See {{cite:z}}."), ("Results", "Compare {{cite:y}}.")],
        bib={
            "z": ("A. B. Smith. Some cited thing here. 2001.", {}),
            "y": ("C. D. Jones. Another cited thing. 2002.", {}),
        },
    )
    env = ArxivRefsEnv(corpus(tmp_path, [fallback]))
    task = task_of(env, "2201.00003")
    assert task.metadata["context"] == "introduction (fallback)" and "See [CITATION 1]" in task.prompt
    assert task.reference == [env.collection.ref_ids[("2201.00003", "z")]]
    assert task_of(env, "2201.00001").metadata["context"] == "related-work context"
    custom = ArxivRefsEnv(corpus(tmp_path, [fallback]), sections=r"^results$", fallback_sections=r"^$")
    assert "Compare [CITATION 1]" in task_of(custom, "2201.00003").prompt
    with pytest.raises(ConfigError, match="sections must be a regular expression"):
        ArxivRefsEnv(corpus(tmp_path), sections="(")


def test_malformed_corpus_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        corpus(tmp_path).read_text() + '{"paper_id": "x", "body_text": "oops", "bib_entries": {}}\n'
    )
    with pytest.raises(ConfigError, match=r"bad\.jsonl:4: 'body_text' must be a list"):
        ArxivRefsEnv(path)


def test_json_error_message_says_at_column_once(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"paper_id": "a\tb"}\n')
    with pytest.raises(ConfigError) as caught:
        ArxivRefsEnv(path)
    assert str(caught.value) == f"{path}:1: not valid JSON (Invalid control character at column 16)"


# ----------------------------------------------------------------------------- splits


def with_fields(path, **by_paper):
    """Rewrite a corpus file, adding top-level fields per paper id (``{"2201.00001": {"split": ...}}``)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r.update(by_paper.get(r["paper_id"], {}))
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_own_corpus_split_field_then_hash_of_the_query_paper(tmp_path):
    path = with_fields(corpus(tmp_path), **{"2201.00001": {"split": "test"}, "2112.00005": {"split": None}})
    env = ArxivRefsEnv(path)
    keys = split_groups(env.collection, near_duplicates(env.collection))
    assert keys["2112.00005"] == f"paper:{env.collection.paper_ids['2112.00005']}"
    expected = {
        pid: "test"
        if pid == "2201.00001"
        else hash_split(keys[pid], namespace="ArxivRefs", test_fraction=0.25)
        for pid in ("2201.00001", "2203.00009", "2112.00005")
    }
    assert {t.metadata["paper_id"]: t.metadata["split"] for t in env.tasks} == expected
    test_env = ArxivRefsEnv(path, split="test")
    assert sorted(t.metadata["paper_id"] for t in test_env.tasks) == sorted(
        pid for pid, label in expected.items() if label == "test"
    )


def copycat_corpus(tmp_path):
    copycat = record(
        "2201.00077",
        title="Totally new title",
        date="2021-06-01",
        body=[("Related Work", RELATED)],
        bib=QUERY_BIB,
    )
    return corpus(tmp_path, [copycat])


def test_a_paper_and_its_copy_share_a_split(tmp_path):
    env = ArxivRefsEnv(copycat_corpus(tmp_path))
    keys = split_groups(env.collection, near_duplicates(env.collection))
    assert keys["2201.00001"] == keys["2201.00077"] != keys["2112.00005"]
    assert task_of(env, "2201.00001").metadata["split"] == task_of(env, "2201.00077").metadata["split"]
    labelled = ArxivRefsEnv(with_fields(copycat_corpus(tmp_path), **{"2201.00077": {"split": "test"}}))
    assert task_of(labelled, "2201.00001").metadata["split"] == "test"


def test_conflicting_split_fields_of_a_paper_and_its_copy(tmp_path):
    path = with_fields(
        copycat_corpus(tmp_path), **{"2201.00001": {"split": "train"}, "2201.00077": {"split": "test"}}
    )
    with pytest.raises(
        ConfigError, match=r"corpus\.jsonl:4: split 'test' conflicts with split 'train' at .*corpus\.jsonl:1"
    ):
        ArxivRefsEnv(path)


def test_bad_split_field_names_file_and_line(tmp_path):
    path = with_fields(corpus(tmp_path), **{"2203.00009": {"split": "validation"}})
    with pytest.raises(
        ConfigError, match=r"corpus\.jsonl:2: 'split' must be \"train\" or \"test\", got 'validation'"
    ):
        ArxivRefsEnv(path)


# ----------------------------------------------------------------------------- reward


def submit(env, task_id, ids):
    env.reset(options={"task_id": task_id})
    return env.step(format_tool_call("submit", {"paper_ids": ids}))


def test_oracle_scores_one_and_empty_scores_zero(default_env):
    for task in default_env.tasks:
        _, reward, terminated, _, info = submit(default_env, task.id, list(task.reference))
        assert terminated and reward == 1.0, task.id
        assert info["metrics"]["reward/precision"] == info["metrics"]["reward/recall"] == 1.0
    _, reward, terminated, _, info = submit(default_env, default_env.tasks[0].id, [])
    assert terminated and reward == 0.0 and info["metrics"]["reward/recall"] == 0.0


def test_duplicates_and_unknown_ids_lower_precision(small):
    task = task_of(small, "2201.00001")
    gold = list(task.reference)
    doi_form = "https://doi.org/10.1007/BF01386390"  # the same record as one gold id, in another form
    _, reward, _, _, info = submit(small, task.id, [*gold, gold[0], doi_form, "nope"])
    m = info["metrics"]
    assert m["answer/duplicates"] == 2.0 and m["answer/unknown_ids"] == 1.0
    assert m["reward/recall"] == 1.0 and m["reward/precision"] == pytest.approx(3 / 6)
    assert reward == pytest.approx(2 * 0.5 / 1.5)


def test_partial_answer_f1(small):
    task = task_of(small, "2201.00001")
    _, reward, _, _, info = submit(small, task.id, [task.reference[0]])
    assert info["metrics"]["reward/precision"] == 1.0
    assert info["metrics"]["reward/recall"] == pytest.approx(1 / 3)
    assert reward == pytest.approx(0.5)


# ----------------------------------------------------------------------------- anti-leak


def run_tool(env, task, name, **args):
    env.reset(options={"task_id": task.id})
    obs, *_ = env.step(format_tool_call(name, args))
    return obs[0]["content"]


def test_query_paper_never_returned_by_its_search(default_env):
    for task in default_env.tasks:
        own = default_env.collection.paper_ids[task.metadata["paper_id"]]
        assert own in default_env.banned_for(task)
        for query in (task.metadata["title"], task.prompt[-600:]):
            assert own not in {r.id for r in default_env.search(task, query, 20)}
    # the over-fetch still fills k with allowed hits
    task = default_env.tasks[0]
    assert len(default_env.search(task, task.metadata["title"], 20)) == 20


def test_query_paper_unreadable_in_any_id_form(small):
    task = task_of(small, "2201.00001")
    own = small.collection.paper_ids["2201.00001"]
    for form in (own, "2201.00001", "2201.00001v2", "arXiv:2201.00001", "10.5555/query"):
        with pytest.raises(ToolCallError, match="no paper"):
            small.read(task, form)
        out = run_tool(small, task, "read_paper", paper_id=form)
        assert out.startswith("Error: read_paper: no paper")
    # the later paper's bibliography entry for the query (arXiv v2) was merged into the banned record
    assert small.collection.ref_ids[("2203.00009", "q")] == own


def test_own_bibliography_strings_not_visible_as_is(default_env):
    c = default_env.collection
    for task in default_env.tasks:
        paper = next(p for p in c.papers if p.paper_id == task.metadata["paper_id"])
        raws = [" ".join(b.raw.split()) for b in paper.bib.values() if len(b.raw) >= 40]
        outputs = [default_env.search(task, raw, 3) for raw in raws[:10]]
        shown = "\n".join(
            "\n".join(f"{r.display_title()} {', '.join(r.authors)}" for r in hits) for hits in outputs
        )
        shown += "\n".join(run_tool_text(default_env, task, cid) for cid in task.reference)
        flat = " ".join(shown.split())
        assert task.metadata["paper_id"] not in {r.full_paper for hits in outputs for r in hits}
        for raw in raws:
            assert raw not in flat, (task.id, raw)


def run_tool_text(env, task, cid):
    from toolgym.envs.arxiv_refs.env import _render_paper

    return _render_paper(env.read(task, cid))


def test_later_papers_hidden_when_dates_known(tmp_path):
    path = corpus(tmp_path)
    env = ArxivRefsEnv(path)
    task = task_of(env, "2201.00001")
    later = env.collection.paper_ids["2203.00009"]
    earlier = env.collection.paper_ids["2112.00005"]
    hits = {r.id for r in env.search(task, "shortest paths graphs compilers arithmetic", 10)}
    assert later not in hits and earlier in hits
    assert "no paper" in run_tool(env, task, "read_paper", paper_id="2203.00009")
    # the 2030 reference is cited outside the context; it is later than the query, hence banned
    assert env.collection.ref_ids[("2201.00001", "r4")] in env.banned_for(task)
    open_env = ArxivRefsEnv(path, date_filter=False)
    assert later in {
        r.id for r in open_env.search(task_of(open_env, "2201.00001"), "shortest paths graphs compilers", 10)
    }


def test_papers_copying_the_query_are_excluded(tmp_path):
    copycat = record("2201.00077", title="Totally new title", date="2021-06-01", body=[("Intro", RELATED)])
    env = ArxivRefsEnv(corpus(tmp_path, [copycat]))
    task = task_of(env, "2201.00001")
    cid = env.collection.paper_ids["2201.00077"]
    assert cid in env.banned_for(task)
    assert cid not in {
        r.id for r in env.search(task, "compilers arithmetic shortest paths graphs entropy classic", 20)
    }
    loose = ArxivRefsEnv(corpus(tmp_path, [copycat]), near_duplicate_threshold=1.0)
    assert cid not in loose.banned_for(task_of(loose, "2201.00001"))


# ----------------------------------------------------------------------------- checker and rollouts


def test_gymnasium_checker_passes():
    env = gymnasium.make(ENV_ID)
    check_env(env.unwrapped)
    env.close()


async def test_scripted_policy_episode(small):
    task = task_of(small, "2201.00001")
    turns = [
        format_tool_call("search_papers", {"query": "shortest paths graphs", "k": 3}),
        format_tool_call("read_paper", {"paper_id": task.reference[0]}),
        format_tool_call("submit", {"paper_ids": list(task.reference)}),
    ]
    traj = await run_episode(small, ScriptedPolicy(turns), BareHarness(), options={"task_id": task.id})
    assert traj.status == "ok" and traj.reward == 1.0
    assert traj.metrics["tool/search_papers/calls"] == 1.0 and traj.metrics["tool/read_paper/calls"] == 1.0
    tool_text = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_text[0].startswith("[") and f"id: {task.reference[0]}" in tool_text[1]
    # the environment's tool-use measures (toolgym.tool_use): one search, one paper read; no question
    # to compare queries with, so no overlap (not measured, never 0)
    m = traj.metrics
    assert (m["use/searches"], m["use/opened"], m["use/first_search_turn"]) == (1.0, 1.0, 1.0)
    assert "use/query_overlap" not in m and "use/reformulated" not in m
    shown = task.reference[0] in tool_text[0]
    assert m["use/answer_shown"] == float(shown)


def test_placeholder_queries_cover_every_sentence():
    prompt = "x\n<<<CONTEXT\nA is good [CITATION 1]. B too. C as well [CITATION 2], $x$ ok.\nCONTEXT>>>"
    assert placeholder_queries(prompt) == ["A is good", "C as well ok"]
    assert placeholder_queries(prompt, max_queries=1) == ["A is good C as well ok"]


async def test_scripted_policy_matches_bm25_baseline(default_env):
    expected = bm25_baseline(default_env, k=2).rewards
    for task in default_env.tasks[:6]:
        policy = RulePolicy(baseline_rule(), name="scripted")  # what `--policy scripted` runs
        traj = await run_episode(
            default_env,
            policy,
            BareHarness(),
            options={"task_id": task.id},
            sampling=SamplingParams(max_tokens=2048),
            max_total_tokens=200_000,
        )
        assert traj.status == "ok"
        assert traj.reward == pytest.approx(expected[task.id]), task.id


async def test_the_reference_demonstration_submits_only_gold_ids_it_was_shown(default_env):
    """The warm start's demonstrator (``warm_start.source = "reference"``): search, then the seen gold."""
    rewarded = 0
    for task in default_env.tasks[:12]:
        traj = await run_episode(
            default_env,
            RulePolicy(reference_rule(task), name="reference"),
            BareHarness(),
            options={"task_id": task.id},
            sampling=SamplingParams(max_tokens=2048),
            max_total_tokens=200_000,
        )
        assert traj.status == "ok"
        shown = "\n".join(m["content"] for m in traj.messages if m["role"] == "tool")
        calls = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        assert all('"search_papers"' in c for c in calls[:-1]) and '"submit"' in calls[-1]
        submitted = json.loads(calls[-1].split("<tool_call>")[1].split("</tool_call>")[0])["arguments"][
            "paper_ids"
        ]
        assert submitted and all(f"[{i}]" in shown for i in submitted)  # never an id it did not see
        gold_seen = [i for i in task.reference if f"[{i}]" in shown]
        # measured by the environment: every id it submitted had been shown; gold shown when any was
        assert traj.metrics["use/answer_in_results"] == 1.0
        assert traj.metrics["use/answer_shown"] == float(bool(gold_seen))
        if gold_seen:  # exactly the gold it saw: precision 1
            assert sorted(submitted) == sorted(gold_seen) and traj.reward > 0
            rewarded += 1
        else:  # nothing to copy: the top hit of each search, scored low
            assert traj.reward < 0.5
    assert rewarded >= 1


def test_bm25_baseline_is_nontrivial(default_env):
    result = bm25_baseline(default_env, k=2)
    assert 0.03 < result.mean_reward < 0.5
    assert len(result.rewards) == 40
    assert result.metrics["answer/unknown_ids"] == 0.0
