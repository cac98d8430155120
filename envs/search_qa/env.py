"""``SearchQAEnv``: the environment itself, its three tools and its worked first turn."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolgym.core import FunctionTool, Message, Task, Tool
from toolgym.env import ToolEnv
from toolgym.envs.search_qa.data import (
    PROMPT,
    default_corpus,
    default_questions,
    load_corpus,
    load_questions,
    shared_index,
)
from toolgym.envs.search_qa.hard import hard_questions, select_copy_fails, shown_answer
from toolgym.envs.search_qa.search_results import DEFAULT_K, MAX_K, format_results
from toolgym.envs.search_qa.verifier import ExactMatchVerifier
from toolgym.errors import ConfigError, ToolCallError, did_you_mean
from toolgym.parsing import format_tool_call
from toolgym.splits import check_split, select_split
from toolgym.tool_use import ToolUse, search_measures
from toolgym.tools.search.retriever import RetrieverSettings

__all__ = ["QUESTION_SETS", "SELECTIONS", "SearchQAEnv"]

#: The built-in question sets that ``questions=`` names (any other value is a path): the XQuAD questions
#: (the default) and the hard set, on which searching the question itself fails
#: (:mod:`~toolgym.envs.search_qa.hard`).
QUESTION_SETS = ("xquad", "hard")
#: What ``select=`` accepts: every question, or those on which copying the question fails.
SELECTIONS = ("all", "copy-fails")


def _question_set(questions: str | Path | None) -> str | None:
    """The built-in set ``questions`` names (``None``: the default), or ``None`` for a path.

    A bare word that is neither a set nor an existing file is refused with a suggestion, so a typo of
    a set's name is not read as a missing file.
    """
    if questions is None:
        return "xquad"
    if isinstance(questions, str) and questions in QUESTION_SETS:
        return questions
    text = str(questions)
    if isinstance(questions, str) and not Path(text).exists() and re.fullmatch(r"[\w-]+", text):
        raise ConfigError(
            f"questions={text!r} is neither a built-in question set nor a file.{did_you_mean(text, QUESTION_SETS)} "
            f"Built-in sets: {', '.join(QUESTION_SETS)}; anything else is a path to a JSONL file"
        )
    return None


class SearchQAEnv(ToolEnv):
    """Search-based question answering (see :mod:`toolgym.envs.search_qa`).

    Args:
        corpus: JSONL of ``{"id", "title", "text"}`` documents; default: XQuAD + Wikipedia.
        questions: JSONL of ``{"id", "question", "answers": [...]}`` (optional ``gold_doc``, ``split``),
            or a built-in set (:data:`QUESTION_SETS`): ``"xquad"`` (default, XQuAD-en) or ``"hard"``
            (questions whose own words do not find their answer; :mod:`~toolgym.envs.search_qa.hard`).
            A file is required with ``corpus``: the built-in questions are about the built-in
            documents, so scoring them against another corpus would be silently wrong.
        select: ``"all"`` (default) or ``"copy-fails"``: keep only the questions on which searching
            the question itself fails and another query works (the test of
            :func:`~toolgym.envs.search_qa.hard.select_copy_fails`, with this environment's search);
            a selection that leaves fewer than 100 questions in ``split`` is refused.
        split: ``"train"``, ``"test"`` or ``"all"`` (default: every question);
            see the module docstring for the rule.
        backend: the BM25 engine, ``"default"`` (in-process BM25) or ``"pyserini"`` (Lucene).
        retriever: ``"bm25"`` (default), ``"dense"`` (a sentence encoder's inner product) or
            ``"hybrid"`` (both, fused by reciprocal rank); see :mod:`toolgym.tools.search.retriever`.
        encoder: the dense encoder's directory (``dense`` and ``hybrid``); default: the shipped
            all-MiniLM-L6-v2.
        query_prefix, passage_prefix: the encoder's prefixes when its model card asks for them (e5:
            ``"query: "``, ``"passage: "``); default: the encoder's own, else none.
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
        select: str = "all",
        backend: str = "default",
        retriever: str = "bm25",
        encoder: str | Path | None = None,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
        metric: str = "em",
        max_turns: int = 6,
        demonstration: bool = True,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.show_demonstration = demonstration
        self.verifier = ExactMatchVerifier(metric)
        check_split(split)
        if select not in SELECTIONS:
            raise ConfigError(
                f"unknown select {select!r}.{did_you_mean(str(select), SELECTIONS)} Choose one of: "
                + ", ".join(SELECTIONS)
            )
        search = RetrieverSettings.from_args(retriever, backend, encoder, query_prefix, passage_prefix)
        builtin = _question_set(questions)
        if corpus is not None and builtin is not None:
            given = (
                "without questions=: the built-in XQuAD questions are"
                if questions is None
                else f"with questions={questions!r}: the built-in question set is"
            )
            raise ConfigError(
                f"corpus={str(corpus)!r} was given {given} about the built-in documents and would be "
                "scored against yours. Pass "
                'questions=\'questions.jsonl\' (one {"id", "question", "answers"} per line, see '
                "environments.md), or drop corpus= to use the built-in data"
            )
        if builtin == "hard":
            tasks = hard_questions()
        else:
            tasks = default_questions() if builtin == "xquad" else load_questions(str(questions))
        if corpus is None:
            self.index = shared_index("default", search, default_corpus)
        else:
            path = Path(corpus).resolve()
            self.index = shared_index(str(path), search, lambda: load_corpus(path))
        if select == "copy-fails":
            tasks = select_copy_fails(tasks, self.index, split=split)
        self.selection = select_split(tasks, split)
        self.split = split
        self.tasks = list(self.selection.tasks)
        self._tool_list = self._make_tools()

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        return self._tool_list

    def provenance(self) -> dict[str, Any]:
        """The search index behind the tools (for run manifests): for a dense or hybrid retriever, the
        encoder's hash and settings and the fusion rule, so runs of two retrievers never compare."""
        return {"index": self.index.provenance}

    def tool_use_metrics(self, task: Task, calls: Sequence[ToolUse], answer: Any) -> dict[str, float]:
        """The shared search measures against the question, whether a result showed a gold answer
        (``use/answer_shown``) or the answer given (``use/answer_in_results``), as whole SQuAD words, and
        whether the gold paragraph's id appeared (``use/gold_doc_shown``)."""
        question = str(task.metadata.get("question", "")) or task.prompt
        out = search_measures(calls, question=question)
        shown = "\n".join(c.output for c in calls)
        golds = [str(g) for g in task.reference] if isinstance(task.reference, list | tuple) else []
        out["use/answer_shown"] = float(shown_answer(shown, golds) is not None)
        gold_doc = task.metadata.get("gold_doc")
        if gold_doc is not None:  # the paragraph that answers it was listed or opened
            out["use/gold_doc_shown"] = float(f"[{gold_doc}]" in shown)
        if answer is not None:
            out["use/answer_in_results"] = float(shown_answer(shown, [str(answer)]) is not None)
        return out

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

        def search(query: str, k: int = DEFAULT_K) -> str:
            """Search the document collection. Returns up to k results as [doc_id] title: snippet.

            Args:
                query: words to search for
                k: number of results, 1-10
            """
            if not query.strip():
                raise ToolCallError("empty query: pass the words to search for", tool="search")
            if not 1 <= k <= MAX_K:
                raise ToolCallError(f"k must be between 1 and {MAX_K}, got {k}", tool="search")
            return format_results(index, index.search(query, k=k))

        def open_doc(doc_id: str) -> str:
            """Read the full text of a document by its id.

            Args:
                doc_id: id from search results
            """
            try:
                doc = index.get(doc_id.strip())
            except KeyError:
                raise ToolCallError(
                    f"no document with id {doc_id!r}; use an id from the search results", tool="open"
                ) from None
            return f"[{doc['id']}] {doc['title']}\n{doc['text']}"

        def answer(answer: str) -> str:
            """Give the final answer (a short phrase). Ends the episode."""
            return answer  # a terminal tool's function is its signature: the environment never runs it

        return [
            FunctionTool.from_function(search, timeout=10.0),
            FunctionTool.from_function(open_doc, name="open", timeout=10.0),
            FunctionTool.from_function(answer, terminal=True),
        ]
