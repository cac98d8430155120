"""Core value types: JSON round trips and range checks."""

from __future__ import annotations

import pytest

from toolgym.core import SamplingParams, Task
from toolgym.errors import ConfigError


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
