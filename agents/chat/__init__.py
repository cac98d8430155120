"""How a conversation becomes tokens, and how a model family writes tool calls.

:mod:`chatml` (the ChatML template and the byte-level tokenizer), :mod:`formats` (the chat-format
registry and ``auto``: ``hermes``, ``llama3``, ``mistral``, ``harmony``), :mod:`template` (the model's
own chat template, with its prefix and history-rewrite checks) and :mod:`messages` (toolgym's messages
as OpenAI chat messages).
"""
