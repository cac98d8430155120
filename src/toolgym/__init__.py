"""toolgym: multi-turn tool-use environments, policies and RL training for language-model agents.

Importing toolgym registers every environment with gymnasium (``toolgym/<Name>-v<N>``), so
``gymnasium.make("toolgym/SearchQA-v0")`` works after ``import toolgym``.
"""

from __future__ import annotations

from toolgym.core import (
    Completion,
    FunctionTool,
    Harness,
    Message,
    Policy,
    SamplingParams,
    Score,
    Task,
    Tool,
    Trajectory,
    Verifier,
)
from toolgym.env import ToolEnv
from toolgym.errors import (
    BackendError,
    ConfigError,
    InfraError,
    SandboxError,
    ToolCallError,
    ToolError,
    ToolgymError,
    ToolParseError,
    ToolTimeout,
)
from toolgym.parsing import ParsedTurn, ToolCall, parse
from toolgym.registry import env_ids, make, register_all

__version__ = "0.1.0"

register_all()

__all__ = [
    "BackendError",
    "Completion",
    "ConfigError",
    "FunctionTool",
    "Harness",
    "InfraError",
    "Message",
    "ParsedTurn",
    "Policy",
    "SamplingParams",
    "SandboxError",
    "Score",
    "Task",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "ToolError",
    "ToolParseError",
    "ToolTimeout",
    "ToolgymError",
    "Trajectory",
    "Verifier",
    "env_ids",
    "make",
    "parse",
    "register_all",
]
