"""SearchQA's data: the questions (labelled with their split), the documents, and the index over them.

Questions are grouped by the document that answers them (``gold_doc``) and a group goes to ``test`` by
the hash rule of :mod:`toolgym.splits` (namespace :data:`SPLIT_NAMESPACE`, key ``doc:<gold_doc>``,
test fraction :data:`TEST_FRACTION`); a record without ``gold_doc`` is its own group (key
``question:<id>``), and a record may carry its own ``"split"``. The index over a corpus is built once
per (corpus, retriever settings) and cached on disk by the index layer; :func:`shared_index` shares it
between every environment of a process.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from toolgym.core import Task
from toolgym.data import UniqueIds, iter_records, require_id, require_text
from toolgym.errors import ConfigError
from toolgym.splits import SplitItem, assign_splits, label_tasks, record_split
from toolgym.tools.search.retriever import RetrieverSettings

__all__ = [
    "PROMPT",
    "SPLIT_NAMESPACE",
    "TEST_FRACTION",
    "data_dir",
    "default_corpus",
    "default_questions",
    "load_corpus",
    "load_questions",
    "shared_index",
    "split_key",
]

#: Share of question groups (documents) the hash rule puts in the test split.
TEST_FRACTION = 0.25
#: Namespace of the split hash (see :mod:`toolgym.splits`).
SPLIT_NAMESPACE = "SearchQA"
PROMPT = "Question: {question}\nSearch the documents to find the answer, then call the answer tool with a short answer."


def data_dir() -> Path:
    """The folder of SearchQA's shipped data files (inside the package)."""
    return Path(str(resources.files("toolgym.envs") / "data" / "search_qa"))


def default_corpus() -> list[dict[str, str]]:
    """XQuAD-en paragraphs (``xq`` ids) followed by the Wikipedia lead paragraphs (``wk`` ids)."""
    data = json.loads((data_dir() / "xquad.en.json").read_text(encoding="utf-8"))
    docs: list[dict[str, str]] = []
    for article in data["data"]:
        title = article["title"].replace("_", " ")
        for paragraph in article["paragraphs"]:
            docs.append({"id": f"xq{len(docs):04d}", "title": title, "text": paragraph["context"]})
    with gzip.open(data_dir() / "wiki_vital_summaries_en.json.gz", "rt", encoding="utf-8") as fh:
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
    data = json.loads((data_dir() / "xquad.en.json").read_text(encoding="utf-8"))
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


def load_questions(path: str | Path) -> list[Task]:
    tasks, explicit, places = [], [], []
    ids = UniqueIds(path, "question")
    for lineno, record in iter_records(path, required=("id", "question", "answers"), kind="question"):
        where = f"{path}:{lineno}"
        qid = require_id(record, where, "question")
        question = require_text(record, "question", where, "question")
        answers = record["answers"]
        if isinstance(answers, str):
            answers = [answers]
        if (
            not isinstance(answers, list)
            or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)
        ):
            raise ConfigError(f"{where}: question {qid!r}: 'answers' must be a non-empty list of strings")
        ids.add(qid, lineno)
        gold = record.get("gold_doc")
        if gold is not None and (isinstance(gold, bool) or not isinstance(gold, str | int)):
            raise ConfigError(
                f"{where}: 'gold_doc' must be a document id (a string), got {type(gold).__name__}"
            )
        meta = {k: v for k, v in record.items() if k not in ("id", "answers", "split")}
        if gold is not None:
            meta["gold_doc"] = str(gold)
        tasks.append(Task(qid, PROMPT.format(question=question), answers, meta))
        explicit.append(record_split(record.get("split"), where))
        places.append(where)
    if not tasks:
        raise ConfigError(f"{path}: no questions")
    return _label(tasks, explicit, places)


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    docs = []
    ids = UniqueIds(path, "document")
    for lineno, r in iter_records(path, required=("id", "text"), kind="document"):
        where = f"{path}:{lineno}"
        doc_id = require_id(r, where, "document")
        ids.add(doc_id, lineno)
        title = r.get("title", "")
        if not isinstance(title, str):
            raise ConfigError(f"{where}: document 'title' must be a string, got {type(title).__name__}")
        docs.append({"id": doc_id, "title": title, "text": require_text(r, "text", where, "document")})
    if not docs:
        raise ConfigError(f"{path}: no documents")
    return docs


_INDEXES: dict[tuple[str, str, RetrieverSettings], Any] = {}
_INDEX_LOCK = threading.Lock()


def shared_index(key: str, settings: RetrieverSettings, docs_factory: Any) -> Any:
    """One index per (corpus, retriever settings, cache directory) per process; the index layer caches
    it on disk (a process that moves ``TOOLGYM_CACHE`` never reads an index from the old place)."""
    from toolgym.tools.search.index import cache_dir
    from toolgym.tools.search.retriever import open_retriever

    where = (key, str(cache_dir()), settings)
    with _INDEX_LOCK:
        if where not in _INDEXES:
            _INDEXES[where] = open_retriever(docs_factory, settings)
        return _INDEXES[where]
