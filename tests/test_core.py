"""Core value types: JSON round trips and range checks."""

from __future__ import annotations

import pytest

from toolgym.core import FunctionTool, SamplingParams, Task
from toolgym.errors import ConfigError, ToolCallError


def test_task_json_round_trip():
    task = Task("q1", "Where?", ["New Zealand"], {"source": "test", "n": 3})
    assert Task.from_json(task.to_json()) == task


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
        (SamplingParams(temperature=-0.1), "temperature must be >= 0"),
        (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (SamplingParams(top_p=1.01), r"top_p must be in \(0, 1\]"),
        (SamplingParams(stop=("",)), "stop must hold non-empty strings"),
    ],
)
def test_sampling_params_check(params, message):
    with pytest.raises(ConfigError, match=message):
        params.check()


def test_default_sampling_params_are_valid():
    SamplingParams().check()
    SamplingParams(temperature=0.0, top_p=1.0, stop=("</tool_call>",)).check()


# ------------------------------------------------------------------ the failure rule
def test_retry_policy_default_and_back_off_schedule():
    from toolgym.env import RetryPolicy, ToolEnv

    policy = RetryPolicy()
    assert (policy.retries, policy.backoff_s) == (2, 0.5)
    assert [policy.delay(k) for k in range(3)] == [0.5, 1.0, 2.0]
    assert ToolEnv().retry == policy


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"retries": -1}, "retries must be"), ({"backoff_s": -0.1}, "back-off must be")]
)
def test_retry_policy_rejects_bad_values(kwargs, message):
    from toolgym.env import RetryPolicy

    with pytest.raises(ConfigError, match=message):
        RetryPolicy(**kwargs)


def test_every_error_type_sits_in_exactly_one_family():
    from toolgym import errors
    from toolgym.serving.client import ServedEnvError
    from toolgym.tools.sandbox import SandboxUnavailable
    from toolgym.tools.search import UnknownDocument

    families = (
        errors.ToolError,
        errors.InfraError,
        errors.RunStopped,
        errors.ConfigError,
        errors.VerifierError,
    )
    types = [getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)]
    types += [SandboxUnavailable, UnknownDocument, ServedEnvError]
    for cls in types:
        if cls is errors.ToolgymError:
            continue
        assert sum(issubclass(cls, family) for family in families) == 1, cls
    infra = {errors.SandboxError, SandboxUnavailable, errors.BackendError, errors.PolicyError}
    assert all(issubclass(cls, errors.InfraError) for cls in infra | {errors.VerificationUnavailable})
    assert not issubclass(errors.VerifierError, errors.InfraError)  # a verifier bug is never retried


def test_infra_error_keeps_its_episode_metrics_across_pickling():
    import pickle

    from toolgym.errors import SandboxError

    err = SandboxError("container died")
    err.episode_metrics = {"env/infra_retries": 2.0}
    copy = pickle.loads(pickle.dumps(err))  # how it crosses to the learner from a Ray actor
    assert str(copy) == "container died" and copy.episode_metrics == {"env/infra_retries": 2.0}


def test_function_tool_schema_is_read_off_the_signature_and_docstring():
    def lookup(query: str, ids: list[str], k: int = 3) -> str:
        """Look things up. Returns one line
        per hit.

        Args:
            query: words to look for
            ids: restrict to these, a list that
                may be long
            k: number of hits

        Returns:
            the hits.
        """
        return query

    tool = FunctionTool.from_function(lookup, constraints={"k": {"minimum": 1}}, timeout=5.0)
    assert (tool.name, tool.description, tool.timeout, tool.terminal) == (
        "lookup",
        "Look things up. Returns one line per hit.",
        5.0,
        False,
    )
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "words to look for"},
            "ids": {
                "type": "array",
                "items": {"type": "string"},
                "description": "restrict to these, a list that may be long",
            },
            "k": {"type": "integer", "minimum": 1, "description": "number of hits", "default": 3},
        },
        "required": ["query", "ids"],
    }
    # the order is part of what the model reads
    assert list(tool.parameters["properties"]["k"]) == ["type", "minimum", "description", "default"]
    assert (
        "default" not in FunctionTool.from_function(lookup, show_defaults=False).parameters["properties"]["k"]
    )


async def test_a_terminal_function_tool_keeps_its_function_as_a_signature_only():
    def answer(answer: str) -> str:
        """Give the answer."""
        return answer

    tool = FunctionTool.from_function(answer, terminal=True)
    assert tool.terminal and tool.fn is None and tool.parameters["required"] == ["answer"]
    with pytest.raises(ToolCallError, match="ends the episode"):
        await tool(answer="x")


def test_a_function_tool_needs_json_typed_annotations():
    def bad(when: object) -> str:
        """Bad."""
        return ""

    with pytest.raises(ConfigError, match=r"bad\(when\): no JSON type"):
        FunctionTool.from_function(bad)
