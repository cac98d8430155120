"""ArxivRefs' own entries for ``toolgym audit-env``: answers built from the collection, not the paper.

The generic library only plays what a policy sees in one episode. These two use what a policy could
learn about the collection across episodes, without reading the task's context:

* ``whole-collection``: every id the episode's tools could ever return (the collection minus the
  task's banned ids) submitted at once. Recall is 1 by construction; only precision in the F1 stops it.
* ``most-cited``: the 20 ids cited by the most *other* tasks of the environment, the same list for
  every task: a popularity prior that never looks at the context.

One generic exploit is accepted (:func:`audit_accepted`): ``every-candidate`` searches with the whole
prompt and submits the 10 results. That is retrieval, the task's own floor, not reward for nothing,
and precision in the F1 makes submitting more ids cost; it is accepted on up to 20% of tasks
(environments.md gives its measured share), and fails the audit above that.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from toolgym.envs.audit import Accepted, Episode, Exploit

__all__ = ["audit_accepted", "audit_exploits"]

POPULAR = 20


def _whole_collection(ep: Episode) -> Iterator[str]:
    env = ep.env
    banned = env.banned_for(env.task)
    yield ep.answer_call([cid for cid in env.collection.records if cid not in banned])


def _most_cited(ep: Episode) -> Iterator[str]:
    env = ep.env
    task = env.task
    counts = Counter(cid for other in env.tasks if other.id != task.id for cid in other.reference)
    banned = env.banned_for(task)
    popular = [cid for cid, _ in counts.most_common() if cid not in banned][:POPULAR]
    yield ep.answer_call(popular)


def audit_exploits() -> list[Exploit]:
    """The ArxivRefs entries (see the module docstring)."""
    return [
        Exploit(
            "whole-collection",
            "every id the tools could return, submitted at once (recall 1, precision-free)",
            _whole_collection,
        ),
        Exploit(
            "most-cited",
            f"the {POPULAR} ids most cited by the other tasks, whatever the task",
            _most_cited,
        ),
    ]


def audit_accepted() -> list[Accepted]:
    """The exceptions ArxivRefs documents (see the module docstring and environments.md)."""
    return [
        Accepted(
            "every-candidate",
            "searching with the whole prompt and submitting the results is retrieval, the task's floor, "
            "and precision is part of the F1",
            max_share=0.2,
        )
    ]
