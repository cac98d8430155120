"""toolgym.agents: policies, chat formats, harnesses, the rollout loop and evaluation.

Agents see environments only through the Env contract (a registered id and ``reset``/``step``).
Public names are imported lazily (:mod:`toolgym.lazy`): ``import toolgym.agents`` imports neither
torch nor vLLM until a policy that needs them is used.
"""

from __future__ import annotations

from toolgym.lazy import lazy_exports

_EXPORTS = {
    "HFPolicy": "toolgym.agents.policies.hf",
    "VLLMPolicy": "toolgym.agents.policies.vllm",
    "VLLMServerPolicy": "toolgym.agents.policies.vllm_server",
    "HTTPPolicy": "toolgym.agents.policies.http",
    "ChatPolicy": "toolgym.agents.policies.base",
    "ScriptedPolicy": "toolgym.agents.policies.base",
    "RulePolicy": "toolgym.agents.policies.base",
    "ChatMLTemplate": "toolgym.agents.chat.chatml",
    "ByteTokenizer": "toolgym.agents.chat.chatml",
    "ChatFormat": "toolgym.agents.chat.formats",
    "resolve_chat_format": "toolgym.agents.chat.formats",
    "get_harness": "toolgym.agents.harness",
    "run_episode": "toolgym.agents.rollout",
    "read_trajectories": "toolgym.agents.rollout",
    "write_trajectories": "toolgym.agents.rollout",
    "parse_policy_spec": "toolgym.agents.policies.spec",
    "policy_factory": "toolgym.agents.policies.factory",
    # the tool-call parser lives in the core (environments parse actions too); re-exported here
    "parse": "toolgym.parsing",
    "ParsedTurn": "toolgym.parsing",
    "ToolCall": "toolgym.parsing",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
