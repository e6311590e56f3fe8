"""The typed Envoy config builder (extproc.envoybuild), without Envoy: the checked-in copies are what
it builds now, and each target has the shape the gateway relies on. tests/e2e/test_envoy_config.py
hands every output to the real Envoy binary; tests/e2e/test_snippet_e2e.py runs traffic through one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.cli import main
from extproc.config import ConfigError, GatewaySpec
from extproc.envoybuild import names
from extproc.envoybuild.addresses import COMPOSE, COMPOSE_PODS, LOCAL, Addresses, HostPort
from extproc.envoybuild.bootstrap import bootstrap
from extproc.envoybuild.filters import lua_source
from extproc.envoybuild.istio import MESH, envoy_filters
from extproc.envoybuild.output import data
from extproc.envoybuild.snippet import API_PREFIX, snippet
from extproc.envoybuild.targets import TARGETS, load, render, write

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "extproc" / "envoybuild"
MODEL = {"name": "m", "pool": "fast"}
POOLS = [{"name": "fast", "endpoints": ["10.0.0.1:8000"], "first_byte_timeout_s": 2.5},
         {"name": "slow", "endpoints": ["10.0.0.2:8000", "10.0.0.1:8000"]}]


def spec(**fields: Any) -> GatewaySpec:
    return GatewaySpec.model_validate({"pools": POOLS, "models": [MODEL], **fields})


def manager(config: dict[str, Any]) -> dict[str, Any]:
    listener = next(item for item in config["static_resources"]["listeners"] if item["name"] == names.LISTENER)
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


def endpoints(item: dict[str, Any]) -> list[tuple[str, int]]:
    hosts = item["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [(h["endpoint"]["address"]["socket_address"]["address"],
             h["endpoint"]["address"]["socket_address"]["port_value"]) for h in hosts]


# -- the checked-in copies ------------------------------------------------------------------------


@pytest.mark.parametrize("target", list(TARGETS))
def test_checked_in_copy_is_what_the_builder_makes(target: str, tmp_path: Path) -> None:
    built = write(target, load(ROOT / TARGETS[target].config), tmp_path)
    for path in built:
        checked_in = ROOT / TARGETS[target].out / path.name
        assert checked_in.is_file(), f"{checked_in} is missing: run `llmgw envoy-config --target {target}`"
        assert checked_in.read_text() == path.read_text(), (
            f"{checked_in} is stale: run `llmgw envoy-config --target {target}` and commit the result")


def test_the_cli_offers_every_target() -> None:
    assert tuple(TARGETS) == names.TARGET_NAMES


def test_a_build_is_a_pure_function_of_the_config() -> None:
    first, again = render("istio", spec()), render("istio", spec())
    assert first == again
    assert render("local", spec()) != render("local", spec(envoy={"stream_idle_timeout_s": 42}))


def test_envoy_types_come_through_envoyapi_only() -> None:
    # envoyapi imports them once, with envoy-data-plane's deprecation warnings silenced.
    for path in PACKAGE.glob("*.py"):
        if path.name != "envoyapi.py":
            assert "envoy_data_plane" not in path.read_text(), f"{path.name}: import Envoy's types from envoyapi"


# -- the local stack's bootstrap -------------------------------------------------------------------


def test_filters_decide_then_read_the_response_then_route() -> None:
    hcm = manager(data(bootstrap(spec(quota={"lease_ttl_s": 30}), LOCAL)))
    filters = hcm["http_filters"]
    # Request bodies are decoded (gzip, br, zstd) before extproc reads them; no second ext_proc filter:
    # the response is read by Envoy itself (Lua), never streamed to Python.
    assert [f["typed_config"]["@type"].rpartition(".")[2] for f in filters] == [
        "Decompressor", "Decompressor", "Decompressor", "ExternalProcessor", "Lua", "Router"]
    assert not any(f.get("disabled") for f in filters)  # a dedicated gateway: every request meets extproc
    ext_proc = filters[3]["typed_config"]
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["llmgw"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc.get("failure_mode_allow", False) is False  # fail closed
    assert filters[4]["typed_config"]["default_source_code"]["inline_string"] == lua_source("response.lua")
    assert "x-llmgw-strip-usage" in lua_source("response.lua")
    # One access-log entry per request extproc decided on goes back to it; in-flight ones every TTL/3.
    grpc_log = next(a for a in hcm["access_log"] if a["name"] == "envoy.access_loggers.http_grpc")
    assert grpc_log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "llmgw_extproc"
    assert grpc_log["filter"]["metadata_filter"]["matcher"]["filter"] == "llmgw"
    assert hcm["access_log_options"]["access_log_flush_interval"] == "10s"


def test_each_pool_gets_a_route_with_its_first_byte_timeout() -> None:
    hcm = manager(data(bootstrap(spec(envoy={"stream_idle_timeout_s": 42}), LOCAL)))
    assert hcm["stream_idle_timeout"] == "42s"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes] == ["direct-fast", "direct-slow", "direct", "batch", "no_route"]
    timeouts = {r["name"]: r["route"]["retry_policy"]["per_try_idle_timeout"]
                for r in routes if "retry_policy" in r.get("route", {})}
    assert timeouts == {"direct-fast": "2.500s", "direct-slow": "120s", "direct": "120s"}  # 120 s: the default
    matched = {(h["name"], h["string_match"]["exact"]) for h in routes[0]["match"]["headers"]}
    assert matched == {("x-llmgw-route", "direct"), ("x-llmgw-pool", "fast")}


@pytest.mark.parametrize(("pools", "at", "expected", "discovery"), [
    (POOLS, LOCAL, [("10.0.0.1", 8000), ("10.0.0.2", 8000)], "STATIC"),  # every pool's pods, each once
    ([{"name": "fast", "simulate": 2}], LOCAL, [("127.0.0.1", 8000)], "STATIC"),  # none yet: `llmgw up` fills them
    (POOLS, COMPOSE, [("pod-a", 8000), ("pod-b", 8000)], "STRICT_DNS"),  # names: Envoy resolves them
], ids=["config-endpoints", "placeholder", "compose-names"])
def test_the_pods_cluster_lists(pools: list[dict[str, Any]], at: Addresses, expected: list[tuple[str, int]],
                                discovery: str) -> None:
    pods = cluster(data(bootstrap(GatewaySpec.model_validate({"pools": pools, "models": [MODEL]}), at)), "llm_pods")
    assert endpoints(pods) == expected
    assert pods["type"] == discovery
    assert pods["outlier_detection"]["consecutive_5xx"] == 5  # a digit in the field name survives


def test_compose_reaches_every_service_by_name() -> None:
    config = data(bootstrap(spec(), COMPOSE))
    assert config["admin"]["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9901}
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener == {"address": "0.0.0.0", "port_value": 10000}
    assert endpoints(cluster(config, "llmgw_extproc")) == [("extproc", 50051)]
    assert endpoints(cluster(config, "llm_coordinator")) == [("coordinator", 8081)]
    assert [HostPort(*e) for e in endpoints(cluster(config, "llm_pods"))] == list(COMPOSE_PODS)


def test_addresses_are_parsed_as_the_config_writes_them() -> None:
    assert HostPort.parse("10.0.0.1:8000") == HostPort("10.0.0.1", 8000) and HostPort("10.0.0.1", 1).is_ip
    assert HostPort.parse("[::1]:9") == HostPort("::1", 9) and HostPort("::1", 9).is_ip
    assert not HostPort("pod-a", 8000).is_ip


def test_an_empty_any_is_written_as_proto3_json_has_it() -> None:
    route = data(snippet(spec(), LOCAL).routes[0])
    enabled = route["typed_per_filter_config"][names.EXT_PROC_FILTER]
    assert enabled == {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}


# -- the snippet ----------------------------------------------------------------------------------


def test_snippet_filters_are_off_unless_a_gateway_route_turns_them_on() -> None:
    pieces = snippet(spec(), LOCAL)
    filters = [data(f) for f in pieces.http_filters]
    assert [f["name"] for f in filters] == [*names.DECOMPRESSORS, names.EXT_PROC_FILTER, names.RESPONSE_FILTER]
    assert all(f["disabled"] for f in filters)
    for route in (data(r) for r in pieces.routes):
        assert route["match"]["prefix"] == API_PREFIX  # nothing of the host Envoy's other paths
        assert set(route["typed_per_filter_config"]) == {f["name"] for f in filters}, route["name"]
        # What a dedicated gateway adds on its virtual host travels with each route here.
        assert "x-request-id" in [h["header"]["key"] for h in route["response_headers_to_add"]]
    assert [r.name for r in pieces.routes] == ["direct-fast", "direct-slow", "direct", "batch", "no_route"]
    assert [c.name for c in pieces.clusters] == ["llmgw_extproc", "llm_coordinator", "llm_pods"]
    assert [a.name for a in pieces.access_log] == ["envoy.access_loggers.http_grpc"]  # no stdout log of ours


def test_snippet_readme_names_every_file() -> None:
    files = render("snippet", spec())
    readme = files.pop("README.md")
    for name in files:
        assert f"`{name}`" in readme


# -- Istio ----------------------------------------------------------------------------------------


def test_istio_patches_in_order() -> None:
    main_filter, replies = envoy_filters(spec())
    assert main_filter["metadata"] == {"name": "llmgw", "namespace": MESH.namespace}
    assert main_filter["spec"]["workloadSelector"]["labels"] == dict(MESH.gateway_labels)
    patches = main_filter["spec"]["configPatches"]
    assert [(p["applyTo"], p["patch"]["operation"]) for p in patches] == [
        ("LISTENER", "MERGE"), *[("HTTP_FILTER", "INSERT_BEFORE")] * 5, ("NETWORK_FILTER", "MERGE"),
        *[("HTTP_ROUTE", "INSERT_FIRST")] * 5, *[("CLUSTER", "ADD")] * 3]
    assert all(p["match"]["context"] == "GATEWAY" for p in patches)
    # Each INSERT_FIRST goes to the top: listed last to first, they end in the gateway's order.
    assert [p["patch"]["value"]["name"] for p in patches if p["applyTo"] == "HTTP_ROUTE"] == [
        "no_route", "batch", "direct", "direct-slow", "direct-fast"]
    assert [p["patch"]["value"]["name"] for p in patches if p["applyTo"] == "HTTP_FILTER"] == [
        *names.DECOMPRESSORS, names.EXT_PROC_FILTER, names.RESPONSE_FILTER]
    assert "local_reply_config" in replies["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]


def test_istio_clusters_use_the_mesh_s_endpoints_and_mtls() -> None:
    patches = envoy_filters(spec())[0]["spec"]["configPatches"]
    added = {p["patch"]["value"]["name"]: p["patch"]["value"] for p in patches if p["applyTo"] == "CLUSTER"}
    extproc = added["llmgw_extproc"]
    assert extproc["type"] == "EDS" and "load_assignment" not in extproc
    assert extproc["eds_cluster_config"]["service_name"] == "outbound|50051||llmgw-extproc.llmgw.svc.cluster.local"
    tls = extproc["transport_socket"]["typed_config"]
    assert tls["sni"] == "outbound_.50051_._.llmgw-extproc.llmgw.svc.cluster.local"
    common = tls["common_tls_context"]
    assert common["alpn_protocols"] == ["istio-peer-exchange", "istio", "h2"]  # gRPC: HTTP/2 in the mesh
    assert [s["name"] for s in common["tls_certificate_sds_secret_configs"]] == ["default"]
    validation = common["combined_validation_context"]
    assert validation["validation_context_sds_secret_config"]["name"] == "ROOTCA"
    sds = validation["validation_context_sds_secret_config"]["sds_config"]["api_config_source"]
    assert sds["grpc_services"][0]["envoy_grpc"]["cluster_name"] == "sds-grpc"
    assert validation["default_validation_context"]["match_typed_subject_alt_names"][0]["matcher"]["exact"] == (
        "spiffe://cluster.local/ns/llmgw/sa/llmgw-extproc")
    # The pods: mTLS to those with a sidecar, plain to the others (Istio's auto mTLS).
    matches = added["llm_pods"]["transport_socket_matches"]
    assert [(m["name"], m["match"]) for m in matches] == [
        ("tlsMode-istio", {"tlsMode": "istio"}), ("tlsMode-disabled", {})]


# -- loading configs, and the CLI -----------------------------------------------------------------


def test_a_config_map_s_llmgw_config_is_read(tmp_path: Path) -> None:
    body = yaml.safe_dump({"pools": POOLS, "models": [MODEL]})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "data": {"llmgw.yaml": body}}))
    assert [p.name for p in load(path).pools] == ["fast", "slow"]
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "data": {"other": "x"}}))
    with pytest.raises(ConfigError, match="data.llmgw.yaml"):
        load(path)


def test_llmgw_envoy_config_writes_a_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "llmgw.yaml"
    config.write_text(yaml.safe_dump({"pools": POOLS, "models": [MODEL]}))
    with pytest.raises(SystemExit) as done:
        main(["envoy-config", "--target", "snippet", "--config", str(config), "--out", str(tmp_path / "out")])
    assert done.value.code == 0
    written = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in written) == sorted(render("snippet", spec()))
    assert "direct-fast" in (tmp_path / "out" / "routes.yaml").read_text()


def test_llmgw_envoy_config_refuses_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("pools: []\nmodels: []\nunknown: 1\n")
    with pytest.raises(SystemExit) as done:
        main(["envoy-config", "--target", "local", "--config", str(config), "--out", str(tmp_path)])
    assert done.value.code == 2
    assert not (tmp_path / "envoy.yaml").exists()


def test_generated_files_say_so() -> None:
    for target in TARGETS:
        for name, text in render(target, spec()).items():
            if name.endswith(".yaml"):
                assert re.match(r"^# .*\n(# .*\n)*# Generated by `llmgw envoy-config --target", text), (target, name)
