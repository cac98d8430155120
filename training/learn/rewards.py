"""The reward the learner optimises (a pure function of a trajectory).

Kept apart from the trainer so that the learner's arithmetic (reward -> advantage -> loss) can be read
and tested without the loop; :mod:`toolgym.training.trainer` re-exports :func:`shaped_reward`.
"""

from __future__ import annotations

from toolgym.core import Trajectory

__all__ = ["shaped_reward"]


def shaped_reward(trajectory: Trajectory, format_credit: float, answer_tool: str) -> float:
    """The reward the learner optimises: the environment's (verifier's) reward plus optional credit.

    With ``format_credit = c > 0`` an episode earns ``c / 2`` for ending through the ``answer_tool``
    call and ``c / 2`` for at least one successful non-terminal tool call, both only when no turn had a
    parse error. This is a documented training aid for small models that first need to learn the call
    format; the trajectory's own ``reward`` stays the verifier's and is what ``reward/mean`` reports.
    """
    if format_credit == 0.0 or trajectory.status == "infra_error":
        return trajectory.reward
    m = trajectory.metrics
    if m.get("env/parse_errors", 0.0) > 0:
        return trajectory.reward
    answered = m.get(f"tool/{answer_tool}/calls", 0.0) > 0
    used = any(
        k.endswith("/calls")
        and k.startswith("tool/")
        and k != f"tool/{answer_tool}/calls"
        and v > m.get(k[: -len("calls")] + "errors", 0.0)
        for k, v in m.items()
    )
    return trajectory.reward + format_credit * (0.5 * answered + 0.5 * used)
