"""Help for every training-config field, from the one place it is written: the dataclass docstrings.

Each config section is a frozen dataclass whose docstring has an ``Attributes:`` list (Google style);
an entry may name several fields at once (``lr, weight_decay: AdamW``). :func:`config_fields` turns
those entries into one :class:`FieldHelp` per field (section, name, TOML type, default, one-line help),
so the help can never describe a field that does not exist, and a test fails when a new field comes
without its line. ``toolgym train --help-config`` prints them; ``--help-config json`` prints a JSON
Schema of the config file (descriptions, types, defaults, no unknown keys) that TOML editors with
schema support (Taplo, "Even Better TOML") use for completion and checking.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toolgym.training.config.load import json_safe
from toolgym.training.config.policy import POLICY_KINDS, PolicyBase, PolicyConfig
from toolgym.training.config.run import RunConfig

__all__ = ["FieldHelp", "attribute_docs", "config_fields", "config_schema", "config_sections", "help_text"]

_ENTRY = re.compile(r"^(?P<names>[A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*)\s*:\s*(?P<text>.*)$")


@dataclass(frozen=True)
class FieldHelp:
    """One config field: ``[section] name`` of TOML type ``kind``, its default and its help."""

    section: str
    name: str
    kind: str
    default: Any
    help: str
    description: str

    @property
    def key(self) -> str:
        """The dotted override key (``train.steps``)."""
        return f"{self.section}.{self.name}"


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``Attributes:`` list of ``cls``'s docstring (each entry on one line)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:") + 1
    except StopIteration:
        return {}
    entries: list[tuple[list[str], list[str]]] = []
    indent: int | None = None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break  # the next docstring section
        match = _ENTRY.match(line.strip()) if depth == indent else None
        if match:
            names = [n.strip() for n in match["names"].split(",")]
            entries.append((names, [match["text"].strip()]))
        elif entries:
            entries[-1][1].append(line.strip())
    return {name: " ".join(text) for names, text in entries for name in names}


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not one inside ``code`` or ``e.g.``)."""
    masked = re.sub(r"``[^`]*``", lambda m: "x" * len(m[0]), text)
    masked = re.sub(r"\b(e\.g|i\.e|etc|vs)\.", lambda m: "x" * len(m[0]), masked)
    end = re.search(r"\.(\s|$)", masked)
    sentence = text[: end.start() + 1] if end else text
    return sentence.replace("``", "`")


def toml_kind(hint: Any) -> str:
    """The TOML type a field takes: ``integer``, ``float``, ``boolean``, ``string``, ``array``, ``table``."""
    origin = typing.get_origin(hint)
    if hint is bool:
        return "boolean"
    if hint is int:
        return "integer"
    if hint is float:
        return "float"
    if hint is str:
        return "string"
    if origin is tuple or hint is tuple:
        return "array"
    if origin in (Mapping, dict) or hint in (Mapping, dict):
        return "table"
    if origin in (types.UnionType, typing.Union):
        return " or ".join(toml_kind(a) for a in typing.get_args(hint) if a is not type(None))
    return "any"


def config_sections(config_cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """``(dotted name, dataclass)`` of each table of a config class, sub-tables after their table
    (``train``, ``train.loss``, ...); ``[policy]`` is :class:`PolicyBase` (each kind's own fields are
    listed with it, see :func:`config_fields`)."""
    hints = typing.get_type_hints(config_cls)
    out: list[tuple[str, type]] = []
    for f in dataclasses.fields(config_cls):
        hint = hints[f.name]
        if hint == PolicyConfig:
            out.append((prefix + f.name, PolicyBase))
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.append((prefix + f.name, hint))
            out.extend(config_sections(hint, f"{prefix}{f.name}."))
    return out


def _docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of ``cls`` and of the classes it inherits fields from."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(attribute_docs(base))
    return docs


def _table_fields(section: str, cls: type, note: str = "") -> list[FieldHelp]:
    docs = _docs(cls)
    hints = typing.get_type_hints(cls)
    defaults = cls()
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) or hints[f.name] == PolicyConfig:
            continue  # a sub-table: listed as its own section
        description = docs.get(f.name, "")
        if note:
            description = f"{note} {description}"
        out.append(
            FieldHelp(
                section=section,
                name=f.name,
                kind=toml_kind(hints[f.name]),
                default=getattr(defaults, f.name),
                help=_first_sentence(description),
                description=description.replace("``", "`"),
            )
        )
    return out


def config_fields(config_cls: type | None = None) -> list[FieldHelp]:
    """Every field of every table of the training config, in declaration order. ``[policy]`` lists the
    fields every kind takes, then each kind's own (their help starts with the kind)."""
    if config_cls is None:
        config_cls = RunConfig
    out: list[FieldHelp] = []
    for section, cls in config_sections(config_cls):
        out.extend(_table_fields(section, cls))
        if cls is PolicyBase:  # each kind's own fields, once, marked with the kinds that take them
            seen = {f.name for f in dataclasses.fields(PolicyBase)}
            for kind_cls in POLICY_KINDS.values():
                for item in _table_fields(section, kind_cls):
                    if item.name in seen:
                        continue
                    seen.add(item.name)
                    kinds = [
                        k
                        for k, c in POLICY_KINDS.items()
                        if item.name in {f.name for f in dataclasses.fields(c)}
                    ]
                    note = f"(kind = {' or '.join(kinds)})"
                    out.append(
                        dataclasses.replace(
                            item, help=f"{note} {item.help}", description=f"{note} {item.description}"
                        )
                    )
    return out


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, Mapping):
        items = ", ".join(f"{k} = {_toml_literal(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return repr(value)


def help_text(width: int = 100) -> str:
    """The listing ``toolgym train --help-config`` prints: per section, ``name = default  (type)`` and help."""
    lines = [
        "Training config fields (TOML sections; override any with section.key=value on the command line).",
    ]
    section = None
    for f in config_fields():
        if f.section != section:
            section = f.section
            lines.append(f"\n[{section}]")
        lines.append(f"  {f.name} = {_toml_literal(f.default)}   ({f.kind})")
        lines.extend(textwrap.wrap(f.help, width=width, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


_SCHEMA_TYPES = {
    "integer": "integer",
    "float": "number",
    "boolean": "boolean",
    "string": "string",
    "array": "array",
    "table": "object",
}


def config_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of a training-config TOML file, with every field's description."""

    sections: dict[str, Any] = {}

    def table(dotted: str) -> dict[str, Any]:  # a table's schema node, sub-tables inside their table
        *parents, name = dotted.split(".")
        node = sections
        for parent in parents:
            node = node[parent]["properties"]
        return node.setdefault(name, {"type": "object", "additionalProperties": False, "properties": {}})

    for section, _ in config_sections(RunConfig):
        table(section)
    for f in config_fields():
        prop: dict[str, Any] = {"description": f.description, "default": json_safe(f.default)}
        if f.kind in _SCHEMA_TYPES:
            prop["type"] = _SCHEMA_TYPES[f.kind]
        table(f.section)["properties"][f.name] = prop
    sections["policy"]["properties"]["kind"]["enum"] = list(POLICY_KINDS)
    # several [[env]] tables (a mixture) are an array of env tables
    sections["env"] = {"anyOf": [sections["env"], {"type": "array", "minItems": 1, "items": sections["env"]}]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "toolgym training config",
        "type": "object",
        "additionalProperties": False,
        "properties": sections,
    }
