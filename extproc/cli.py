"""The ``llmgw`` command: run the local stack, run extproc workers, check a config."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from rich.console import Console

from extproc.config import ConfigError, load_config
from extproc.launcher import ChildFailed, LocalStack, ProcessGroup, StackInfo, StackOptions, free_port

DEFAULT_CONFIG = "config/local.yaml"
console = Console(stderr=True, highlight=False)


class _Stop(Exception):
    """SIGINT/SIGTERM arrived."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # Further signals (Ctrl-C twice, a process group's SIGTERM) must not cut the cleanup short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stop


def _supervise(group: ProcessGroup) -> int:
    """Wait for a signal (exit 0) or a dead child (say which, exit 1); stop every child either way."""
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        while True:
            dead = group.first_exited()
            if dead is not None:
                console.print(f"[red]{dead.name} (pid {dead.pid}) exited with code {dead.proc.returncode}; "
                              f"stopping the stack. Its log: {dead.log_path}[/red]")
                return 1
            time.sleep(0.2)
    except _Stop:
        console.print("stopping...")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        group.stop()


def _print_welcome(info: StackInfo, model: str, started_in: float) -> None:
    base = info.base_url
    pods = ", ".join(u for urls in info.pod_urls.values() for u in urls) or "(none simulated)"
    print(f"""llmgw is up in {started_in:.1f} s

  gateway   {base}/v1        (Envoy; admin {info.admin_url})
  extproc   {info.extproc_address}
  pods      {pods}

Try it:

curl -sN {base}/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Hello!"}}]}}'

python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="local")
for chunk in client.chat.completions.create(
        model="{model}", stream=True, messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="", flush=True)
print()
EOF

Ctrl-C stops everything.""", flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    """``llmgw up``: simulated pods + extproc workers + Envoy, in the foreground."""
    started = time.monotonic()
    options = StackOptions(
        config_path=Path(args.config), run_dir=Path(args.run_dir), port=args.port, listen_host=args.host,
        workers=args.workers, envoy_yaml=Path(args.envoy_config) if args.envoy_config else None,
        log_level=args.log_level,
    )
    stack = LocalStack(options)
    try:
        info = stack.start()
    except (ConfigError, ChildFailed, FileNotFoundError) as error:
        console.print(f"[red]llmgw up failed: {error}[/red]")
        return 1
    config = load_config(info.config_path)
    model = config.models[0].aliases[0] if config.models[0].aliases else config.models[0].name
    _print_welcome(info, model, time.monotonic() - started)
    print(f"Logs: {stack.group.log_dir}/", flush=True)
    return _supervise(stack.group)


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
    if port == 0:
        port = free_port(host)
    group = ProcessGroup(Path(args.run_dir) / "logs")
    try:
        for i in range(workers):
            child = group.spawn(f"extproc-{i + 1}", [sys.executable, "-m", "extproc.server", "--config",
                                                   args.config, "--host", host, "--port", str(port),
                                                   "--log-level", args.log_level])
        for child in group.children:
            group.wait_ready_line(child, 20)
    except ChildFailed as error:
        console.print(f"[red]{error}[/red]")
        group.stop()
        return 1
    print(f"READY {host}:{port} ({workers} workers)", flush=True)
    return _supervise(group)


def cmd_check(args: argparse.Namespace) -> int:
    """``llmgw check-config``: validate a config file and summarise it."""
    try:
        config = load_config(args.config)
    except ConfigError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    for pool in config.pools.values():
        models = [m.name for m in config.models if m.pool is pool]
        print(f"pool {pool.name}: {len(pool.endpoints)} endpoints, models {', '.join(models)}")
    print("ok")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``llmgw``."""
    parser = argparse.ArgumentParser(prog="llmgw", description="An LLM API gateway on Envoy ext_proc.")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run the local stack: Envoy, extproc workers, simulated pods")
    up.add_argument("--config", default=DEFAULT_CONFIG, help=f"gateway config (default {DEFAULT_CONFIG})")
    up.add_argument("--port", type=int, default=10000, help="Envoy listener port (default 10000)")
    up.add_argument("--host", default="127.0.0.1", help="Envoy listener address (default 127.0.0.1)")
    up.add_argument("--workers", type=int, default=0, help="extproc processes (default: one per core)")
    up.add_argument("--envoy-config", default=None, help="Envoy config to patch (default envoy/envoy.yaml)")
    up.add_argument("--run-dir", default=".run", help="rendered configs and logs (default .run)")
    up.add_argument("--log-level", default="INFO")
    up.set_defaults(handler=cmd_up)

    serve = commands.add_parser("serve", help="run extproc workers only (one per core by default)")
    serve.add_argument("--config", required=True)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--host", default=None)
    serve.add_argument("--workers", type=int, default=0)
    serve.add_argument("--run-dir", default=".run")
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(handler=cmd_serve)

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
