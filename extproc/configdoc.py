"""The configuration reference (``docs/configuration.md``), generated from the config models.

Every section is one model of ``extproc.config.schema``, reached from ``GatewaySpec`` (the whole YAML
document) in the order its fields name them: the model's docstring, then a table of its fields
with their YAML path, type, default, bounds and what they mean. What a field means is read from
the comments beside it in the source (on its line, or the comment lines just above it), so the
reference says what the code says. ``llmgw config-reference`` prints it; ``--check FILE`` fails
when FILE differs (a test runs that on the checked-in copy).
"""

from __future__ import annotations

import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from extproc.config import schema as schema_module
from extproc.config.schema import GatewaySpec

HEADER = """# Configuration reference

Generated from the config models (`extproc/config/schema.py`) by `llmgw config-reference`; a test fails
when this file is stale. The YAML document is strict: an unknown field, a wrong type (no
coercion: `"5"` is not `5`) or a value out of bounds is refused at load, with an error that names
the field (`models[2].cache.ttl_s: ...`). Values may come from the environment where a field says
`env` (credentials, keys, tracing headers).
"""

_BOUNDS = ((annotated_types.Gt, "gt", "> {}"), (annotated_types.Ge, "ge", ">= {}"), (annotated_types.Lt, "lt", "< {}"),
           (annotated_types.Le, "le", "<= {}"), (annotated_types.MultipleOf, "multiple_of", "multiple of {}"),
           (annotated_types.MinLen, "min_length", "at least {} items"),
           (annotated_types.MaxLen, "max_length", "at most {} characters"))


def comments(model: type[BaseModel]) -> dict[str, str]:
    """field name -> the comments beside it in ``model``'s source (its line's, then the lines above)."""
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    found: dict[str, str] = {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, token in enumerate(tokens):
        # a field: a NAME at the class body's indentation, first on its line, followed by ":"
        if (token.type == tokenize.NAME and token.start[1] == 4 and i + 1 < len(tokens)
                and tokens[i + 1].string == ":" and token.string in model.model_fields):
            row = token.start[0]
            text = [t.string.lstrip("# ").strip() for t in tokens[i:]
                    if t.start[0] == row and t.type == tokenize.COMMENT]
            above: list[str] = []
            k = row - 2
            while k >= 0 and lines[k].strip().startswith("#"):
                above.insert(0, lines[k].strip().lstrip("# ").strip())
                k -= 1
            found[token.string] = " ".join([*above, *text]).strip()
    return found


def type_name(annotation: Any, models: list[type[BaseModel]]) -> str:
    """``annotation`` in words (a model is linked to its section, and queued for one)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0], models)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        name = " or ".join(type_name(a, models) for a in kept)
        return f"{name}, optional" if len(kept) < len(args) else name
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {type_name(args[0], models)}"
    if origin is dict:
        return f"map of {type_name(args[0], models)} to {type_name(args[1], models)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation not in models:
            models.append(annotation)
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def default_of(field: FieldInfo) -> str:
    """The default as YAML would say it, or "required"."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(its defaults)"
        return f"`{value}`" if value not in ({}, []) else "empty"
    if field.default is PydanticUndefined:
        return "**required**"
    if field.default is None:
        return "none"
    if isinstance(field.default, bool):
        return f"`{str(field.default).lower()}`"
    return f"`{field.default}`"


def bounds_of(field: FieldInfo) -> str:
    """The value's bounds and pattern, from the field's constraints."""
    out = []
    for item in field.metadata:
        for kind, attribute, text in _BOUNDS:
            if isinstance(item, kind):
                out.append(text.format(getattr(item, attribute)))
        pattern = getattr(item, "pattern", None)
        if pattern:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def reference() -> str:
    """The whole reference, as Markdown."""
    models: list[type[BaseModel]] = [GatewaySpec]
    sections = [HEADER]
    done = 0
    while done < len(models):
        model = models[done]
        done += 1
        notes = comments(model)
        hints = typing.get_type_hints(model, globalns=vars(schema_module), include_extras=True)
        doc = inspect.cleandoc(model.__doc__ or "").replace("``", "`")
        rows = []
        for name, field in model.model_fields.items():
            meaning = notes.get(name, "").replace("|", "\\|")
            rows.append(f"| `{name}` | {type_name(hints.get(name, field.annotation), models)} | {default_of(field)} | "
                        f"{bounds_of(field)} | {meaning} |")
        sections.append("\n".join([
            f"## {model.__name__}", "", " ".join(doc.split()), "",
            "| field | type | default | bounds | meaning |", "|---|---|---|---|---|", *rows, ""]))
    return "\n".join(sections)


def models_documented() -> set[str]:
    """The names of the models the reference has a section for."""
    return {line[3:].strip() for line in reference().splitlines() if line.startswith("## ")}


def all_spec_models() -> set[str]:
    """Every ``*Spec`` model of ``extproc.config.schema`` (each should be reachable from the document)."""
    return {name for name, value in vars(schema_module).items()
            if isinstance(value, type) and issubclass(value, BaseModel) and name.endswith("Spec")
            and value.__module__ == schema_module.__name__}


def main(argv: list[str] | None = None) -> int:
    """``python -m extproc.configdoc [--check FILE | --write FILE]``: print, check or write the reference."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="llmgw config-reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="FILE", help="fail (exit 1) when FILE is not the current reference")
    parser.add_argument("--write", metavar="FILE", help="write the reference to FILE")
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        if Path(args.check).read_text() != text:
            print(f"{args.check} is stale: run `llmgw config-reference --write {args.check}`")
            return 1
        return 0
    if args.write:
        Path(args.write).write_text(text)
        return 0
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
