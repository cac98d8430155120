"""toolgym.agents: policies, chat formats, harnesses, the rollout loop and evaluation.

Agents see environments only through the Env contract (a registered id and ``reset``/``step``).
Public names are imported lazily (:mod:`toolgym.lazy`): ``import toolgym.agents`` imports neither
torch nor vLLM until a policy that needs them is used.
"""

from __future__ import annotations

from toolgym.lazy import lazy_exports

_EXPORTS = {
    "HFPolicy": "toolgym.agents.hf_policy",
    "VLLMPolicy": "toolgym.agents.vllm_policy",
    "VLLMServerPolicy": "toolgym.agents.vllm_server",
    "HTTPPolicy": "toolgym.agents.http_policy",
    "ChatPolicy": "toolgym.agents.policy",
    "ScriptedPolicy": "toolgym.agents.policy",
    "RulePolicy": "toolgym.agents.policy",
    "ChatMLTemplate": "toolgym.agents.chat",
    "ByteTokenizer": "toolgym.agents.chat",
    "ChatFormat": "toolgym.agents.chat_formats",
    "resolve_chat_format": "toolgym.agents.chat_formats",
    "get_harness": "toolgym.agents.harness",
    "run_episode": "toolgym.agents.rollout",
    "read_trajectories": "toolgym.agents.rollout",
    "write_trajectories": "toolgym.agents.rollout",
    "parse_policy_spec": "toolgym.agents.specs",
    "policy_factory": "toolgym.agents.specs",
    # the tool-call parser lives in the core (environments parse actions too); re-exported here
    "parse": "toolgym.parsing",
    "ParsedTurn": "toolgym.parsing",
    "ToolCall": "toolgym.parsing",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
