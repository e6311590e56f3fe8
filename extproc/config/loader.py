"""Loading the config: read the YAML file, validate it against the schema, and compile it with
the environment into the runtime snapshot.

Parse -> defaults and validation (``extproc.config.schema``) -> compile (``compile_spec``): the
credentials and keys named by environment variables or files are read here, chat templates and
tokenizer paths resolved, routing rules built, and every problem raised as a ``ConfigError`` that
names the field's path. Secrets are read only into the snapshot, never printed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from extproc.chat_template import ChatTemplateError, JinjaChatTemplate, load_chat_template
from extproc.config.runtime import GatewayConfig, IntentRoute, Intents, Model, Pool, Tenant, Tracing, hash_key
from extproc.config.schema import (
    CredentialSpec,
    GatewaySpec,
    IntentsSpec,
    RangeSpec,
    TenantSpec,
    TracingSpec,
    format_validation_error,
)
from extproc.pricing import Prices
from extproc.quota.limits import UNLIMITED, Limits
from extproc.resources import resolve_resource
from extproc.routing.rules import Match, Range, Rule
from extproc.templates import CHATML, ChatML

QUOTA_PATH_ENV = "LLMGW_QUOTA_PATH"  # the SQLite quota file a node's extproc workers share
LEDGER_PATH_ENV = "LLMGW_LEDGER_PATH"  # the usage ledger file (JSON lines) when there is no Redis


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path."""


def parse_config(document: Any, *, env: dict[str, str] | None = None) -> GatewayConfig:
    """Validate a parsed YAML document and compile it; raises ConfigError naming the field."""
    if not isinstance(document, dict):
        raise ConfigError("config: expected a mapping at the top level")
    try:
        spec = GatewaySpec.model_validate(document)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None
    return compile_spec(spec, env=os.environ if env is None else env)


def compile_spec(spec: GatewaySpec, *, env: dict[str, str] | os._Environ[str]) -> GatewayConfig:
    """Resolve credentials and build the lookup tables of the snapshot."""
    _check_scorers(spec)
    pools: dict[str, Pool] = {}
    for i, p in enumerate(spec.pools):
        if not p.endpoints:
            raise ConfigError(f"pools[{i}].endpoints: empty (simulated pools get theirs from `llmgw up`)")
        pools[p.name] = Pool(p.name, tuple(p.endpoints), _read_credential(p.credential, f"pools[{i}].credential", env),
                             p.health, p.picker or spec.endpoint_picker.default, frozenset(p.draining),
                             tuple(p.shed.items()), p.batching, p.degrade, p.engine)
    templates: dict[str, JinjaChatTemplate] = {}  # each file compiled once, however many models share it
    models = tuple(
        Model(m.name, pools[m.pool], tuple(m.aliases), m.owned_by, m.max_model_len, Prices(**m.price.model_dump()),
              _tokenizer_path(m.tokenizer, f"models[{i}].tokenizer"), m.version, m.lora,
              _chat_template(m.chat_template, f"models[{i}].chat_template", templates), m.cache, tuple(m.fallback))
        for i, m in enumerate(spec.models)
    )
    by_name = {name: model for model in models for name in (model.name, *model.aliases)}
    redis_url = spec.redis_url or env.get("LLMGW_REDIS_URL") or None
    if redis_url is not None and spec.redis_url is None:
        from extproc.quota.cluster import check_url

        try:
            check_url(redis_url)
        except ValueError as error:
            raise ConfigError(f"redis_url (from LLMGW_REDIS_URL): {error}") from None
    tenants = {t.name: _compile_tenant(t) for t in spec.tenants}
    keys = _compile_keys(spec.tenants, tenants, env)
    for i, t in enumerate(spec.tenants):
        if not t.keys and redis_url is None:
            raise ConfigError(f"tenants[{i}].keys: empty, and no redis_url to hold keys added with `llmgw keys add`")
    return GatewayConfig(by_name, models, pools, spec.server.max_body_bytes, spec.server, redis_url,
                         keys, tenants, bool(spec.tenants), spec.quota, spec.keys,
                         _compile_tracing(spec.tracing, env), _compile_rules(spec, by_name), spec.endpoint_picker,
                         _compile_intents(spec.intents, by_name, env),
                         {r.name: r.cache for r in spec.routes if r.cache is not None}, spec.response_cache,
                         spec.breakers, spec.ledger)


def _compile_rules(spec: GatewaySpec, models: dict[str, Model]) -> tuple[Rule, ...]:
    def span(r: RangeSpec | None) -> Range | None:
        return None if r is None else Range(r.min, r.max)

    def names(values: Sequence[str] | None) -> tuple[str, ...] | None:
        return None if values is None else tuple(values)

    rules = []
    for route in spec.routes:
        m = route.match
        match = Match(
            models=names(m.models), temperature=span(m.temperature), response_format=names(m.response_format),
            tools=m.tools, stream=m.stream, max_tokens=span(m.max_tokens), modalities=names(m.modalities),
            input_tokens=span(m.input_tokens), system_prompt=m.system_prompt, few_shot=span(m.few_shot),
            code_blocks=m.code_blocks, json_output=m.json_output, language=names(m.language),
            tenant_tags=tuple(sorted(m.tenant_tags.items())) if m.tenant_tags is not None else None,
            qos=names(m.qos))
        rules.append(Rule(route.name, match, route.model, route.pool or models[route.model].pool.name,
                          route.intents))
    return tuple(rules)


def _compile_intents(spec: IntentsSpec | None, models: dict[str, Model], env: Any) -> Intents | None:
    if spec is None:
        return None
    embedder = spec.embedder
    key = _env_value(env, embedder.api_key_env, "intents.embedder.api_key_env") \
        if embedder.kind == "remote" and embedder.api_key_env else None
    routes = tuple(IntentRoute(r.name, r.model, r.pool or models[r.model].pool.name, tuple(r.examples),
                               r.description) for r in spec.routes)
    default = (spec.default.model, spec.default.pool or models[spec.default.model].pool.name)
    return Intents(embedder, key, spec.threshold, spec.margin, spec.top_k, spec.model_name, default, routes,
                   spec.cache_size, spec.max_chars, spec.max_pending, spec.scoring, spec.background, spec.decision,
                   spec.confidence)


def _compile_tracing(spec: TracingSpec, env: Any) -> Tracing:
    # OpenTelemetry's own switch, OTEL_SDK_DISABLED=true, turns tracing off whatever the file says
    # (the compose stack without its tracing profile). Secrets are read only when they will be
    # sent: a disabled section needs no environment.
    enabled = spec.enabled and str(env.get("OTEL_SDK_DISABLED", "")).strip().lower() != "true"
    headers = dict(spec.headers)
    if enabled:
        for name, variable in spec.headers_env.items():
            headers[name] = _env_value(env, variable, f"tracing.headers_env.{name}")
    return Tracing(enabled, spec.endpoint, tuple(headers.items()), spec.sampling_ratio, spec.service_name,
                   spec.timeout_s)


def _tokenizer_path(spec: str | None, where: str) -> Path | None:
    if spec is None:
        return None
    try:
        return resolve_resource(spec)
    except FileNotFoundError as error:
        raise ConfigError(f"{where}: {error}") from None


def _chat_template(spec: str | None, where: str, compiled: dict[str, JinjaChatTemplate]
                   ) -> JinjaChatTemplate | ChatML | None:
    if spec is None:
        return None
    if spec == CHATML.source:
        return CHATML
    if spec not in compiled:
        try:
            compiled[spec] = load_chat_template(spec)
        except ChatTemplateError as error:
            raise ConfigError(f"{where}: {error}") from None
    return compiled[spec]


def _check_scorers(spec: GatewaySpec) -> None:
    """Every weight names a registered scorer (``extproc.routing.scorers``)."""
    from extproc.routing.scorers import SCORERS  # the registry; routing imports the config, not at load

    pickers = [("endpoint_picker.default", spec.endpoint_picker.default)]
    pickers += [(f"pools[{i}].picker", p.picker) for i, p in enumerate(spec.pools) if p.picker is not None]
    for where, picker in pickers:
        for name in picker.weights:
            if name not in SCORERS:
                raise ConfigError(f"{where}.weights.{name}: no such scorer (known: {', '.join(sorted(SCORERS))})")


MICRO = 1_000_000  # budgets are counted in micro-dollars


def _compile_tenant(spec: TenantSpec) -> Tenant:
    limits = Limits(**spec.limits.model_dump()) if spec.limits is not None else None
    if spec.budget is not None and (spec.budget.daily_usd is not None or spec.budget.monthly_usd is not None):
        daily, monthly = spec.budget.daily_usd, spec.budget.monthly_usd
        limits = replace(limits or UNLIMITED, daily_cost=None if daily is None else round(daily * MICRO),
                         monthly_cost=None if monthly is None else round(monthly * MICRO))
    classes = tuple((name, Limits(**value.model_dump())) for name, value in spec.qos_limits.items())
    return Tenant(spec.name, tuple(spec.qos), tuple(sorted(spec.tags.items())), limits, classes)


def _compile_keys(specs: list[TenantSpec], tenants: dict[str, Tenant], env: Any) -> dict[bytes, Tenant]:
    table: dict[bytes, Tenant] = {}
    for i, spec in enumerate(specs):
        tenant = tenants[spec.name]
        for j, key in enumerate(spec.keys):
            where = f"tenants[{i}].keys[{j}]"
            if key.env is not None:
                digest = hash_key(_env_value(env, key.env, f"{where}.env"))
            else:
                digest = bytes.fromhex(key.sha256 or "")
            if digest in table:
                raise ConfigError(f"{where}: the same key is already given to tenant {table[digest].name!r}")
            table[digest] = tenant
    return table


def _env_value(env: Any, name: str, where: str) -> str:
    value = env.get(name)
    if not value:
        raise ConfigError(f"{where}: environment variable {name} is not set")
    return str(value)


def _read_credential(spec: CredentialSpec | None, path: str, env: Any) -> str | None:
    if spec is None:
        return None
    if spec.env is not None:
        return _env_value(env, spec.env, f"{path}.env")
    assert spec.file is not None
    try:
        return Path(spec.file).read_text().strip()
    except OSError as error:
        raise ConfigError(f"{path}.file: cannot read {spec.file}: {error.strerror}") from None


def load_spec(path: str | Path) -> GatewaySpec:
    """Read and validate a YAML file into a spec (not yet compiled)."""
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: {error}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return GatewaySpec.model_validate(document)
    except ValidationError as error:
        raise ConfigError(f"{path}:\n{format_validation_error(error)}") from None


def load_config(path: str | Path) -> GatewayConfig:
    """Read, validate and compile a YAML config file."""
    return compile_spec(load_spec(path), env=os.environ)
