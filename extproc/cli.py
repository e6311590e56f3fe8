"""The ``llmgw`` command: run the local stack, run extproc workers, check a config."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.table import Table

from extproc import ledger
from extproc.cli_keys import add_keys_commands
from extproc.config import (
    LEDGER_PATH_ENV,
    QUOTA_PATH_ENV,
    ConfigError,
    GatewayConfig,
    compile_spec,
    hash_key,
    load_config,
    load_spec,
)
from extproc.envoybuild.names import TARGET_NAMES
from extproc.keys import new_api_key
from extproc.launcher import (
    ChildFailed,
    LocalStack,
    ProcessGroup,
    StackInfo,
    StackOptions,
    node_state_env,
    reload_extproc,
    reserve_port,
    start_extproc_workers,
)
from extproc.telemetry.metrics import MULTIPROC_ENV, prepare_multiprocess_dir, serve_metrics

DEFAULT_CONFIG = "config/local.yaml"
DEV_KEY_ENV = "LLMGW_DEV_KEY"
console = Console(stderr=True, highlight=False)


class _Stop(Exception):
    """SIGINT/SIGTERM arrived."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # Further signals (Ctrl-C twice, a process group's SIGTERM) must not cut the cleanup short.
    _ignore_stop_signals()
    raise _Stop


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT stop the node from now on (before anything starts: a signal that comes
    while it starts, or just after READY, still stops every child and exits 0)."""
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)


def _ignore_stop_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _log_to_stderr(level: str) -> None:
    """The launcher's lines (a child died, and when it starts again) on stderr."""
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")


def _serve_until_stopped(group: ProcessGroup) -> int:
    """Wait for SIGTERM/SIGINT while the group's supervisor starts dead children again (exit 0);
    exit 1 only if supervision itself stopped (a bug: better no node than an unwatched one).
    SIGHUP meanwhile reloads every worker's config at once."""
    signal.signal(signal.SIGHUP, lambda *_: reload_extproc(group))
    try:
        while group.supervising:
            time.sleep(0.2)
    except _Stop:
        console.print("stopping...")
        return 0
    console.print("[red]the supervisor thread stopped; stopping the node[/red]")
    return 1


def _print_welcome(info: StackInfo, model: str, started_in: float, api_key: str) -> None:
    base = info.base_url
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key != "local" else ""
    pods = ", ".join(u for urls in info.pod_urls.values() for u in urls) or "(none simulated)"
    print(f"""llmgw is up in {started_in:.1f} s

  gateway   {base}/v1        (Envoy; admin {info.admin_url})
  extproc   {info.extproc_address}   (metrics {info.metrics_url or "off"})
  pods      {pods}

Try it:

curl -sN {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
  -d '{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Hello!"}}]}}'

python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{api_key}")
for chunk in client.chat.completions.create(
        model="{model}", stream=True, messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
print()
EOF

Ctrl-C stops everything.""", flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    """``llmgw up``: simulated pods + extproc workers + Envoy, in the foreground."""
    started = time.monotonic()
    # The local config's tenant takes its key from LLMGW_DEV_KEY: made up here unless given, and
    # printed below; only its hash ever sits in memory, and it is never written to disk.
    dev_key = os.environ.get(DEV_KEY_ENV) or new_api_key()
    if bool(args.tls_cert) != bool(args.tls_key):
        console.print("[red]give both --tls-cert and --tls-key[/red]")
        return 2
    options = StackOptions(
        config_path=Path(args.config), run_dir=Path(args.run_dir), port=args.port, listen_host=args.host,
        workers=args.workers, envoy_yaml=Path(args.envoy_config) if args.envoy_config else None,
        log_level=args.log_level, env={DEV_KEY_ENV: dev_key}, metrics_port=args.metrics_port,
        tls=(Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None,
    )
    stack = LocalStack(options)
    _log_to_stderr(args.log_level)
    _stop_on_signals()
    try:
        info = stack.start()
        config = compile_spec(load_spec(info.config_path), env={**os.environ, DEV_KEY_ENV: dev_key})
        model = config.models[0].aliases[0] if config.models[0].aliases else config.models[0].name
        api_key = dev_key if config.tenant_for(hash_key(dev_key)) else "local"
        _print_welcome(info, model, time.monotonic() - started, api_key)
        print(f"Logs: {stack.log_dir}/", flush=True)
        return _serve_until_stopped(stack.group)
    except _Stop:
        console.print("stopped while starting")
        return 0
    except (ConfigError, ChildFailed, OSError) as error:
        console.print(f"[red]llmgw up failed: {error}[/red]")
        return 1
    finally:
        _ignore_stop_signals()
        stack.stop()


def cmd_coordinator(args: argparse.Namespace) -> int:
    """``llmgw coordinator``: the batching coordinator alone (``llmgw up`` starts one itself)."""
    from extproc.coordinator.__main__ import main as coordinator_main

    argv = ["--config", args.config, "--host", args.host, "--log-level", args.log_level]
    coordinator_main(argv + (["--port", str(args.port)] if args.port is not None else []))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``llmgw serve``: N extproc worker processes sharing one port (production entry point)."""
    try:
        config = load_config(args.config)
    except ConfigError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    workers = args.workers or config.server.workers or os.cpu_count() or 1
    port = config.server.port if args.port is None else args.port
    host = args.host or config.server.host
    try:  # held until the end: restarted workers bind it again, nobody else can meanwhile
        reserved = reserve_port(host, port)  # port 0: a free one
    except OSError as error:
        console.print(f"[red]cannot bind {host}:{port}: {error.strerror}[/red]")
        return 1
    port = int(reserved.getsockname()[1])
    # Workers write to this process's stdout and stderr (a container's log), or to files.
    group = ProcessGroup(Path(args.log_dir) if args.log_dir else None)
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)  # the node's SQLite files
    shared = node_state_env(Path(args.run_dir).resolve())
    shared.update({name: os.environ[name] for name in (QUOTA_PATH_ENV, LEDGER_PATH_ENV) if os.environ.get(name)})
    if args.metrics_port is not None:
        shared[MULTIPROC_ENV] = str(prepare_multiprocess_dir(Path(args.run_dir).resolve() / "metrics"))
    metrics = None
    _log_to_stderr(args.log_level)
    _stop_on_signals()
    try:
        start_extproc_workers(group, args.config, host, port, workers, args.log_level, shared, 60)
        group.supervise()
        if args.metrics_port is not None:
            metrics = serve_metrics(args.metrics_port, args.metrics_host, multiproc_dir=Path(shared[MULTIPROC_ENV]))
        where = f", metrics :{metrics.port}/metrics" if metrics else ""
        print(f"READY {host}:{port} ({workers} workers{where})", flush=True)
        return _serve_until_stopped(group)
    except _Stop:
        console.print("stopped while starting")
        return 0
    except ChildFailed as error:
        console.print(f"[red]{error}[/red]")
        return 1
    finally:
        _ignore_stop_signals()
        group.stop()
        if metrics is not None:
            metrics.stop()
        reserved.close()


def cmd_keygen(args: argparse.Namespace) -> int:
    """``llmgw keygen``: a new API key and the config lines that grant it (only the hash is stored)."""
    key = new_api_key()
    print(f"# API key (give it to the tenant; only its hash goes in the config): {key}")
    print(f"tenants:\n  - name: {args.tenant}\n    keys:\n      - sha256: {hash_key(key).hex()}")
    return 0


def _since_ms(text: str | None) -> int:
    """``--since``: ``30m``, ``2h``, ``7d`` ago, or an ISO date/time (UTC when it has no zone)."""
    if not text:
        return 0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1] in units and text[:-1].isdigit():
        return int((time.time() - int(text[:-1]) * units[text[-1]]) * 1000)
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def cmd_usage(args: argparse.Namespace) -> int:
    """``llmgw usage``: totals per tenant and model from the usage ledger."""
    try:
        since = _since_ms(args.since)
    except ValueError:
        console.print(f"[red]--since: {args.since!r} is neither 30m/2h/7d nor an ISO date[/red]")
        return 2
    redis_url = args.redis_url or os.environ.get("LLMGW_REDIS_URL")
    if redis_url:
        records = ledger.read_stream(redis_url, since_ms=since)
    else:
        path = Path(args.file)
        if not path.is_file():
            console.print(f"[red]no usage ledger at {path} (pass --file or --redis-url)[/red]")
            return 1
        records = ledger.read_file(path)
    rows = [
        {"tenant": tenant, "model": model, "requests": t.requests, "rejected": t.rejected, "unsettled": t.unsettled,
         "input_tokens": t.input_tokens, "output_tokens": t.output_tokens, "cached_tokens": t.cached_tokens,
         "cost_usd": round(t.cost_usd, 6)}
        for (tenant, model), t in sorted(ledger.totals(records, tenant=args.tenant, since_ms=since).items())
    ]
    if args.format == "json":
        print(json.dumps(rows, indent=2))
    elif args.format == "csv":
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]) if rows else ["tenant"])
        writer.writeheader()
        writer.writerows(rows)
    else:
        table = Table(title="usage")
        for column in rows[0] if rows else ("tenant", "model"):
            table.add_column(column, justify="left" if column in ("tenant", "model") else "right")
        for row in rows:
            table.add_row(*(str(value) for value in row.values()))
        Console().print(table)
    return 0


def offline_config(path: str | Path) -> GatewayConfig:
    """A config compiled without starting anything: simulated pools get their endpoints from
    `llmgw up`, so stand-ins let the rest be checked; a missing dev key is a placeholder."""
    spec = load_spec(path)
    pools = [p.model_copy(update={"endpoints": p.endpoints or ["127.0.0.1:1"]}) for p in spec.pools]
    env = {**os.environ, DEV_KEY_ENV: os.environ.get(DEV_KEY_ENV) or "unset"}
    return compile_spec(spec.model_copy(update={"pools": pools}), env=env)


def cmd_check(args: argparse.Namespace) -> int:
    """``llmgw check-config``: validate a config file and summarise it."""
    try:
        config = offline_config(args.config)
    except ConfigError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    for pool in config.pools.values():
        models = [m.name for m in config.models if m.pool is pool]
        print(f"pool {pool.name}: {len(pool.endpoints)} endpoints, models {', '.join(models)}")
    tenants = sorted({t.name for t in config.tenants_by_key.values()})
    print(f"tenants: {', '.join(tenants) if tenants else 'none (no API keys required)'}")
    print("ok")
    return 0


def cmd_route(args: argparse.Namespace) -> int:
    """``llmgw route --explain FILE``: how a request body would be routed, and why;
    ``llmgw route --calibrate``: what the config's intents promise (cross-validated)."""
    from extproc.api import ApiError
    from extproc.routing.embedders import EmbedderError
    from extproc.routing.explain import explain

    if args.calibrate:
        return _calibrate(args)
    try:
        config = offline_config(args.config)
        body = sys.stdin.buffer.read() if args.explain == "-" else Path(args.explain).read_bytes()
        result = explain(config, body, args.path, args.tenant, args.qos)
    except (ConfigError, OSError, EmbedderError) as error:
        console.print(f"[red]{error}[/red]")
        return 2
    except KeyError as error:
        console.print(f"[red]--tenant: no tenant named {error}[/red]")
        return 2
    except ApiError as error:
        console.print(f"[red]the gateway would answer {error.status} {error.code}: {error.message}[/red]")
        return 1
    if args.format == "json":
        print(json.dumps(result, indent=2))
        return 0
    features = ", ".join(f"{k}={v}" for k, v in result["features"].items())
    Console().print(f"[bold]{result['requested_model']}[/bold]: {features}")
    table = Table(title="rules, in order (first match wins)")
    for column in ("rule", "condition", "holds", "request"):
        table.add_column(column)
    for tried in result["rules"]:
        for i, condition in enumerate(tried["conditions"] or [{"condition": "(none)", "holds": True, "request": ""}]):
            table.add_row(tried["rule"] if i == 0 else "", condition["condition"],
                          "yes" if condition["holds"] else "no", str(condition["request"]))
    Console().print(table)
    if (semantic := result["intents"]) is not None:
        Console().print(f"intents ({semantic['embedder']}): nearest {semantic['nearest']!r} "
                        f"at {semantic['score']:.3f}, "
                        f"runner-up {semantic['runner_up']:.3f}; threshold {semantic['threshold']:.2f}, "
                        f"margin {semantic['margin']:.2f} -> {semantic['intent']}")
    decision = result["decision"]
    Console().print(f"-> model {decision['model']} in pool {decision['pool']}: {decision['why']}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from extproc.routing.calibrate import calibrate
    from extproc.routing.classifier import build_index
    from extproc.routing.embedders import EmbedderError

    try:
        config = offline_config(args.config)
        if config.intents is None:
            console.print("[red]the config has no intents: nothing to calibrate[/red]")
            return 2
        with console.status("embedding the examples"):
            result = calibrate(build_index(config.intents))
    except (ConfigError, OSError, EmbedderError) as error:
        console.print(f"[red]{error}[/red]")
        return 2
    if args.format == "json":
        print(json.dumps({**asdict(result), "warnings": result.warnings}, indent=2))
        return 0
    how = f"learned decision, confidence {result.confidence:g}" if result.decision == "learned" \
        else f"threshold {result.threshold:g}, margin {result.margin:g}"
    table = Table(title=f"held-out examples ({result.embedder}, {result.scoring}; {how})")
    table.add_column("intent")
    table.add_column("found its intent", justify="right")
    for name, accuracy in result.per_intent.items():
        table.add_row(name, f"{accuracy:.0%}")
    Console().print(table)
    Console().print(f"expected accuracy on prompts like the examples: [bold]{result.accuracy:.1%}[/bold] "
                    f"({result.examples} examples held out one at a time; {result.to_default} fell to the default "
                    "route). Prompts unlike every example, and prompts outside every intent, are not counted.")
    for line in result.warnings:
        Console().print(f"[yellow]warning:[/yellow] {line}")
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    """``llmgw envoy-config --target T``: write the Envoy config of a way in, built from the config."""
    from extproc.envoybuild import targets  # Envoy's API types: ~1 s to import

    try:
        spec = targets.load(Path(args.config) if args.config else targets.TARGETS[args.target].config)
    except ConfigError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    for path in targets.write(args.target, spec, Path(args.out) if args.out else None):
        print(path)
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    """``llmgw config-reference``: docs/configuration.md, from the config models."""
    from extproc.configdoc import main as reference_main

    return reference_main([*(["--write", args.write] if args.write else []),
                           *(["--check", args.check] if args.check else [])])


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``llmgw``."""
    parser = argparse.ArgumentParser(prog="llmgw", description="An LLM API gateway on Envoy ext_proc.")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run the local stack: Envoy, extproc workers, simulated pods")
    up.add_argument("--config", default=DEFAULT_CONFIG, help=f"gateway config (default {DEFAULT_CONFIG})")
    up.add_argument("--port", type=int, default=10000,
                    help="Envoy listener port (default 10000; 0: a free one, printed)")
    up.add_argument("--host", default="127.0.0.1", help="Envoy listener address (default 127.0.0.1)")
    up.add_argument("--workers", type=int, default=0, help="extproc processes (default: one per core)")
    up.add_argument("--envoy-config", default=None, help="a hand-written Envoy config to patch with the stack's "
                                                         "addresses (default: built from --config)")
    up.add_argument("--tls-cert", default=None, help="PEM certificate chain: the listener serves HTTPS")
    up.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    up.add_argument("--run-dir", default=".run", help="rendered configs and logs (default .run)")
    up.add_argument("--metrics-port", type=int, default=0,
                    help="Prometheus /metrics of the extproc workers (default: a free port, printed)")
    up.add_argument("--log-level", default="INFO")
    up.set_defaults(handler=cmd_up)

    serve = commands.add_parser("serve", help="run extproc workers only (one per core by default)")
    serve.add_argument("--config", required=True)
    serve.add_argument("--port", type=int, default=None, help="default: server.port of the config; 0: a free one")
    serve.add_argument("--host", default=None)
    serve.add_argument("--workers", type=int, default=0)
    serve.add_argument("--run-dir", default=".run")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve the workers' summed Prometheus /metrics on this port (default: none)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="address of /metrics (default 127.0.0.1; 0.0.0.0 for a scraper elsewhere)")
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument("--log-dir", default=None,
                       help="write each worker's log to a file here (default: this process's stdout and stderr)")
    serve.set_defaults(handler=cmd_serve)

    coordinator = commands.add_parser("coordinator", help="run the batching coordinator alone")
    coordinator.add_argument("--config", required=True)
    coordinator.add_argument("--host", default="127.0.0.1")
    coordinator.add_argument("--port", type=int, default=None, help="default: the port of server.coordinator")
    coordinator.add_argument("--log-level", default="INFO")
    coordinator.set_defaults(handler=cmd_coordinator)

    keygen = commands.add_parser("keygen", help="make an API key; prints the config lines with its hash")
    keygen.add_argument("--tenant", default="my-team")
    keygen.set_defaults(handler=cmd_keygen)

    add_keys_commands(commands)  # llmgw keys add|revoke|list: keys in Redis (extproc/cli_keys.py)

    usage = commands.add_parser("usage", help="usage and cost totals per tenant and model, from the ledger")
    usage.add_argument("--tenant", default=None)
    usage.add_argument("--since", default=None, help="30m, 2h, 7d, or an ISO date/time")
    usage.add_argument("--format", choices=("table", "csv", "json"), default="table")
    usage.add_argument("--file", default=".run/usage.jsonl", help="file ledger (default .run/usage.jsonl)")
    usage.add_argument("--redis-url", default=None, help="read the Redis Stream ledger instead")
    usage.set_defaults(handler=cmd_usage)

    route = commands.add_parser("route", help="how a request body would be routed, and why; or what the "
                                               "config's intents promise (--calibrate)")
    what = route.add_mutually_exclusive_group(required=True)
    what.add_argument("--explain", metavar="REQUEST.json", help="the body (- for stdin)")
    what.add_argument("--calibrate", action="store_true",
                      help="cross-validate the intents' examples: expected accuracy, overlapping intents")
    route.add_argument("--config", default=DEFAULT_CONFIG, help=f"gateway config (default {DEFAULT_CONFIG})")
    route.add_argument("--path", default="/v1/chat/completions",
                       choices=("/v1/chat/completions", "/v1/completions", "/v1/embeddings"))
    route.add_argument("--tenant", default=None, help="route as this tenant (its tags and default QoS class)")
    route.add_argument("--qos", default=None, help="the QoS class asked for")
    route.add_argument("--format", choices=("table", "json"), default="table")
    route.set_defaults(handler=cmd_route)

    envoy = commands.add_parser("envoy-config", help="write the Envoy config of the local stack, compose, "
                                                     "a plain-Envoy snippet or Istio EnvoyFilters")
    envoy.add_argument("--target", required=True, choices=TARGET_NAMES)
    envoy.add_argument("--config", default=None, help="gateway config, or a ConfigMap holding it (default: the "
                                                      "target's: config/local.yaml, compose/llmgw/llmgw.yaml, "
                                                      "envoy/istio/config.yaml)")
    envoy.add_argument("--out", default=None, help="folder (default: the checked-in copy's: envoy/, compose/, "
                                                   "envoy/snippet/, envoy/istio/)")
    envoy.set_defaults(handler=cmd_envoy_config)

    reference = commands.add_parser("config-reference", help="print (or --write, --check) the configuration "
                                                              "reference generated from the config models")
    reference.add_argument("--write", metavar="FILE", default=None)
    reference.add_argument("--check", metavar="FILE", default=None)
    reference.set_defaults(handler=cmd_config_reference)

    check = commands.add_parser("check-config", help="validate a config file")
    check.add_argument("config")
    check.set_defaults(handler=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``llmgw`` console script."""
    args = build_parser().parse_args(argv)
    sys.exit(args.handler(args))


if __name__ == "__main__":
    main()
