"""From typed Envoy messages to the YAML Envoy reads: proto3 JSON field names in snake_case
(Envoy's own YAML style), defaults left out, multi-line strings (Lua) as literal blocks."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import betterproto2
import yaml

from extproc.envoybuild.envoyapi import protobuf


def _proto_name(field: str) -> str:
    return field  # to_dict strips the "_" added to a keyword (``in_``)


def data(message: betterproto2.Message) -> dict[str, Any]:
    """The message as YAML/JSON data, in Envoy's config style.

    Keys are the proto field names, which the generated Python fields keep: betterproto2's own
    ``Casing.SNAKE`` re-cases them and breaks names with digits (``consecutive_5xx`` becomes
    ``consecutive_5_xx``, which Envoy rejects), so the name is passed through as it is.
    """
    return _empty_any(message.to_dict(casing=_proto_name))  # type: ignore[arg-type]


def _empty_any(value: Any) -> Any:
    """An empty ``Any`` is ``{}`` in proto3 JSON; betterproto2 writes ``{"@type": ""}``, which Envoy
    refuses (a route's ``FilterConfig.config: {}`` turns a disabled filter on)."""
    if isinstance(value, dict):
        return {} if value == {"@type": ""} else {key: _empty_any(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_empty_any(item) for item in value]
    return value


def typed(message: betterproto2.Message) -> protobuf.Any:
    """``message`` packed into a ``google.protobuf.Any`` (a ``typed_config``)."""
    return protobuf.Any.pack(message)


def seconds(value: float) -> timedelta:
    """A ``google.protobuf.Duration`` of ``value`` seconds."""
    return timedelta(seconds=value)


class _Dumper(yaml.SafeDumper):
    """Block style everywhere; a string with line breaks as a literal block (``|``)."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(document: object, header: str = "") -> str:
    """YAML text of ``document``, after ``header`` (each of its lines becomes a ``#`` comment)."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def dump_all(documents: Sequence[object], header: str = "") -> str:
    """Several YAML documents in one text (``---`` between them), after ``header``."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
