"""Every Envoy config the builder makes loads in the real Envoy binary (``envoy --mode validate``):
the local stack's and compose's bootstraps as they are, the snippet spliced into an unrelated
bootstrap, and the Istio EnvoyFilters applied to a bootstrap shaped like istio-proxy's."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc import envoyconf
from extproc.config import GatewaySpec
from extproc.envoybuild import names
from extproc.envoybuild.addresses import LOCAL, Addresses, HostPort
from extproc.envoybuild.bootstrap import bootstrap
from extproc.envoybuild.istio import SDS_CLUSTER
from extproc.envoybuild.output import data
from extproc.envoybuild.snippet import snippet, splice
from extproc.envoybuild.targets import TARGETS, load

ROOT = Path(__file__).resolve().parents[2]
ROUTER = {"name": names.ROUTER_FILTER,
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def _valid(config: dict[str, Any] | Path, tmp_path: Path) -> None:
    path = config if isinstance(config, Path) else envoyconf.write(config, tmp_path / "envoy.yaml")
    result = envoyconf.validate(path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "OK" in result.stdout


def _spec(target: str) -> GatewaySpec:
    return load(ROOT / TARGETS[target].config)


def _static(name: str, port: int, *, http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {"name": name, "connect_timeout": "1s", "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}
    if http2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def listener(name: str, port: int, vhost: str, routes: list[dict[str, Any]]) -> dict[str, Any]:
    """A listener whose connection manager has one virtual host of ``routes`` and only the router."""
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": names.CONNECTION_MANAGER, "typed_config": {
                "@type": HCM_TYPE, "stat_prefix": name,
                "route_config": {"name": name, "virtual_hosts": [{"name": vhost, "domains": ["*"], "routes": routes}]},
                "http_filters": [copy.deepcopy(ROUTER)]}}]}]}


def healthz(body: str) -> dict[str, Any]:
    """A route answering GET /healthz itself."""
    return {"name": "healthz", "match": {"path": "/healthz"},
            "direct_response": {"status": 200, "body": {"inline_string": body}}}


def unrelated_bootstrap(admin_port: int = 0, public_port: int = 0, internal_port: int = 0) -> dict[str, Any]:
    """An Envoy that knows nothing of llmgw: a public listener with a /healthz route, and a second
    listener of its own."""
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
            "static_resources": {"listeners": [
                listener("public", public_port, "site", [healthz("public ok")]),
                listener("internal", internal_port, "internal", [healthz("internal ok")])]}}


# -- the bootstraps -----------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["local", "compose"])
def test_checked_in_bootstrap_validates(target: str, tmp_path: Path) -> None:
    _valid(ROOT / TARGETS[target].out / "envoy.yaml", tmp_path)


def test_checked_in_tls_bootstrap_validates_with_its_certificate_in_place(tmp_path: Path) -> None:
    from extproc.envoybuild.targets import TLS_EXAMPLE

    certificate, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=x",
                    "-keyout", str(key), "-out", str(certificate)], check=True, capture_output=True)
    text = (ROOT / TARGETS["tls"].out / "envoy.yaml").read_text()
    assert TLS_EXAMPLE.certificate in text and TLS_EXAMPLE.private_key in text
    placed = tmp_path / "tls-envoy.yaml"
    placed.write_text(text.replace(TLS_EXAMPLE.certificate, str(certificate))
                      .replace(TLS_EXAMPLE.private_key, str(key)))
    _valid(placed, tmp_path)


def test_the_stack_s_bootstrap_validates(tmp_path: Path) -> None:
    # As `llmgw up` builds it: its own ports, two pools' pods, a coordinator.
    spec = GatewaySpec.model_validate({
        "pools": [{"name": "fast", "endpoints": ["127.0.0.1:12005"], "first_byte_timeout_s": 2.5},
                  {"name": "slow", "endpoints": ["127.0.0.1:12006", "127.0.0.1:12005"], "batching": {"enabled": True}}],
        "models": [{"name": "m", "pool": "fast"}], "quota": {"lease_ttl_s": 10}})
    at = Addresses(listener=HostPort("127.0.0.1", 12001), admin=HostPort("127.0.0.1", 12003),
                   extproc=HostPort("127.0.0.1", 12002), coordinator=HostPort("127.0.0.1", 12004))
    _valid(data(bootstrap(spec, at)), tmp_path)


# -- a hand-written file (llmgw up --envoy-config FILE) ---------------------------------------------


def test_a_hand_written_file_is_patched_and_still_validates(tmp_path: Path) -> None:
    source = envoyconf.write(data(bootstrap(_spec("local"), LOCAL)), tmp_path / "mine.yaml")
    rendered = envoyconf.render(source, listen_port=12001, extproc_port=12002, admin_port=12003,
                                coordinator=("127.0.0.1", 12004), access_log_flush_s=20, pools=[
                                    {"name": "local", "endpoints": ["127.0.0.1:12005"], "first_byte_timeout_s": 3}])
    routes = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes].count("direct-local") == 1  # the file's own replaced, not doubled
    _valid(rendered, tmp_path)


def test_render_refuses_a_config_without_the_named_listener(tmp_path: Path) -> None:
    source = tmp_path / "other.yaml"
    source.write_text((ROOT / "envoy" / "envoy.yaml").read_text().replace("name: llm_gateway", "name: other"))
    with pytest.raises(KeyError, match="llm_gateway"):
        envoyconf.render(source, listen_port=1, extproc_port=2, admin_port=3)


# -- the snippet, in an Envoy that serves something else -----------------------------------------------


def test_snippet_spliced_into_an_unrelated_bootstrap_validates(tmp_path: Path) -> None:
    pieces = snippet(_spec("snippet"), LOCAL)
    _valid(splice(unrelated_bootstrap(), "public", pieces), tmp_path)


def test_checked_in_snippet_files_splice_as_the_readme_says(tmp_path: Path) -> None:
    folder = ROOT / TARGETS["snippet"].out
    config = unrelated_bootstrap()
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][0:0] = yaml.safe_load((folder / "http_filters.yaml").read_text())
    host = manager["route_config"]["virtual_hosts"][0]
    host["routes"][0:0] = yaml.safe_load((folder / "routes.yaml").read_text())
    config["static_resources"]["clusters"] = yaml.safe_load((folder / "clusters.yaml").read_text())
    fields = yaml.safe_load((folder / "access_log.yaml").read_text())
    manager["access_log"] = fields["access_log"]
    manager["access_log_options"] = fields["access_log_options"]
    manager.update(yaml.safe_load((folder / "local_reply_config.yaml").read_text()))
    _valid(config, tmp_path)


# -- Istio: the EnvoyFilters applied as istio-proxy would ------------------------------------------


def _merge(into: dict[str, Any], value: dict[str, Any]) -> None:
    """Proto merge of YAML data: messages merge, repeated fields append, scalars replace."""
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(into.get(key), dict):
            _merge(into[key], item)
        elif isinstance(item, list) and isinstance(into.get(key), list):
            into[key].extend(copy.deepcopy(item))
        else:
            into[key] = copy.deepcopy(item)


def apply_envoy_filters(config: dict[str, Any], resources: list[dict[str, Any]]) -> dict[str, Any]:
    """``config`` with the patches of ``resources`` applied in order, for the operations llmgw's
    EnvoyFilters use (a small stand-in for istiod, enough to hand the result to Envoy)."""
    config = copy.deepcopy(config)
    statics = config["static_resources"]
    managers = [f["typed_config"] for listener_ in statics["listeners"] for chain in listener_["filter_chains"]
                for f in chain["filters"] if f["name"] == names.CONNECTION_MANAGER]
    for resource in resources:
        for patch in resource["spec"]["configPatches"]:
            where, operation, value = patch["applyTo"], patch["patch"]["operation"], patch["patch"]["value"]
            assert patch["match"]["context"] == "GATEWAY"
            if (where, operation) == ("LISTENER", "MERGE"):
                for item in statics["listeners"]:
                    _merge(item, value)
            elif (where, operation) == ("HTTP_FILTER", "INSERT_BEFORE"):
                assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == names.ROUTER_FILTER
                for manager in managers:
                    chain = manager["http_filters"]
                    at = next(i for i, f in enumerate(chain) if f["name"] == names.ROUTER_FILTER)
                    chain.insert(at, copy.deepcopy(value))
            elif (where, operation) == ("NETWORK_FILTER", "MERGE"):
                for manager in managers:
                    _merge(manager, {k: v for k, v in value["typed_config"].items() if k != "@type"})
            elif (where, operation) == ("HTTP_ROUTE", "INSERT_FIRST"):
                for manager in managers:
                    for host in manager["route_config"]["virtual_hosts"]:
                        host["routes"].insert(0, copy.deepcopy(value))
            elif (where, operation) == ("CLUSTER", "ADD"):
                statics["clusters"].append(copy.deepcopy(value))
            else:
                raise AssertionError(f"no stand-in for {where} {operation}")
    return config


def istio_gateway_bootstrap() -> dict[str, Any]:
    """What matters of an Istio gateway's Envoy here: the SDS and xDS clusters of its bootstrap,
    ADS, and the listener a Gateway + VirtualService make (a virtual host ``*:80``, a 404)."""
    unknown = {"name": "unknown-url", "match": {"prefix": "/"}, "direct_response": {"status": 404}}
    return {
        "node": {"id": "router~10.0.0.1~llmgw-gateway-0.llmgw~llmgw.svc.cluster.local",
                 "cluster": "llmgw-gateway.llmgw"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "dynamic_resources": {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3", "grpc_services": [
            {"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
        "static_resources": {"listeners": [listener("0.0.0.0_8080", 0, "*:80", [unknown])],
                             "clusters": [_static(SDS_CLUSTER, 1, http2=True), _static("xds-grpc", 2, http2=True)]},
    }


def test_istio_envoyfilters_applied_to_a_gateway_validate(tmp_path: Path) -> None:
    resources = list(yaml.safe_load_all((ROOT / TARGETS["istio"].out / "envoyfilter.yaml").read_text()))
    assert [r["kind"] for r in resources] == ["EnvoyFilter", "EnvoyFilter"]
    patched = apply_envoy_filters(istio_gateway_bootstrap(), resources)
    manager = patched["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in manager["http_filters"]] == [
        *names.DECOMPRESSORS, names.EXT_PROC_FILTER, names.RESPONSE_FILTER, names.ROUTER_FILTER]
    routes = [r["name"] for r in manager["route_config"]["virtual_hosts"][0]["routes"]]
    # INSERT_FIRST listed last to first: the gateway's routes keep their order, ahead of the mesh's.
    assert routes == ["direct-general", "direct", "batch", "no_route", "unknown-url"]
    _valid(patched, tmp_path)
