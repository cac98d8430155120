"""SearchQA's hard questions: questions whose own words do not find their answer, but other words do.

Why: searching an XQuAD question as it is (copying it as the query) shows its gold paragraph among the
search tool's default :data:`~toolgym.envs.search_qa.search_results.DEFAULT_K` results for 1,132 of the 1,190
questions (BM25 over the shipped collection), so a policy that copies the question never needs another
query, and only 58 questions are left where copying fails. The hard set (``questions="hard"``) is built
so that copying fails on every question while a query made from a part of the question, or from a name
shown by a first search, succeeds.

**The test** (:func:`copy_outcome`, :func:`reaches`), run with the environment's own search and result
text (:func:`~toolgym.envs.search_qa.search_results.format_results`, ``k = 3``): searching the question itself
shows neither the gold document, nor a gold answer (as whole words, lower-cased, articles dropped:
:func:`shown_answer`; anywhere in the shown titles and snippets), nor a shown document whose full text
holds a gold answer (so copying and then opening a
result fails too); and the question's ``hops`` (stored with it) reach the answer: after some hop a gold
answer is shown, or the gold document is shown and holds it (one ``open`` away). A hop that uses a name
(``bridge``) is only taken once a search result has shown that name.

**Construction** (:func:`build_hard_questions`: deterministic, from the shipped files only). Mentions are
Wikipedia titles found verbatim in a text (not single common words, not part of a longer capitalised
name, not a bare personal name); descriptions are the Wikipedia short descriptions shipped with the
lead paragraphs (without parentheses). A description stands for one article: in the whole collection
where it points to the article to find (B below), among the articles the text names where it picks a
name out of that text (C in B, E in A).

* ``bridge`` — an XQuAD question that names an entity E with a Wikipedia article, with the name replaced
  by "the <E's description> mentioned in the article on <A>", A the first article (in id order) that
  names E and makes copying fail. Hops: the question itself (its results show E's name), then the question
  with E's name put back. Gold: the XQuAD paragraph; answers: XQuAD's.
* ``chain`` — "Which <C's description> is named in the article on the <B's description>?", C named in
  article B. Hops: B's description (B's snippet, or B opened, shows C), or C's description (C's title
  is shown). Gold: B; answer: C's title; one question per B and per answer.
* ``year`` — "What is the first year mentioned in the article on the <B's description> named in the
  article on <A>?", for articles B with no digit before that year. Hops: B's description, or the
  question itself (A's snippet shows B's name) and then B's name. Gold: B; answer: the year.

Questions are grouped by gold document and split by the rule of :mod:`~toolgym.envs.search_qa.data`
(bridge questions share the XQuAD paragraphs' split, so no hard test paragraph is a default training
paragraph either). The shipped file is :data:`HARD_FILE`; ``python -m toolgym.envs.search_qa.hard``
rebuilds it, and a test checks that it equals a fresh build. :func:`select_copy_fails` applies the same
test to any question set (``select="copy-fails"``) and refuses a selection too small to use.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolgym.core import Task
from toolgym.envs.search_qa.data import data_dir, default_corpus, default_questions, load_questions
from toolgym.envs.search_qa.search_results import DEFAULT_K, format_results
from toolgym.errors import ConfigError
from toolgym.splits import hash_split

__all__ = [
    "HARD_FILE",
    "MIN_QUESTIONS",
    "TEMPLATES",
    "CopyOutcome",
    "build_hard_questions",
    "copy_outcome",
    "hard_questions",
    "reaches",
    "select_copy_fails",
    "shown_answer",
]

#: The shipped hard set, in the SearchQA data folder (JSONL, one question per line).
HARD_FILE = "hard_questions.jsonl"
#: Fewest questions a split of a selection may hold: below it a selection is refused as too small to
#: train or evaluate on (a held-out figure over fewer questions has an interval too wide to read).
MIN_QUESTIONS = 100
#: The constructions, in the order the file lists them.
TEMPLATES = ("bridge", "chain", "year")

_WORD = re.compile(r"\w+")
_YEAR = re.compile(r"(?<![\w,.])(1[0-9]{3}|20[0-2][0-9])(?![\w,])")
_PARENS = re.compile(r"\s*\([^)]*\)")
#: Words after which a name cannot become "the <description>".
_QUANTIFIERS = frozenset({"many", "much", "few", "which", "what", "whose", "whom", "every", "each", "no"})


def _words(text: str) -> str:
    """Lower-case words, articles dropped, one space apart: SQuAD's normalisation, but splitting at every
    non-word character (an en dash too), so "1890–1911" shows 1890."""
    return " ".join(w for w in _WORD.findall(text.lower()) if w not in ("a", "an", "the"))


def shown_answer(text: str, answers: Iterable[str]) -> str | None:
    """The shortest gold answer that ``text`` shows as a run of whole words (:func:`_words`); else None."""
    words = f" {_words(text)} "
    for answer in sorted(answers, key=len):
        wanted = _words(answer)
        if wanted and f" {wanted} " in words:
            return answer
    return None


@dataclass(frozen=True)
class CopyOutcome:
    """What one search with the question itself shows."""

    #: The gold document is among the results.
    gold_shown: bool
    #: A gold answer is in the shown titles and snippets.
    answer_shown: bool
    #: A shown document's full text holds a gold answer (copying and then opening it would find it).
    answer_behind: bool

    @property
    def fails(self) -> bool:
        return not (self.gold_shown or self.answer_shown or self.answer_behind)


def copy_outcome(
    index: Any, question: str, answers: Sequence[str], gold_doc: str | None, k: int = DEFAULT_K
) -> CopyOutcome:
    """Search ``question`` as the search tool does (``k`` results) and say what it shows."""
    hits = index.search(question, k=k)
    ids = [hit.doc_id for hit in hits]
    return CopyOutcome(
        gold_shown=gold_doc in ids,
        answer_shown=shown_answer(format_results(index, hits), answers) is not None,
        answer_behind=any(shown_answer(index.get(i)["text"], answers) is not None for i in ids),
    )


def reaches(
    index: Any,
    hops: Sequence[str],
    answers: Sequence[str],
    gold_doc: str | None,
    bridge: str | None = None,
    k: int = DEFAULT_K,
) -> bool:
    """Whether searching ``hops`` in order reaches a gold answer (see the module docstring).

    A hop containing ``bridge`` is only searched once an earlier result has shown ``bridge``.
    """
    seen = ""
    for hop in hops:
        if bridge is not None and bridge in hop and bridge not in seen:
            return False
        hits = index.search(hop, k=k)
        text = format_results(index, hits)
        if shown_answer(text, answers) is not None:
            return True
        opened = gold_doc in [hit.doc_id for hit in hits]  # one `open` away
        if opened and shown_answer(index.get(gold_doc)["text"], answers) is not None:
            return True
        seen += "\n" + text
    return False


def hard_questions() -> list[Task]:
    """The shipped hard set (:data:`HARD_FILE`), labelled with its split."""
    return load_questions(data_dir() / HARD_FILE)


# --- selection ---------------------------------------------------------------------------------------

#: Why each task was removed (``None``: kept), per (index, task ids, k): environments of one process share it.
_SELECTIONS: dict[tuple[int, tuple[str, ...], int], list[str | None]] = {}


def select_copy_fails(tasks: Sequence[Task], index: Any, *, split: str, k: int = DEFAULT_K) -> list[Task]:
    """The tasks on which copying the question fails and another query works (module docstring).

    The other queries: the task's own ``hops`` (``metadata["hops"]``, with its ``bridge``), else the
    gold document's title (a check that it can be found at all). Every task needs a ``gold_doc``.

    Raises:
        ConfigError: a task has no ``gold_doc``, or ``split`` (``"all"``: every split) keeps fewer than
            :data:`MIN_QUESTIONS`; the message says how many each reason removed.
    """
    missing = [t.id for t in tasks if t.metadata.get("gold_doc") is None]
    if missing:
        raise ConfigError(
            f"select='copy-fails' needs each question's gold document: {len(missing)} questions have no "
            f"'gold_doc' (first: {missing[0]!r}). Add it to the question records"
        )
    key = (id(index), tuple(t.id for t in tasks), k)
    if key not in _SELECTIONS:
        _SELECTIONS[key] = [_removal(index, task, k) for task in tasks]
    why = collections.Counter[str]()
    kept = []
    for task, reason in zip(tasks, _SELECTIONS[key], strict=True):
        if reason is None:
            kept.append(task)
        else:
            why[reason] += 1
    counts = collections.Counter(t.metadata["split"] for t in kept)
    counted = len(kept) if split == "all" else counts[split]
    if counted < MIN_QUESTIONS:
        reasons = ", ".join(f"{n} {reason}" for reason, n in why.most_common()) or "none removed"
        raise ConfigError(
            f"select='copy-fails' keeps {counted} questions in split {split!r} (train {counts['train']}, "
            f"test {counts['test']}, of {len(tasks)} questions), fewer than the {MIN_QUESTIONS} needed to "
            f"train or evaluate on. Removed: {reasons}. Searching a question as it is (k={k}) finds the "
            "answer for most questions written from their passage; use questions='hard' (built so that "
            "copying fails), or bring more questions"
        )
    return kept


def _removal(index: Any, task: Task, k: int) -> str | None:
    """Why ``task`` fails the test of the module docstring, or ``None`` when it passes."""
    meta = task.metadata
    answers = list(task.reference) if isinstance(task.reference, list | tuple) else [str(task.reference)]
    question = str(meta.get("question", task.prompt))
    gold = str(meta["gold_doc"])
    outcome = copy_outcome(index, question, answers, gold, k)
    if outcome.gold_shown:
        return "because the question itself shows the gold document"
    if outcome.answer_shown:
        return "because the question itself shows a gold answer"
    if outcome.answer_behind:
        return "because a document the question shows holds a gold answer"
    hops = meta.get("hops")
    if isinstance(hops, list) and hops:
        found = reaches(index, [str(h) for h in hops], answers, gold, meta.get("bridge"), k)
    else:
        try:
            title = index.get(gold)["title"]
        except KeyError:
            return "because the gold document is not in the collection"
        found = bool(title) and reaches(index, [title], answers, gold, None, k)
    return None if found else "because no other query reaches the answer"


# --- construction ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Article:
    id: str
    title: str
    text: str
    description: str  # cleaned; "" when none
    topic: str


class _Collection:
    """The shipped collection with what the constructions read: descriptions, mentions, common words."""

    def __init__(self) -> None:
        with gzip.open(data_dir() / "wiki_vital_summaries_en.json.gz", "rt", encoding="utf-8") as fh:
            wiki = json.load(fh)
        self.docs = default_corpus()
        self.by_id = {d["id"]: d for d in self.docs}
        self.articles: list[_Article] = []
        for i, key in enumerate(sorted(wiki)):  # default_corpus's order and ids
            entry = wiki[key]
            self.articles.append(
                _Article(
                    f"wk{i:05d}",
                    entry["title"],
                    entry["extract"],
                    _clean(entry.get("description")),
                    entry["topic"],
                )
            )
        self.by_title = {a.title: a for a in self.articles}
        self.lower_titles = {a.title.lower() for a in self.articles} | {d["title"].lower() for d in self.docs}
        self.lower_words = collections.Counter(
            w for d in self.docs for w in re.findall(r"\b[a-z][a-z-]+\b", d["text"])
        )
        descriptions = collections.Counter(a.description.lower() for a in self.articles if a.description)
        self.unique_description = {a.title for a in self.articles if descriptions[a.description.lower()] == 1}
        self._first: dict[str, list[str]] = collections.defaultdict(list)
        for a in self.articles:
            if self.mentionable(a.title, a.topic):
                self._first[_WORD.match(a.title).group()].append(a.title)  # type: ignore[union-attr]
        for titles in self._first.values():
            titles.sort(key=lambda t: (-len(t), t))
        self.mentioned_by: dict[str, list[_Article]] = collections.defaultdict(list)
        for a in self.articles:
            for title in dict.fromkeys(t for t, _ in self.mentions(a.text)):
                if title != a.title:
                    self.mentioned_by[title].append(a)

    def common(self, word: str) -> bool:
        return self.lower_words[word.lower()] >= 3

    def mentionable(self, title: str, topic: str) -> bool:
        """Whether a title found in a text names its article: not a common word, not a bare personal
        name (a statue called "David"), nothing the text cannot spell (parentheses)."""
        if len(title) < 4 or "(" in title or not _WORD.match(title):
            return False
        return " " in title or not (self.common(title) or topic == "People")

    def mentions(self, text: str) -> Iterator[tuple[str, int]]:
        """(title, position) of each article title named in ``text``, longest first, left to right."""
        words = list(_WORD.finditer(text))
        end = -1
        for i, word in enumerate(words):
            start = word.start()
            if start < end or (start > 0 and (text[start - 1].isalnum() or text[start - 1] == "_")):
                continue
            for title in self._first.get(word.group(), ()):
                stop = start + len(title)
                if not text.startswith(title, start) or (
                    stop < len(text) and (text[stop].isalnum() or text[stop] == "_")
                ):
                    continue
                if self._inside_name(text, words, i, stop):
                    break
                end = stop
                yield title, start
                break

    def _inside_name(self, text: str, words: Sequence[re.Match[str]], i: int, stop: int) -> bool:
        """Whether the match is part of a longer capitalised name ("Saxon Garden", "David Hume")."""
        before = words[i - 1] if i > 0 else None
        after = next((w for w in words[i + 1 :] if w.start() >= stop), None)
        neighbours = []
        if before is not None and text[before.end() : words[i].start()] == " ":
            neighbours.append(before.group())
        if after is not None and text[stop : after.start()] == " ":
            neighbours.append(after.group())
        return any(word[0].isupper() and not self.common(word) for word in neighbours)

    def phrase(self, description: str) -> str:
        """A description as a noun phrase after "the": leading article dropped, a common first word lowered."""
        words = description.split()
        if words[0].lower() in ("a", "an", "the") and len(words) > 1:
            words = words[1:]
        first = words[0]
        if first[1:].islower() and self.common(first):
            words[0] = first[0].lower() + first[1:]
        return " ".join(words)


def _the(phrase: str) -> str:
    return phrase if phrase.lower().startswith(("one of ", "any ")) else f"the {phrase}"


def _clean(description: Any) -> str:
    text = _PARENS.sub("", str(description or "")).strip().rstrip(".").strip()
    return "" if ";" in text else text


def _leaks(question: str, answers: Sequence[str]) -> bool:
    lowered = question.lower()
    return shown_answer(question, answers) is not None or any(a.lower() in lowered for a in answers)


def _record(
    qid: str,
    question: str,
    answers: Sequence[str],
    gold: str,
    template: str,
    hops: Sequence[str],
    bridge: str | None,
    source: dict[str, str],
) -> dict[str, Any]:
    return {
        "id": qid,
        "question": question,
        "answers": list(answers),
        "gold_doc": gold,
        "template": template,
        "hops": list(hops),
        "bridge": bridge,
        "source": "searchqa-hard",
        "built_from": source,
    }


def _bridge_questions(c: _Collection, index: Any) -> Iterator[dict[str, Any]]:
    for task in default_questions():
        text = str(task.metadata["question"])
        gold = str(task.metadata["gold_doc"])
        answers = list(task.reference)
        spans = [(t, t, p) for t, p in c.mentions(text)]
        article = c.by_title.get(c.by_id[gold]["title"])
        if article is not None and not any(t == article.title for t, _, _ in spans):
            for alias in (article.title + "s", article.title.split()[-1]):
                found = re.search(rf"(?<!\w){re.escape(alias)}(?!\w)", text)
                if found and (alias == article.title + "s" or article.topic == "People"):
                    spans.append((article.title, alias, found.start()))
                    break
        for title, alias, start in spans:
            record = _bridge(c, index, task.id, text, gold, answers, title, alias, start)
            if record is not None:
                yield record
                break


def _bridge(
    c: _Collection,
    index: Any,
    qid: str,
    text: str,
    gold: str,
    answers: list[str],
    title: str,
    alias: str,
    start: int,
) -> dict[str, Any] | None:
    """The bridge question for one named entity, or None when it reads badly or copying works."""
    entity = c.by_title[title]
    stop = start + len(alias)
    before, after = text[:start], text[stop:]
    if not entity.description or after.startswith(("'", "\u2019")) or re.match(r"\s+[A-Z]", after):
        return None  # a possessive or a longer name ("Palestine Prime Minister") would read badly
    previous = re.search(r"(\w+)\s+$", before)
    if previous and f"{previous.group(1)} {alias}".lower() in c.lower_titles:
        return None  # part of a longer title ("southern California")
    if previous and previous.group(1).lower() in _QUANTIFIERS:
        return None  # "How many Huguenots" cannot become "How many the <description>"
    if previous and previous.group(1).lower() == "the":
        before = before[: previous.start()]  # "the Rhine" -> "the <description> ..."
    named = text[:start] + title + text[stop:]
    for host in c.mentioned_by.get(title, ()):
        if "," in host.title or "(" in host.title:
            continue  # "Frederick II, Holy Roman Emperor" inside a sentence reads as a list
        rivals = [t for t, _ in c.mentions(host.text) if t != title]
        if any(c.by_title[t].description.lower() == entity.description.lower() for t in rivals):
            continue  # the host names two of a kind: the pointer would be ambiguous
        pointer = f"{_the(c.phrase(entity.description))} mentioned in the article on {host.title}"
        question = before + pointer + after
        if _leaks(question, answers) or alias in question or title in question:
            continue
        if not copy_outcome(index, question, answers, gold).fails:
            continue
        hops = [question, named]
        if reaches(index, hops, answers, gold, title):
            source = {"xquad": qid, "entity": entity.id, "host": host.id}
            return _record(f"{qid}-bridge", question, answers, gold, "bridge", hops, title, source)
    return None


def _chain_questions(c: _Collection, index: Any) -> Iterator[dict[str, Any]]:
    used_answers: set[str] = set()
    for b in c.articles:
        if not b.description or b.title not in c.unique_description:
            continue
        named = [t for t in dict.fromkeys(t for t, _ in c.mentions(b.text)) if t != b.title]
        counts = collections.Counter(c.by_title[t].description.lower() for t in named)
        for title in named:
            answer = c.by_title[title]
            if title in used_answers or not answer.description or counts[answer.description.lower()] > 1:
                continue
            if b.title.lower() in answer.description.lower():
                continue
            question = (
                f"Which {c.phrase(answer.description)} is named in the article on "
                f"{_the(c.phrase(b.description))}?"
            )
            if _leaks(question, [title]) or not copy_outcome(index, question, [title], b.id).fails:
                continue
            hops = next(
                (h for h in ([b.description], [answer.description]) if reaches(index, h, [title], b.id)), None
            )
            if hops is None:
                continue
            used_answers.add(title)
            yield _record(
                f"chain-{b.id}-{answer.id}",
                question,
                [title],
                b.id,
                "chain",
                hops,
                None,
                {"article": b.id, "answer": answer.id},
            )
            break


def _year_questions(c: _Collection, index: Any) -> Iterator[dict[str, Any]]:
    for b in c.articles:
        if not b.description or b.title not in c.unique_description:
            continue
        found = _YEAR.search(b.text)
        if found is None or any(ch.isdigit() for ch in b.text[: found.start()]):
            continue
        year = found.group(1)
        era = re.match(r"\s+(BCE?|CE|AD)\b", b.text[found.end() :])
        answers = [year, f"{year} {era.group(1)}"] if era else [year]
        for host in c.mentioned_by.get(b.title, ()):
            others = [t for t, _ in c.mentions(host.text) if t != b.title]
            if any(c.by_title[t].description.lower() == b.description.lower() for t in others):
                continue
            if "," in host.title:
                continue
            question = (
                f"What is the first year mentioned in the article on {_the(c.phrase(b.description))} named "
                f"in the article on {host.title}?"
            )
            if _leaks(question, answers) or not copy_outcome(index, question, answers, b.id).fails:
                continue
            routes = (([b.description], None), ([question, b.title], b.title))
            route = next((r for r in routes if reaches(index, r[0], answers, b.id, r[1])), None)
            if route is None:
                continue
            yield _record(
                f"year-{b.id}-{host.id}",
                question,
                answers,
                b.id,
                "year",
                route[0],
                route[1],
                {"article": b.id, "host": host.id},
            )
            break


def build_hard_questions(index: Any = None, *, minimum: int = MIN_QUESTIONS) -> list[dict[str, Any]]:
    """Build the hard set from the shipped data (module docstring); the records of :data:`HARD_FILE`.

    Args:
        index: the collection's search index; default: the environment's BM25 index of the shipped data.
        minimum: fewest questions each split must hold.

    Raises:
        ConfigError: a split holds fewer than ``minimum`` questions (the message gives the counts).
    """
    if index is None:
        from toolgym.envs.search_qa.data import shared_index
        from toolgym.tools.search.retriever import RetrieverSettings

        index = shared_index("default", RetrieverSettings(), default_corpus)
    c = _Collection()
    records = [*_bridge_questions(c, index), *_chain_questions(c, index), *_year_questions(c, index)]
    _check_size(records, minimum)
    return records


def _check_size(records: Sequence[dict[str, Any]], minimum: int) -> None:
    from toolgym.envs.search_qa.data import SPLIT_NAMESPACE, TEST_FRACTION

    splits = collections.Counter(
        hash_split(f"doc:{r['gold_doc']}", namespace=SPLIT_NAMESPACE, test_fraction=TEST_FRACTION)
        for r in records
    )
    short = [s for s in ("train", "test") if splits[s] < minimum]
    if short:
        by_template = collections.Counter(r["template"] for r in records)
        raise ConfigError(
            f"the hard question set has train {splits['train']}, test {splits['test']} questions "
            f"({', '.join(f'{t} {by_template[t]}' for t in TEMPLATES)}): {' and '.join(short)} below the "
            f"minimum of {minimum}. Copying the question must fail and a hop must reach the answer, which "
            "few candidates pass; lower the minimum only knowingly"
        )


def write_hard_questions(records: Sequence[dict[str, Any]], path: str | Path) -> None:
    Path(path).write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Rebuild SearchQA's hard question set from the shipped data."
    )
    parser.add_argument(
        "--out", default=str(data_dir() / HARD_FILE), help="where to write it (default: the shipped file)"
    )
    args = parser.parse_args(argv)
    records = build_hard_questions()
    write_hard_questions(records, args.out)
    counts = collections.Counter(r["template"] for r in records)
    print(
        f"wrote {len(records)} questions to {args.out}: " + ", ".join(f"{t} {counts[t]}" for t in TEMPLATES)
    )


if __name__ == "__main__":
    main()
