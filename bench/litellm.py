"""The LiteLLM proxy in front of an OpenAI-compatible pod, fully offline: the baseline ``bench.compare``
sets beside the gateway.

LiteLLM is pinned (``LITELLM_VERSION``) and lives in its own virtualenv, ``.venv-litellm/`` at the
repository root (never in the project's): ``ensure_venv()`` creates it on first use. 1.108.7 is the
newest release whose ``[proxy]`` extra this machine's package index can resolve: from 1.108.8 on, the
extra pins ``litellm-enterprise``, ``litellm-proxy-extras`` or ``litellm-proxy`` releases it lacks.

``start_proxy()`` writes a config mapping each model name to ``openai/<name>`` at
``http://<upstream>/v1`` and starts ``litellm --config ... --host 127.0.0.1 --port <free>
--num_workers 1`` (uvicorn, one process) in its own session, waiting for ``/health/liveliness``.
The proxy gets a minimal environment (PATH, HOME, LANG, TMPDIR: no ``*_PROXY``, ``DATABASE_URL``,
``REDIS_*`` or ``LITELLM_*`` from the caller) plus these settings, read from LiteLLM's source:

- ``LITELLM_LOCAL_MODEL_COST_MAP=True``: else ``import litellm`` GETs the cost map from
  raw.githubusercontent.com (5 s timeout, retried in a thread) before falling back to the bundled copy;
- ``LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS``, ``_BLOG_POSTS``, ``_AUTOROUTER_PRESETS``,
  ``_POLICY_TEMPLATES=True``: the same for the other GitHub-hosted files it fetches lazily;
- ``LITELLM_TELEMETRY_DISABLED=True``: vetoes its usage telemetry (off anyway without a database);
- ``HF_HUB_OFFLINE=1``, ``HF_HUB_DISABLE_TELEMETRY=1``, ``DO_NOT_TRACK=1``: Hugging Face tokenizers
  (used only to count tokens of HF models) never reach the Hub; tiktoken needs nothing: LiteLLM
  points ``TIKTOKEN_CACHE_DIR`` at its bundled encodings itself;
- ``NO_PROXY=*``, ``DISABLE_AIOHTTP_TRUST_ENV=True``: the upstream is reached directly;
- ``LITELLM_MODE=PRODUCTION``: no ``.env`` is loaded from the working directory;
- ``general_settings.disable_model_info_refresh``: no ``GET /v1/models`` to the upstream at start and
  every 5 minutes (a background poll, not the request path);
- ``LITELLM_LOG=ERROR`` (LiteLLM's loggers and uvicorn's, so no access log line per request),
  ``GRACEFUL_SHUTDOWN_TIMEOUT=5`` (SIGTERM drains for 5 s, not 30);
- no master key (``LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY=True``, without which this
  release refuses to start), or ``master_key=`` for one that every client must send.

No database, Redis, cache or callback is configured: each request takes LiteLLM's default path
(auth, router, the OpenAI provider over its aiohttp transport, cost and usage accounting). The
first chat after start costs ~0.6 s more, lazy imports (CPU, no I/O): warm it up before measuring.
Checked with ``strace -f -e trace=connect`` (``--selftest`` does it when strace is installed):
with these settings the proxy connects only to the upstream; without them it sends DNS queries
for the cost map's host at import.

    python -m bench.litellm --selftest    # a simulated pod, LiteLLM before it, one plain and one
                                          # streamed chat with the openai client: one JSON line
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml

LITELLM_VERSION = "1.108.7"
REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"
VENV = Path(__file__).resolve().parent.parent / ".venv-litellm"
SIM_MODEL = "llama-3-8b-instruct"
_START_ATTEMPTS = 3  # a probed free port may be taken before LiteLLM binds it
_KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ")
_CONNECT = re.compile(r'connect\(\d+, \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), '
                      r'(?:sin_addr=inet_addr\("([^"]+)"\)|sin6_flowinfo=[^,]*, inet_pton\(AF_INET6, "([^"]+)")')


def _installed_version(venv: Path) -> str | None:
    """The LiteLLM release in ``venv`` (from its dist-info folder's name), or None."""
    if not (venv / "bin" / "litellm").exists():
        return None
    for info in venv.glob("lib/python*/site-packages/litellm-*.dist-info"):
        return info.name.removeprefix("litellm-").removesuffix(".dist-info")
    return None


def ensure_venv() -> Path:
    """``.venv-litellm/`` with ``LITELLM_VERSION`` installed, created (``python -m venv`` + pip) when
    missing or holding another release; a folder check only when it is already right."""
    if _installed_version(VENV) == LITELLM_VERSION:
        return VENV
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"bench.litellm: creating {VENV}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    print(f"bench.litellm: pip install {REQUIREMENT} into {VENV} (about a minute)", file=sys.stderr, flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", REQUIREMENT],
                   check=True, stdout=sys.stderr)
    found = _installed_version(VENV)
    if found != LITELLM_VERSION:
        raise RuntimeError(f"{VENV}: pip installed litellm {found}, not {LITELLM_VERSION}")
    print(f"bench.litellm: litellm {found} ready", file=sys.stderr, flush=True)
    return VENV


def proxy_config(upstream: str | dict[str, str], models: list[str]) -> dict[str, object]:
    """LiteLLM's config: each model name served by ``openai/<name>`` at ``http://<upstream>/v1``
    (``upstream``: one host:port for all, or one per model name)."""
    where = upstream if isinstance(upstream, dict) else dict.fromkeys(models, upstream)
    return {
        "model_list": [{"model_name": name,
                        "litellm_params": {"model": f"openai/{name}", "api_base": f"http://{where[name]}/v1",
                                           "api_key": "sk-bench-dummy"}}
                       for name in models],
        "general_settings": {"disable_model_info_refresh": True},
    }


def proxy_env(venv: Path, master_key: str | None = None) -> dict[str, str]:
    """The proxy's whole environment: a few of ours, then the settings the module docstring lists."""
    env = {name: os.environ[name] for name in _KEPT_ENV if name in os.environ}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env.update({
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
        "LITELLM_LOCAL_BLOG_POSTS": "True",
        "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
        "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
        "LITELLM_TELEMETRY_DISABLED": "True",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1",
        "NO_PROXY": "*",
        "DISABLE_AIOHTTP_TRUST_ENV": "True",
        "LITELLM_MODE": "PRODUCTION",
        "LITELLM_LOG": "ERROR",
        "GRACEFUL_SHUTDOWN_TIMEOUT": "5",
    })
    if master_key is None:
        env["LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY"] = "True"
    else:
        env["LITELLM_MASTER_KEY"] = master_key
    return env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(url: str) -> bool:
    # No proxy handler: the caller's *_PROXY variables must not reroute a loopback probe.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def start_proxy(upstream: str | dict[str, str], models: list[str], log_dir: Path, *, master_key: str | None = None,
                timeout_s: float = 180.0, trace_connects: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start LiteLLM before ``upstream`` (host:port, or one per model) serving ``models``; return it and its base URL
    (``http://127.0.0.1:PORT``, the OpenAI API under ``/v1``) once ``/health/liveliness`` answers.

    Config and output (``litellm.yaml``, ``litellm.log``) go to ``log_dir``. The process leads its
    own session: ``stop_proxy`` ends the group. ``master_key``: clients must send it as their bearer
    token (this release answers a request without it with a 500, not a 401: its error path imports
    prisma, which ``[proxy]`` does not install). ``trace_connects``: run it under
    ``strace -f -e trace=connect`` writing there (slower; for checking where it connects).
    """
    venv = ensure_venv()
    log_dir = log_dir.resolve()  # the proxy runs in it
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / "litellm.yaml"
    config.write_text(yaml.safe_dump(proxy_config(upstream, models), sort_keys=False))
    log = log_dir / "litellm.log"
    for _attempt in range(_START_ATTEMPTS):
        port = _free_port()
        argv = [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
                "--port", str(port), "--num_workers", "1"]
        if trace_connects is not None:
            argv = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace_connects), *argv]
        with log.open("ab") as sink:
            proc = subprocess.Popen(argv, cwd=log_dir, env=proxy_env(venv, master_key), stdin=subprocess.DEVNULL,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if _answers(f"{base_url}/health/liveliness"):
                return proc, base_url
            time.sleep(0.1)
        if proc.poll() is None:
            stop_proxy(proc)
            raise TimeoutError(f"LiteLLM not answering on {base_url} after {timeout_s:.0f} s; {log}:\n{_tail(log)}")
        if "address already in use" not in _tail(log).lower():
            break
    raise RuntimeError(f"LiteLLM exited with status {proc.returncode}; {log}:\n{_tail(log)}")


def stop_proxy(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM the proxy's process group, SIGKILL it if still there after ``timeout_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # exited between poll() and killpg()
        proc.wait()


def foreign_connects(trace: Path, upstream: str) -> list[str]:
    """host:port of each TCP/UDP connect in an ``strace -e trace=connect`` log other than ``upstream``."""
    seen: set[str] = set()
    for match in _CONNECT.finditer(trace.read_text(errors="replace")):
        port, v4, v6 = match.groups()
        target = f"{v4}:{port}" if v4 else f"[{v6}]:{port}"
        if target != upstream:
            seen.add(target)
    return sorted(seen)


@dataclass(frozen=True, slots=True)
class ChatCheck:
    """What one plain and one streamed chat through the proxy returned."""

    plain_ok: bool
    stream_ok: bool
    content_chunks: int
    usage_seen: bool


def check_chats(base_url: str, model: str, api_key: str = "sk-bench-dummy") -> ChatCheck:
    """One plain and one streamed chat (``stream_options.include_usage``) with the official client."""
    from openai import DefaultHttpxClient, OpenAI  # only the self-test needs the client
    from openai.types.chat import ChatCompletionMessageParam

    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello in five words."}]
    # trust_env=False: the caller's *_PROXY variables must not reroute loopback requests.
    with DefaultHttpxClient(trust_env=False, timeout=60) as http:
        client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, http_client=http)
        plain = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        plain_ok = bool(plain.choices and plain.choices[0].message.content and plain.usage)
        chunks, usage = 0, None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=8, stream=True,
                                                    stream_options={"include_usage": True}):
            chunks += sum(1 for choice in chunk.choices if choice.delta.content)
            usage = chunk.usage or usage
    usage_seen = usage is not None and usage.completion_tokens > 0
    return ChatCheck(plain_ok, chunks > 0 and usage_seen, chunks, usage_seen)


def _start_sim(model: str) -> tuple[subprocess.Popen[str], str]:
    sim = subprocess.Popen([sys.executable, "-m", "llmgw_sim", "--host", "127.0.0.1", "--port", "0", "--model", model,
                            "--time-scale", "0", "--log-level", "ERROR"],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert sim.stdout is not None
    for line in sim.stdout:  # ends at READY, or at EOF if it died
        if line.startswith("READY "):
            return sim, line.split()[1].removeprefix("http://")
    sim.kill()
    raise RuntimeError(f"llmgw_sim did not start (exit {sim.wait()})")


def selftest() -> dict[str, object]:
    """A simulated pod, LiteLLM before it, one plain and one streamed chat; then (with strace) the
    same start traced, for where it connects."""
    ensure_venv()
    sim, upstream = _start_sim(SIM_MODEL)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-litellm-") as workdir:
            started = time.monotonic()
            proc, base_url = start_proxy(upstream, [SIM_MODEL], Path(workdir) / "plain")
            startup_s = time.monotonic() - started
            try:
                check = check_chats(base_url, SIM_MODEL)
            finally:
                stop_proxy(proc)
            foreign: list[str] | None = None
            if shutil.which("strace"):
                trace = Path(workdir) / "connects.strace"
                proc, base_url = start_proxy(upstream, [SIM_MODEL], Path(workdir) / "traced", trace_connects=trace)
                try:
                    check_chats(base_url, SIM_MODEL)
                finally:
                    stop_proxy(proc)
                foreign = foreign_connects(trace, upstream)
    finally:
        os.killpg(sim.pid, signal.SIGTERM)
        sim.wait(10)
    return {"litellm": LITELLM_VERSION, "startup_s": round(startup_s, 2), "plain_ok": check.plain_ok,
            "stream_ok": check.stream_ok, "stream_content_chunks": check.content_chunks,
            "usage_seen": check.usage_seen, "connects_besides_upstream": foreign}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.litellm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selftest", action="store_true", help="run the end-to-end check, print one JSON line")
    parser.add_argument("--ensure-venv", action="store_true", help=f"only create {VENV.name}/ if needed")
    args = parser.parse_args()
    if args.selftest:
        result = selftest()
        print(orjson.dumps(result).decode(), flush=True)
        ok = result["plain_ok"] and result["stream_ok"] and not result["connects_besides_upstream"]
        raise SystemExit(0 if ok else 1)
    if args.ensure_venv:
        print(ensure_venv())
        return
    parser.print_help()


if __name__ == "__main__":
    main()
