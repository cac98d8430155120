"""``toolgym/SearchQA-v0``: question answering with a local BM25 search engine.

The agent gets a question and three tools: ``search(query, k)`` over a local index, ``open(doc_id)``
to read a whole document, and ``answer(answer)``, which ends the episode. The reward is exact match
after SQuAD normalisation (lower-case, no punctuation, no articles, single spaces) against any gold
answer; token F1 is always logged too, and ``metric="f1"`` makes it the reward.

Default data (shipped in the package, CC BY-SA 4.0): the 1,190 XQuAD-en questions over its 240 SQuAD
paragraphs, plus 10,033 Wikipedia lead paragraphs as distractors. Bring your own with
``gymnasium.make("toolgym/SearchQA-v0", corpus="docs.jsonl", questions="qs.jsonl")``; the formats are
in environments.md.

Splits (``split="train" | "test" | "all"``, default ``"all"``): questions are grouped by the document
that answers them (``gold_doc``), so two questions about one paragraph never straddle the line; a group
goes to ``test`` by the hash rule of :mod:`toolgym.splits` (namespace ``SearchQA``, key
``doc:<gold_doc>``, test fraction :data:`TEST_FRACTION`). Default data: 924 train / 266 test
questions (187 / 53 paragraphs). A question record may carry its own ``"split"``; a record without
``gold_doc`` is its own group (key ``question:<id>``). The default is ``"all"`` so that existing
configurations, which pick task ids from the full set, keep working unchanged; train on ``"train"``
and report on ``"test"``.

Decisions: document ids are short (``xq0042``, ``wk01234``) so that a small model can copy them; the
index is built once per (corpus, backend) and cached on disk by the index layer, and shared by all
environments of a process.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import string
import threading
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.core import FunctionTool, Message, Score, Task, Tool
from toolgym.data import iter_records
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError, ToolCallError, did_you_mean
from toolgym.parsing import format_tool_call, tool_responses
from toolgym.splits import (
    SplitItem,
    assign_splits,
    check_split,
    label_tasks,
    record_split,
    select_split,
)

__all__ = [
    "ExactMatchVerifier",
    "SearchQAEnv",
    "default_corpus",
    "default_questions",
    "f1_score",
    "normalize_answer",
    "reference_rule",
    "split_key",
]

METRICS = ("em", "f1")
MAX_K = 10
SNIPPET_CHARS = 240
#: The first result line of a ``search`` observation, ``[doc_id] title: snippet`` (the baseline reads its title).
_TOP_HIT = re.compile(r"\[[^\]]+\] ([^:\n]+):")
#: Share of question groups (documents) the hash rule puts in the test split.
TEST_FRACTION = 0.25
#: Namespace of the split hash (see :mod:`toolgym.splits`).
SPLIT_NAMESPACE = "SearchQA"
PROMPT = "Question: {question}\nSearch the documents to find the answer, then call the answer tool with a short answer."


# ----------------------------------------------------------------------------- verifier
def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower-case, drop punctuation and articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD token-level F1 between normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


class ExactMatchVerifier:
    """EM (or F1) against the best-matching gold answer; both always in metrics.

    ``task.reference`` is the list of gold answer strings. An answer that is not a string (or is
    empty) is the model's mistake: reward 0 with ``answer/invalid = 1``. A task without gold answers
    is a data bug and raises.
    """

    def __init__(self, metric: str = "em") -> None:
        if metric not in METRICS:
            raise ConfigError(f"unknown metric {metric!r}.{did_you_mean(metric, METRICS)} Choose em or f1")
        self.metric = metric

    def score(self, task: Task, answer: Any, trajectory: Sequence[Message]) -> Score:
        golds = task.reference
        if not isinstance(golds, list | tuple) or not golds or not all(isinstance(g, str) for g in golds):
            raise ValueError(f"task {task.id!r} has no gold answers (reference={golds!r}); fix the data")
        if not isinstance(answer, str) or not answer.strip():
            return Score(0.0, {"reward/em": 0.0, "reward/f1": 0.0, "answer/invalid": 1.0})
        em = max(float(normalize_answer(answer) == normalize_answer(g)) for g in golds)
        f1 = max(f1_score(answer, g) for g in golds)
        return Score(
            em if self.metric == "em" else f1, {"reward/em": em, "reward/f1": f1, "answer/invalid": 0.0}
        )


# ----------------------------------------------------------------------------- data
def _data_dir() -> Path:
    return Path(str(resources.files("toolgym.envs") / "data" / "search_qa"))


def default_corpus() -> list[dict[str, str]]:
    """XQuAD-en paragraphs (``xq`` ids) followed by the Wikipedia lead paragraphs (``wk`` ids)."""
    data = json.loads((_data_dir() / "xquad.en.json").read_text(encoding="utf-8"))
    docs: list[dict[str, str]] = []
    for article in data["data"]:
        title = article["title"].replace("_", " ")
        for paragraph in article["paragraphs"]:
            docs.append({"id": f"xq{len(docs):04d}", "title": title, "text": paragraph["context"]})
    with gzip.open(_data_dir() / "wiki_vital_summaries_en.json.gz", "rt", encoding="utf-8") as fh:
        wiki = json.load(fh)
    for i, key in enumerate(sorted(wiki)):
        entry = wiki[key]
        docs.append({"id": f"wk{i:05d}", "title": entry["title"], "text": entry["extract"]})
    return docs


def split_key(task: Task) -> str:
    """The grouping key of a question: ``doc:<gold_doc>``, or ``question:<id>`` without a gold document."""
    gold = task.metadata.get("gold_doc")
    return f"doc:{gold}" if gold is not None else f"question:{task.id}"


def _label(tasks: list[Task], explicit: Sequence[str | None], where: Sequence[str]) -> list[Task]:
    items = [SplitItem(split_key(t), e, w) for t, e, w in zip(tasks, explicit, where, strict=True)]
    return label_tasks(tasks, assign_splits(items, namespace=SPLIT_NAMESPACE, test_fraction=TEST_FRACTION))


def default_questions() -> list[Task]:
    """XQuAD-en questions, labelled with their split.

    ``metadata["gold_doc"]`` is the paragraph that answers each, and ``metadata["split"]`` its split
    (see the module docstring).
    """
    data = json.loads((_data_dir() / "xquad.en.json").read_text(encoding="utf-8"))
    tasks, para = [], 0
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = list(dict.fromkeys(a["text"] for a in qa["answers"]))
                tasks.append(
                    Task(
                        qa["id"],
                        PROMPT.format(question=qa["question"]),
                        answers,
                        {"question": qa["question"], "gold_doc": f"xq{para:04d}", "source": "xquad-en"},
                    )
                )
            para += 1
    return _label(tasks, [None] * len(tasks), [""] * len(tasks))


def _load_questions(path: str | Path) -> list[Task]:
    tasks, explicit, places = [], [], []
    seen: dict[str, str] = {}
    for lineno, record in iter_records(path, required=("id", "question", "answers"), kind="question"):
        where = f"{path}:{lineno}"
        answers = record["answers"]
        if isinstance(answers, str):
            answers = [answers]
        if (
            not isinstance(answers, list)
            or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)
        ):
            raise ConfigError(
                f"{where}: question {record['id']!r}: 'answers' must be a non-empty list of strings"
            )
        if str(record["id"]) in seen:
            raise ConfigError(
                f"{where}: duplicate question id {record['id']!r} (first used at {seen[str(record['id'])]})"
            )
        seen[str(record["id"])] = where
        gold = record.get("gold_doc")
        if gold is not None and (isinstance(gold, bool) or not isinstance(gold, str | int)):
            raise ConfigError(
                f"{where}: 'gold_doc' must be a document id (a string), got {type(gold).__name__}"
            )
        meta = {k: v for k, v in record.items() if k not in ("id", "answers", "split")}
        if gold is not None:
            meta["gold_doc"] = str(gold)
        tasks.append(Task(str(record["id"]), PROMPT.format(question=record["question"]), answers, meta))
        explicit.append(record_split(record.get("split"), where))
        places.append(where)
    if not tasks:
        raise ConfigError(f"{path}: no questions")
    return _label(tasks, explicit, places)


def _load_corpus(path: str | Path) -> list[dict[str, str]]:
    docs = []
    seen: dict[str, int] = {}
    for lineno, r in iter_records(path, required=("id", "text"), kind="document"):
        doc_id = str(r["id"])
        if doc_id in seen:
            raise ConfigError(
                f"{path}:{lineno}: duplicate document id {doc_id!r} (first used at line {seen[doc_id]}); "
                "ids must be unique"
            )
        seen[doc_id] = lineno
        docs.append({"id": doc_id, "title": str(r.get("title", "")), "text": str(r["text"])})
    if not docs:
        raise ConfigError(f"{path}: no documents")
    return docs


_INDEXES: dict[tuple[str, str], Any] = {}
_INDEX_LOCK = threading.Lock()


def _shared_index(key: str, backend: str, docs_factory: Any) -> Any:
    """One index per (corpus, backend) per process; the index layer caches it on disk."""
    from toolgym.tools.search.index import build_index

    with _INDEX_LOCK:
        if (key, backend) not in _INDEXES:
            _INDEXES[(key, backend)] = build_index(docs_factory(), backend=backend)
        return _INDEXES[(key, backend)]


# ----------------------------------------------------------------------------- environment
class SearchQAEnv(ToolEnv):
    """Search-based question answering (see the module docstring).

    Args:
        corpus: JSONL of ``{"id", "title", "text"}`` documents; default: XQuAD + Wikipedia.
        questions: JSONL of ``{"id", "question", "answers": [...]}`` (optional ``gold_doc``, ``split``);
            default: XQuAD-en. Required with ``corpus``: the built-in questions are about the
            built-in documents, so scoring them against another corpus would be silently wrong.
        split: ``"train"``, ``"test"`` or ``"all"`` (default, the behaviour before splits existed);
            see the module docstring for the rule.
        backend: search backend, ``"default"`` (in-process BM25) or ``"pyserini"`` (Lucene).
        metric: ``"em"`` (default) or ``"f1"`` as the reward; both are logged.
        max_turns: assistant turns before truncation.
        demonstration: show one worked first turn (a question outside the data) before the task.
    """

    description = "Question answering with search(query, k) and open(doc_id) over a local BM25 index."

    def __init__(
        self,
        corpus: str | Path | None = None,
        questions: str | Path | None = None,
        *,
        split: str = "all",
        backend: str = "default",
        metric: str = "em",
        max_turns: int = 6,
        demonstration: bool = True,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.show_demonstration = demonstration
        self.verifier = ExactMatchVerifier(metric)
        check_split(split)
        if corpus is not None and questions is None:
            raise ConfigError(
                f"corpus={str(corpus)!r} was given without questions=: the built-in XQuAD questions "
                "are about the built-in documents and would be scored against yours. Pass "
                'questions=\'questions.jsonl\' (one {"id", "question", "answers"} per line, see '
                "environments.md), or drop corpus= to use the built-in data"
            )
        tasks = _load_questions(questions) if questions is not None else default_questions()
        self.selection = select_split(tasks, split)
        self.split = split
        self.tasks = list(self.selection.tasks)
        if corpus is None:
            self.index = _shared_index("default", backend, default_corpus)
        else:
            path = Path(corpus).resolve()
            self.index = _shared_index(str(path), backend, lambda: _load_corpus(path))
        self._tool_list = self._make_tools()

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        return self._tool_list

    def provenance(self) -> dict[str, Any]:
        """The search index behind the tools (for run manifests)."""
        return {"index": self.index.provenance}

    def _choose_task(self, options: dict[str, Any]) -> Task:
        self.selection.check_options(options)  # a task id of the other split: say so
        return super()._choose_task(options)

    def demonstration(self, allowed_tools: Sequence[str]) -> list[Message]:
        """One worked first turn on a question outside the data (turn off with ``demonstration=False``)."""
        if not self.show_demonstration:
            return []
        if "search" in allowed_tools:
            call = format_tool_call("search", {"query": "author of the play Hamlet", "k": 3})
        else:
            call = format_tool_call("answer", {"answer": "William Shakespeare"})
        return [
            {"role": "user", "content": PROMPT.format(question="Who wrote the play Hamlet?")},
            {"role": "assistant", "content": call},
        ]

    def _make_tools(self) -> list[Tool]:
        index = self.index

        def search(query: str, k: int = 3) -> str:
            if not query.strip():
                raise ToolCallError("empty query: pass the words to search for", tool="search")
            if not 1 <= k <= MAX_K:
                raise ToolCallError(f"k must be between 1 and {MAX_K}, got {k}", tool="search")
            hits = index.search(query, k=k)
            if not hits:
                return "No results. Try other words."
            lines = []
            for hit in hits:
                doc = index.get(hit.doc_id)
                snippet = doc["text"][:SNIPPET_CHARS] + ("..." if len(doc["text"]) > SNIPPET_CHARS else "")
                lines.append(f"[{hit.doc_id}] {doc['title']}: {snippet}")
            return "\n".join(lines)

        def open_doc(doc_id: str) -> str:
            try:
                doc = index.get(doc_id.strip())
            except KeyError:
                raise ToolCallError(
                    f"no document with id {doc_id!r}; use an id from the search results", tool="open"
                ) from None
            return f"[{doc['id']}] {doc['title']}\n{doc['text']}"

        return [
            FunctionTool(
                "search",
                "Search the document collection. Returns up to k results as [doc_id] title: snippet.",
                {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "words to search for"},
                        "k": {
                            "type": "integer",
                            "description": f"number of results, 1-{MAX_K}",
                            "default": 3,
                        },
                    },
                    "required": ["query"],
                },
                fn=search,
                timeout=10.0,
            ),
            FunctionTool(
                "open",
                "Read the full text of a document by its id.",
                {
                    "type": "object",
                    "properties": {"doc_id": {"type": "string", "description": "id from search results"}},
                    "required": ["doc_id"],
                },
                fn=open_doc,
                timeout=10.0,
            ),
            FunctionTool(
                "answer",
                "Give the final answer (a short phrase). Ends the episode.",
                {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
                terminal=True,
            ),
        ]


def baseline_rule() -> Callable[[str], str]:
    """The model-free baseline of ``toolgym eval --policy scripted``: a rule over the transcript.

    It searches the question's words, then answers with the title of the top hit: a weak, honest floor.
    """

    def rule(transcript: str) -> str:
        if not tool_responses(transcript):
            questions = re.findall(r"Question: (.*)", transcript)  # the last: a demonstration may precede
            return format_tool_call(
                "search", {"query": questions[-1] if questions else transcript[-200:], "k": 1}
            )
        episode = transcript.rsplit("Question: ", 1)[-1]  # after the worked example, if any
        hits = (_TOP_HIT.match(result) for result in tool_responses(episode))
        title = next((hit.group(1) for hit in hits if hit), "unknown")
        return format_tool_call("answer", {"answer": title})

    return rule


def reference_rule(task: Task) -> Callable[[str], str]:
    """A demonstration of ``task`` built from its gold answers (warm-start data, never evaluation).

    It searches the question (3 results, like the worked example), then answers with the first gold
    answer that appears verbatim in the search results it was shown, spelled as it appears there. When
    no gold answer is visible it answers ``"unknown"``, which the verifier scores low, so a reward
    threshold keeps exactly the demonstrations in which the answer could be copied from the results:
    they teach "search, then copy a short span", never an answer the agent could not have seen.
    """
    golds = sorted(task.reference, key=len) if isinstance(task.reference, list | tuple) else []
    question = str(task.metadata.get("question", "")) or task.prompt

    def rule(transcript: str) -> str:
        episode = transcript.rsplit("Question: ", 1)[-1]  # after the worked example, if any
        results = tool_responses(episode)
        if not results:
            return format_tool_call("search", {"query": question, "k": 3})
        seen = next((g for g in golds if any(g in result for result in results)), None)
        return format_tool_call("answer", {"answer": seen if seen is not None else "unknown"})

    return rule
