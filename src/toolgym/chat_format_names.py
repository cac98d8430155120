"""The names a chat format is chosen by (``policy.chat_format``, ``--chat-format``), checked without
loading a renderer.

``auto`` picks one from the model (``toolgym.agents.chat.formats``); each call syntax of
:mod:`toolgym.call_formats` has a renderer of the same name; ``template`` renders with the tokenizer's own
chat template and ``template:CALLS`` with it and the call syntax ``CALLS``. The renderers register under
exactly these names (a test holds them together), so a config is checked where it is read, before
anything of the agents loads.
"""

from __future__ import annotations

from toolgym.call_formats import CALL_FORMATS
from toolgym.errors import check_choice

__all__ = ["CHAT_FORMATS", "RENDERER_NAMES", "check_chat_format_name"]

#: the renderers' names: one per call syntax, named as it
RENDERER_NAMES = tuple(CALL_FORMATS)
#: every format name ``policy.chat_format`` accepts (``template:CALLS`` picks the template's call syntax)
CHAT_FORMATS = ("auto", *RENDERER_NAMES, "template", *(f"template:{c}" for c in CALL_FORMATS))


def check_chat_format_name(name: str, setting: str) -> None:
    """A ConfigError naming ``setting`` (``policy.chat_format``, ``--chat-format``) when ``name`` is not
    one of :data:`CHAT_FORMATS`, with "did you mean"."""
    check_choice(setting, name, CHAT_FORMATS)
