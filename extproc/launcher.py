"""Starting, watching and stopping the local stack's processes: pods, extproc workers, Envoy.

Used by ``llmgw up``, ``llmgw serve``, the end-to-end tests and the benchmarks, so all of them run
the same real processes the same way. Every child gets PR_SET_PDEATHSIG: if the launcher dies,
even by SIGKILL, its children are told to stop, so no orphan outlives it.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from extproc import envoyconf
from extproc.config import LEDGER_PATH_ENV, QUOTA_PATH_ENV, GatewaySpec, load_spec
from extproc.telemetry.metrics import MULTIPROC_ENV, MetricsServer, prepare_multiprocess_dir, serve_metrics

_PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """A child did not become ready, or exited while the stack was running."""


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when this process dies (Linux).

    ``prctl`` is looked up here, in the parent: between fork and exec the child may only make
    plain calls. If the parent died before ``prctl`` ran, the child exits at once.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it; tests never hard-code ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    """One started process, its log file and the line it printed when ready."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_line: str = ""

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid


def _copy_lines(source: IO[bytes], sink: IO[bytes]) -> None:
    for line in iter(source.readline, b""):
        sink.write(line)
        sink.flush()


@dataclass
class ProcessGroup:
    """Children started in order and stopped in reverse order."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              ready_line: bool = True) -> Child:
        """Start ``argv``; stderr goes to ``<log_dir>/<name>.log``, and so does stdout, after the
        READY line when ``ready_line`` (read it with `wait_ready_line`), from the start otherwise."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name.replace(' ', '-')}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 (the child holds its own copy)
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE if ready_line else log_file, stderr=log_file,
            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent(),
        )
        log_file.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def wait_ready_line(self, child: Child, timeout: float, prefix: str = "READY ") -> str:
        """Block until ``child`` prints a line starting with ``prefix``; then log the rest of its stdout."""
        assert child.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buffer = b""
        fd = child.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed(f"{child.name} was not ready within {timeout:.0f} s (see {child.log_path})")
            readable, _, _ = select.select([fd], [], [], min(left, 0.2))
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = child.proc.wait()
                    raise ChildFailed(f"{child.name} exited with code {code} before it was ready "
                                      f"(see {child.log_path})")
                buffer += chunk
                while b"\n" in buffer:
                    line, _, buffer = buffer.partition(b"\n")
                    text = line.decode(errors="replace").strip()
                    if text.startswith(prefix):
                        child.ready_line = text[len(prefix):]
                        self._log_rest(child, buffer)
                        return child.ready_line
            elif child.proc.poll() is not None:
                raise ChildFailed(f"{child.name} exited with code {child.proc.returncode} before it was ready "
                                  f"(see {child.log_path})")

    def _log_rest(self, child: Child, pending: bytes) -> None:
        sink = open(child.log_path, "ab")  # noqa: SIM115 (closed with the daemon thread's process)
        sink.write(pending)
        assert child.proc.stdout is not None
        threading.Thread(target=_copy_lines, args=(child.proc.stdout, sink), daemon=True).start()

    def first_exited(self) -> Child | None:
        """A child that has exited, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every child (newest first), then SIGKILL whatever is left after ``grace``."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in reversed(self.children):
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            if child.proc.stdout is not None:
                child.proc.stdout.close()
        self.children.clear()


def node_state_env(run_dir: Path) -> dict[str, str]:
    """Where a node's extproc workers keep what they share without Redis: quotas and the ledger."""
    return {QUOTA_PATH_ENV: str(run_dir / "quota.sqlite"), LEDGER_PATH_ENV: str(run_dir / "usage.jsonl")}


def start_extproc_workers(group: ProcessGroup, config_path: str | Path, host: str, port: int, count: int,
                          log_level: str, env: dict[str, str], ready_timeout: float) -> None:
    """Start ``count`` extproc worker processes sharing ``host:port`` and wait until each is ready."""
    started = [
        group.spawn(f"extproc-{i + 1}", [
            sys.executable, "-m", "extproc.server", "--config", str(config_path),
            "--host", host, "--port", str(port), "--log-level", log_level,
        ], env=env)
        for i in range(count)
    ]
    for child in started:
        group.wait_ready_line(child, ready_timeout)


def wait_http_ok(url: str, timeout: float, child: Child | None = None) -> None:
    """Poll ``url`` until it answers 200 (Envoy admin ``/ready``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.proc.poll() is not None:
            raise ChildFailed(f"{child.name} exited with code {child.proc.returncode} (see {child.log_path})")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise ChildFailed(f"{url} did not answer 200 within {timeout:.0f} s")


# ---------------------------------------------------------------------------------------------
# The local stack


@dataclass
class StackOptions:
    """What ``llmgw up`` (and the tests) start."""

    config_path: Path
    run_dir: Path
    port: int = 10000
    listen_host: str = "127.0.0.1"
    workers: int = 0  # 0: from config, then one per core
    envoy_yaml: Path | None = None
    envoy_concurrency: int | None = None
    sim_args: tuple[str, ...] = ()
    log_level: str = "INFO"
    ready_timeout: float = 20.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the extproc workers (keys)
    metrics_port: int | None = None  # serve the workers' summed Prometheus /metrics here (0: a free port)
    # Last edit of the rendered Envoy config, given the pods' URLs (benchmarks add a direct listener).
    envoy_patch: Callable[[dict[str, Any], dict[str, list[str]]], None] | None = None


@dataclass
class StackInfo:
    """Where the started stack listens."""

    base_url: str
    admin_url: str
    extproc_address: str
    pod_urls: dict[str, list[str]]
    config_path: Path
    log_dir: Path
    metrics_url: str | None = None


class LocalStack:
    """Simulated pods, N extproc workers sharing one port, and a real Envoy in front."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.group = ProcessGroup(options.run_dir / "logs")
        self.info: StackInfo | None = None
        self.metrics: MetricsServer | None = None

    def start(self) -> StackInfo:
        """Start everything and wait until Envoy is ready; on any failure stop what started."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> StackInfo:
        opts = self.options
        opts.run_dir.mkdir(parents=True, exist_ok=True)
        spec = load_spec(opts.config_path)
        pod_urls = self._start_pods(spec)
        resolved = _with_endpoints(spec, pod_urls)
        config_path = opts.run_dir / "llmgw.resolved.yaml"
        config_path.write_text(yaml.safe_dump(resolved, sort_keys=False))

        workers = opts.workers or spec.server.workers or os.cpu_count() or 1
        extproc_port = free_port()
        env = {**node_state_env(opts.run_dir), **opts.env}
        if opts.metrics_port is not None:
            env[MULTIPROC_ENV] = str(prepare_multiprocess_dir(opts.run_dir / "metrics"))
        start_extproc_workers(self.group, config_path, "127.0.0.1", extproc_port, workers, opts.log_level,
                              env, opts.ready_timeout)
        if opts.metrics_port is not None:
            self.metrics = serve_metrics(opts.metrics_port, opts.listen_host, multiproc_dir=Path(env[MULTIPROC_ENV]))

        admin_port = free_port()
        rendered = envoyconf.render(
            opts.envoy_yaml or envoyconf.default_envoy_yaml(), listen_port=opts.port,
            listen_host=opts.listen_host, extproc_port=extproc_port, admin_port=admin_port,
            pools=resolved["pools"],
        )
        if opts.envoy_patch is not None:
            opts.envoy_patch(rendered, pod_urls)
        envoy_path = envoyconf.write(rendered, opts.run_dir / "envoy.yaml")
        envoy = self.group.spawn("envoy", [  # its access log (stdout) goes straight to envoy.log
            envoyconf.envoy_binary(), "-c", str(envoy_path), "--use-dynamic-base-id",
            "--concurrency", str(opts.envoy_concurrency or os.cpu_count() or 1), "--log-level", "warn",
        ], ready_line=False)
        admin_url = f"http://127.0.0.1:{admin_port}"
        wait_http_ok(f"{admin_url}/ready", opts.ready_timeout, envoy)
        metrics_url = f"http://127.0.0.1:{self.metrics.port}/metrics" if self.metrics else None
        self.info = StackInfo(f"http://127.0.0.1:{opts.port}", admin_url, f"127.0.0.1:{extproc_port}",
                              pod_urls, config_path, self.group.log_dir, metrics_url)
        return self.info

    def _start_pods(self, spec: GatewaySpec) -> dict[str, list[str]]:
        pod_urls: dict[str, list[str]] = {}
        started: list[tuple[str, object]] = []
        for pool in spec.pools:
            served = [m.name for m in spec.models if m.pool == pool.name]
            for i in range(pool.simulate):
                argv = [sys.executable, "-m", "extproc.sim", "--host", "127.0.0.1", "--port", "0",
                        *[arg for name in served for arg in ("--model", name)], *self.options.sim_args]
                started.append((pool.name, self.group.spawn(f"pod-{pool.name}-{i + 1}", argv)))
        for pool_name, child in started:
            url = self.group.wait_ready_line(child, self.options.ready_timeout)  # type: ignore[arg-type]
            pod_urls.setdefault(pool_name, []).append(url)
        return pod_urls

    def stop(self) -> None:
        """Stop every child (and the metrics endpoint)."""
        self.group.stop()
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None

    def __enter__(self) -> StackInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _with_endpoints(spec: GatewaySpec, pod_urls: dict[str, list[str]]) -> dict[str, object]:
    """The spec as YAML data, simulated pools given their pods' addresses."""
    document = spec.model_dump(mode="json", by_alias=True, exclude_defaults=False)
    for pool in document["pools"]:
        urls = pod_urls.get(pool["name"], [])
        if urls:
            pool["endpoints"] = [*pool["endpoints"], *(u.removeprefix("http://") for u in urls)]
            pool["simulate"] = 0
    return document
