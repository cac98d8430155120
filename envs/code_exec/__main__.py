"""``python -m toolgym.envs.code_exec``: score every reference solution (a self-test of the verifier)."""

from __future__ import annotations

from toolgym.core import Score
from toolgym.envs.code_exec.data import DATASETS, load_tasks, reference_code
from toolgym.envs.code_exec.verifier import HiddenTestVerifier
from toolgym.errors import VerifierError
from toolgym.tools.sandbox import DockerSandbox

__all__ = ["check_references"]


def check_references(
    dataset: str = "all", *, workers: int = 2, limit: int | None = None
) -> tuple[dict[str, Score], dict[str, str]]:
    """Score every reference solution of ``dataset`` (a self-test of the verifier); show progress.

    Returns the scores by task id, and the verifier errors by task id (a sound verifier has none and
    gives reward 1 to every reference except :data:`KNOWN_BAD_REFERENCES`).
    """
    from concurrent.futures import ThreadPoolExecutor

    from rich.progress import Progress

    tasks = load_tasks(dataset)[:limit]
    scores: dict[str, Score] = {}
    errors: dict[str, str] = {}
    with (
        DockerSandbox(pool_size=2 * workers) as sandbox,
        Progress() as progress,
        ThreadPoolExecutor(workers) as pool,
    ):
        verifier = HiddenTestVerifier(sandbox)
        bar = progress.add_task(f"reference solutions ({dataset})", total=len(tasks))
        futures = {pool.submit(verifier.score, t, reference_code(t.id)): t.id for t in tasks}
        for future in futures:
            try:
                scores[futures[future]] = future.result()
            except VerifierError as exc:
                errors[futures[future]] = str(exc)
            progress.advance(bar)
    return scores, errors


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Score the reference solutions (verifier self-test).")
    parser.add_argument("--dataset", default="all", choices=[*DATASETS, "all"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    cli = parser.parse_args()
    started = time.monotonic()
    results, problems = check_references(cli.dataset, workers=cli.workers, limit=cli.limit)
    failing = sorted(tid for tid, s in results.items() if s.reward != 1.0)
    print(
        f"{len(results) - len(failing)}/{len(results)} reference solutions score 1 in {time.monotonic() - started:.0f} s"
    )
    for tid in failing:
        print(f"  {tid}: {dict(results[tid].metrics)}")
    for tid, problem in sorted(problems.items()):
        print(f"  {tid}: verifier error: {problem}")
