"""``CodeExecEnv``: the episode (a sandbox session for ``python``, ``submit`` to the hidden tests)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from toolgym.core import FunctionTool, Task, Tool
from toolgym.env import ToolEnv
from toolgym.envs.code_exec.data import label_code_tasks, load_tasks
from toolgym.envs.code_exec.verifier import HiddenTestVerifier, default_sandbox
from toolgym.errors import SandboxError, ToolTimeout
from toolgym.splits import check_split, select_split
from toolgym.tools.sandbox import DockerSandbox, ExecResult, SandboxSession

__all__ = ["CodeExecEnv"]

log = logging.getLogger(__name__)


def _format(result: ExecResult) -> str:
    text = result.stdout
    if result.stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
    notes = []
    if result.output_truncated:
        notes.append("output cut: too much output; the interpreter was restarted and its variables are lost")
    if result.oom_killed:
        notes.append("killed: out of memory; the interpreter was restarted and its variables are lost")
    elif result.cpu_time_exceeded:
        notes.append(f"killed: CPU time limit of {result.cpu_limit_s} s exceeded")
    elif result.file_size_exceeded:
        notes.append(f"file size limit of {result.file_limit_mb} MB exceeded")
    elif result.exit_code not in (0, None):
        notes.append(f"exit status {result.exit_code}")
    text = text + "".join(f"\n[{n}]" for n in notes)
    return text if text.strip() else "(no output)"


class CodeExecEnv(ToolEnv):
    """Write a function for a HumanEval or MBPP task, test it with ``python``, ``submit`` it.

    Args:
        dataset: ``"humaneval"`` (default), ``"mbpp"`` or ``"all"``.
        sandbox: the :class:`DockerSandbox` to use; the shared default when ``None`` (created on
            first use, so constructing and resetting the environment needs no Docker engine).
        tool_timeout: seconds one ``python`` call may run.
        call_timeout: seconds one hidden-test call may run.
        max_turns: assistant turns before truncation.
        split: ``"train"``, ``"test"`` or ``"all"`` (default, every problem of ``dataset``).
        render_mode: ``"ansi"`` or ``None``.
    """

    description = "Write Python functions (HumanEval / MBPP); python(code) in a Docker sandbox, submit(code) to hidden tests."

    def __init__(
        self,
        dataset: str = "humaneval",
        *,
        sandbox: DockerSandbox | None = None,
        tool_timeout: float = 10.0,
        call_timeout: float = 10.0,
        max_turns: int = 8,
        split: str = "all",
        render_mode: str | None = None,
    ) -> None:
        check_split(split)
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.dataset = dataset
        self.selection = select_split(label_code_tasks(load_tasks(dataset)), split)
        self.split = split
        self.tasks = list(self.selection.tasks)
        self._sandbox = sandbox
        self.tool_timeout = tool_timeout
        self.verifier = HiddenTestVerifier(sandbox, call_timeout=call_timeout)
        self._session: SandboxSession | None = None

    def provenance(self) -> dict[str, Any]:
        """The data set and the sandbox image the hidden tests run in, by content id (for run manifests)."""
        sandbox = self._sandbox if self._sandbox is not None else default_sandbox()
        return {"dataset": self.dataset, "sandbox_image": sandbox.image_id()}

    def _choose_task(self, options: dict[str, Any]) -> Task:
        self.selection.check_options(options)  # a task id of the other split: say so
        return super()._choose_task(options)

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        def submit(code: str) -> str:
            """Submit the complete solution code; this ends the episode.

            Args:
                code: the complete solution
            """
            return code  # a terminal tool's function is its signature: the environment never runs it

        return [
            FunctionTool.from_function(self._python, name="python", timeout=self.tool_timeout + 30.0),
            FunctionTool.from_function(submit, terminal=True),
        ]

    async def _python(self, code: str) -> str:
        """Run Python code in a sandbox (no network). Variables persist between calls; the value of a
        final expression is printed.

        Args:
            code: Python source to run
        """
        if self._session is None:
            sandbox = self._sandbox if self._sandbox is not None else default_sandbox()
            self._session = sandbox.session()
        session = self._session
        result = await asyncio.to_thread(session.run, code, timeout=self.tool_timeout)
        if result.timed_out:
            partial = (
                _format(dataclasses.replace(result, timed_out=False))
                if result.stdout or result.stderr
                else ""
            )
            raise ToolTimeout(
                f"timed out after {self.tool_timeout:g} s; the interpreter was restarted and its variables are lost"
                + (f"\n{partial}" if partial else ""),
                tool="python",
            )
        return _format(result)

    async def close_episode(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                await asyncio.to_thread(session.close)
            except SandboxError as exc:  # pragma: no cover - removal is best effort, the reaper retries
                log.warning("closing the sandbox session failed: %s", exc)
