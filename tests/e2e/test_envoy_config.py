"""The shipped envoy.yaml is valid for the real Envoy binary, as is and as the stack patches it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from extproc import envoyconf

ROOT = Path(__file__).resolve().parents[2]


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([envoyconf.envoy_binary(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                          capture_output=True, text=True, timeout=60)


def test_shipped_envoy_yaml_validates() -> None:
    result = _validate(ROOT / "envoy" / "envoy.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_rendered_envoy_yaml_validates(tmp_path: Path) -> None:
    rendered = envoyconf.render(ROOT / "envoy" / "envoy.yaml", listen_port=12001, extproc_port=12002,
                                admin_port=12003, coordinator=("127.0.0.1", 12004))
    result = _validate(envoyconf.write(rendered, tmp_path / "envoy.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_refuses_a_config_without_the_named_listener(tmp_path: Path) -> None:
    source = tmp_path / "other.yaml"
    source.write_text((ROOT / "envoy" / "envoy.yaml").read_text().replace("name: llm_gateway", "name: other"))
    with pytest.raises(KeyError, match="llm_gateway"):
        envoyconf.render(source, listen_port=1, extproc_port=2, admin_port=3)


def test_filters_decide_then_read_the_response_then_route() -> None:
    rendered = envoyconf.render(ROOT / "envoy" / "envoy.yaml", listen_port=1, extproc_port=2, admin_port=3,
                                access_log_flush_s=20)
    listener = rendered["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = manager["http_filters"]
    # Request bodies are decoded (gzip, br, zstd) before extproc reads them; no second ext_proc filter:
    # the response is read by Envoy itself (Lua), never streamed to Python.
    assert [f["typed_config"]["@type"].rpartition(".")[2] for f in filters] == [
        "Decompressor", "Decompressor", "Decompressor", "ExternalProcessor", "Lua", "Router"]
    assert filters[3]["typed_config"]["metadata_options"]["receiving_namespaces"]["untyped"] == ["llmgw"]
    assert "x-llmgw-strip-usage" in filters[4]["typed_config"]["default_source_code"]["inline_string"]
    # One access-log entry per request extproc decided on goes back to it; in-flight ones every 20 s.
    grpc_log = next(a for a in manager["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
    assert grpc_log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "llmgw_extproc"
    assert grpc_log["filter"]["metadata_filter"]["matcher"]["filter"] == "llmgw"
    assert manager["access_log_options"]["access_log_flush_interval"] == "20s"
