"""Rule routing: ordered rules pick a request's model and pool, first match wins. Pure.

A rule matches when every condition it states holds (a condition it leaves out always holds). It
names a configured model (the served name pods use) and, optionally, a pool serving it other than
the model's own. No rule matches: the model the client named, in its own pool.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.routing.features import PromptFeatures


@dataclass(frozen=True, slots=True)
class Range:
    """An inclusive range; ``None`` leaves that side open."""

    min: float | None = None
    max: float | None = None

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` is inside (an unknown value never is, unless the range is open)."""
        if value is None:
            return self.min is None and self.max is None
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def __str__(self) -> str:
        return f"[{'' if self.min is None else self.min}, {'' if self.max is None else self.max}]"


@dataclass(frozen=True, slots=True)
class RouteContext:
    """What a rule can look at: the request's model name, fields and features, and its tenant."""

    model: str
    features: PromptFeatures
    stream: bool = False
    max_tokens: int | None = None
    input_tokens: int = 0
    tenant_tags: Mapping[str, str] = field(default_factory=dict)
    qos: str = ""


@dataclass(frozen=True, slots=True)
class Match:
    """The conditions of a rule (``None``: not a condition)."""

    models: tuple[str, ...] | None = None  # globs over the name the client sent
    temperature: Range | None = None
    response_format: tuple[str, ...] | None = None
    tools: bool | None = None
    stream: bool | None = None
    max_tokens: Range | None = None
    modalities: tuple[str, ...] | None = None  # any of these media in the prompt
    input_tokens: Range | None = None
    system_prompt: bool | None = None
    few_shot: Range | None = None
    code_blocks: bool | None = None
    json_output: bool | None = None
    language: tuple[str, ...] | None = None
    tenant_tags: tuple[tuple[str, str], ...] | None = None
    qos: tuple[str, ...] | None = None

    def checks(self, ctx: RouteContext) -> list[tuple[str, bool, str]]:
        """Each condition stated: (name, holds, what the request has)."""
        f = ctx.features
        out: list[tuple[str, bool, str]] = []
        if self.models is not None:
            out.append(("models", any(fnmatch.fnmatchcase(ctx.model, g) for g in self.models), ctx.model))
        if self.temperature is not None:
            out.append(("temperature", self.temperature.holds(f.temperature), str(f.temperature)))
        if self.response_format is not None:
            out.append(("response_format", f.response_format in self.response_format, f.response_format))
        if self.tools is not None:
            out.append(("tools", f.tools == self.tools, str(f.tools)))
        if self.stream is not None:
            out.append(("stream", ctx.stream == self.stream, str(ctx.stream)))
        if self.max_tokens is not None:
            out.append(("max_tokens", self.max_tokens.holds(ctx.max_tokens), str(ctx.max_tokens)))
        if self.modalities is not None:
            out.append(("modalities", bool(f.modalities & set(self.modalities)), ",".join(sorted(f.modalities))))
        if self.input_tokens is not None:
            out.append(("input_tokens", self.input_tokens.holds(ctx.input_tokens), str(ctx.input_tokens)))
        if self.system_prompt is not None:
            out.append(("system_prompt", f.system_prompt == self.system_prompt, str(f.system_prompt)))
        if self.few_shot is not None:
            out.append(("few_shot", self.few_shot.holds(f.few_shot), str(f.few_shot)))
        if self.code_blocks is not None:
            out.append(("code_blocks", f.code_blocks == self.code_blocks, str(f.code_blocks)))
        if self.json_output is not None:
            out.append(("json_output", f.json_output == self.json_output, str(f.json_output)))
        if self.language is not None:
            out.append(("language", f.language in self.language, f.language or "unknown"))
        if self.tenant_tags is not None:
            held = all(ctx.tenant_tags.get(k) == v for k, v in self.tenant_tags)
            out.append(("tenant_tags", held, ",".join(f"{k}={v}" for k, v in sorted(ctx.tenant_tags.items()))))
        if self.qos is not None:
            out.append(("qos", ctx.qos in self.qos, ctx.qos or "none"))
        return out

    def holds(self, ctx: RouteContext) -> bool:
        """Whether every stated condition holds."""
        return all(ok for _, ok, _ in self.checks(ctx))


@dataclass(frozen=True, slots=True)
class Rule:
    """One routing rule: when ``match`` holds, serve ``model`` from ``pool``."""

    name: str
    match: Match
    model: str  # a configured model's served name
    pool: str  # the model's own pool unless the rule names another
    intents: bool = False  # classify the prompt: an intent's model wins, else this rule's


@dataclass(frozen=True, slots=True)
class Route:
    """The rules' answer: the rule that matched (None: the request's own model and pool)."""

    rule: Rule | None
    explanation: tuple[tuple[str, tuple[tuple[str, bool, str], ...]], ...] = ()


def choose(rules: tuple[Rule, ...], ctx: RouteContext, explain: bool = False) -> Route:
    """The first rule whose conditions all hold; with ``explain``, every rule tried and why."""
    tried = []
    for rule in rules:
        checks = rule.match.checks(ctx)
        held = all(ok for _, ok, _ in checks)
        if explain:
            tried.append((rule.name, tuple(checks)))
        if held:
            return Route(rule, tuple(tried))
    return Route(None, tuple(tried))
