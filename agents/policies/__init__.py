"""Policy back-ends: token in, token out, and the one parser of policy strings.

:mod:`base` (``ChatPolicy``, ``ScriptedPolicy``, ``RulePolicy``), :mod:`hf` (transformers, with
:mod:`prefix_cache` and :mod:`hf_cache` for key/value reuse), :mod:`hf_tokenizer` (a Hugging Face
tokenizer as toolgym's), :mod:`vllm` (an in-process vLLM engine; :mod:`vllm_weights` its worker-side
weight load), :mod:`vllm_server` (vLLM's own server, behind :mod:`vllm_guard`), :mod:`http`
(OpenAI-compatible servers), :mod:`models` (locating SmolLM2, the safetensors cache),
:mod:`run_exports` (a training run's exports read back) and :mod:`specs` (policy strings: ``smollm2``,
``hf:``, ``run:``, ``vllm:``, ``http:``).
"""
