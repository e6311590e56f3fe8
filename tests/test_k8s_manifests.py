"""The Kubernetes/Istio manifests (envoy/istio/), checked offline: every built-in kind against a
pinned Kubernetes version's schema (kubernetes-validate ships them), the CRDs (ServiceMonitor,
ScaledObject, EnvoyFilter) by structure, and everything against everything else: selectors against
pod labels, ports against containers, commands against the real CLI, autoscaler queries against the
metrics our processes export, the ConfigMap's llmgw config against the loader."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.cli import build_parser
from extproc.config import compile_spec, load_spec
from llmgw_sim.__main__ import parse_args as sim_args
from tests.test_compose import exported_metrics, promql_references

REPO = Path(__file__).resolve().parents[1]
ISTIO = REPO / "envoy" / "istio"
ENVOYFILTER = ISTIO / "envoyfilter.yaml"
KUBERNETES = "1.33.0"  # the schema version every built-in kind is validated against (strict: no unknown fields)
NOT_OBJECTS = {"kustomization.yaml", "prometheus-adapter-values.yaml"}  # tool inputs, not API objects
CRDS = {  # (apiVersion, kind) -> the fields their spec must have
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints"),
    ("keda.sh/v1alpha1", "ScaledObject"): ("scaleTargetRef", "triggers"),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): ("configPatches",),
    ("networking.istio.io/v1", "EnvoyFilter"): ("configPatches",),
    ("networking.istio.io/v1", "Gateway"): ("selector", "servers"),
    ("networking.istio.io/v1", "VirtualService"): ("hosts", "gateways"),
}
CONTROL = ("llmgw-extproc", "llmgw-coordinator", "llmgw-gateway")  # each with an HPA and a PDB
SCRAPED = ("llmgw-extproc", "llmgw-coordinator", "vllm")  # Services whose /metrics Prometheus reads


@dataclass(frozen=True)
class Doc:
    file: str
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def namespace(self) -> str | None:
        return self.body["metadata"].get("namespace")

    @property
    def id(self) -> str:
        return f"{self.file}:{self.kind}/{self.name}"


def load(path: Path) -> list[Doc]:
    return [Doc(path.name, body) for body in yaml.safe_load_all(path.read_text()) if body]


def documents(include_envoyfilter: bool = False) -> list[Doc]:
    """Every API object under envoy/istio/ (envoyfilter.yaml only when asked: another builder writes it)."""
    docs = []
    for path in sorted(ISTIO.glob("*.yaml")):
        if path.name in NOT_OBJECTS or (path == ENVOYFILTER and not include_envoyfilter):
            continue
        docs.extend(load(path))
    return docs


def of_kind(kind: str) -> list[Doc]:
    return [doc for doc in documents() if doc.kind == kind]


def one(kind: str, name: str) -> Doc:
    found = [doc for doc in of_kind(kind) if doc.name == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def is_builtin(doc: Doc) -> bool:
    return (doc.body["apiVersion"], doc.kind) not in CRDS


def pod_spec(deployment: Doc) -> dict[str, Any]:
    return deployment.body["spec"]["template"]["spec"]


def pod_labels(deployment: Doc) -> dict[str, str]:
    return deployment.body["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (plain labels, or ``matchLabels`` and ``matchExpressions``) against labels."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        plain = selector.get("matchLabels", {})
        expressions = selector.get("matchExpressions", [])
    else:
        plain, expressions = selector, []
    if not plain and not expressions:
        return False
    if any(labels.get(key) != value for key, value in plain.items()):
        return False
    for e in expressions:
        operator, key, values = e["operator"], e["key"], e.get("values", [])
        held = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


def is_istio_gateway(deployment: Doc) -> bool:
    """The Istio gateway's pods: Istio injects their proxy, command, probes and volumes."""
    annotations = deployment.body["spec"]["template"]["metadata"].get("annotations", {})
    return annotations.get("inject.istio.io/templates") == "gateway"


def python_deployments() -> list[Doc]:
    return [d for d in of_kind("Deployment") if not is_istio_gateway(d)]


def selected_deployment(selector: dict[str, str], namespace: str | None) -> Doc:
    matched = [d for d in of_kind("Deployment") if d.namespace == namespace and selects(selector, pod_labels(d))]
    assert len(matched) == 1, f"selector {selector} matches {[d.name for d in matched]}"
    return matched[0]


def container_ports(deployment: Doc) -> dict[str | int, int]:
    """Every container port of the pod, by name and by number."""
    ports: dict[str | int, int] = {}
    for container in pod_spec(deployment)["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def probes(deployment: Doc) -> Iterator[tuple[str, dict[str, Any]]]:
    for container in pod_spec(deployment)["containers"]:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in container:
                yield f"{container['name']}.{kind}", container[kind]


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (the schema leaves them unchecked): ``500m``, ``2``, ``1Gi``."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G|Ki|Mi|Gi)?", str(text))
    assert match, f"{text!r} is not a quantity"
    return float(match[1]) * units.get(match[2] or "", 1.0)


def llmgw_config_text() -> str:
    return str(one("ConfigMap", "llmgw-config").body["data"]["llmgw.yaml"])


def llmgw_config(tmp_path: Path) -> Any:
    path = tmp_path / "llmgw.yaml"
    path.write_text(llmgw_config_text())
    return compile_spec(load_spec(path), env={"LLMGW_REDIS_URL": "redis://redis.llmgw.svc:6379/0"})


def command_args(deployment: Doc) -> Any:
    """The container's command parsed by the real CLI: unknown flags fail here, not in the cluster."""
    command = pod_spec(deployment)["containers"][0]["command"]
    if command[0] == "llmgw":
        return build_parser().parse_args(command[1:])
    assert command[:3] == ["python", "-m", "llmgw_sim"], command
    return sim_args(command[3:])


# -- schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", [pytest.param(d, id=d.id) for d in documents() if is_builtin(d)])
def test_builtin_kinds_validate_against_the_pinned_schema(doc: Doc) -> None:
    try:
        kubernetes_validate.validate(doc.body, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{doc.id}: {error.message} at {'.'.join(map(str, error.path))}")


def test_every_object_is_a_known_kind_with_a_name_and_namespace() -> None:
    for doc in documents():
        # Built-in kinds: their schema test fails with SchemaNotFoundError for a kind it does not know.
        if not is_builtin(doc):
            assert set(CRDS[doc.body["apiVersion"], doc.kind]) <= set(doc.body["spec"]), doc.id
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc.name), doc.id
        if doc.kind != "Namespace":
            assert doc.namespace == "llmgw", doc.id
    names = [(doc.kind, doc.namespace, doc.name) for doc in documents()]
    assert len(names) == len(set(names)), "two objects share a kind and name"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((ISTIO / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in ISTIO.glob("*.yaml")} - NOT_OBJECTS
    assert present - {ENVOYFILTER.name} <= listed, f"not in kustomization.yaml: {sorted(present - listed)}"
    for resource in listed:
        if resource == ENVOYFILTER.name and not ENVOYFILTER.exists():
            continue  # written by the Envoy config builder; test_envoyfilter_structure says so
        assert (ISTIO / resource).is_file(), f"kustomization.yaml lists missing {resource}"
    assert "namespace" not in kustomization, "a namespace override would move the EnvoyFilter too"


# -- workloads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("deployment", [pytest.param(d, id=d.name) for d in of_kind("Deployment")])
def test_deployments_run_non_root_read_only_with_resources(deployment: Doc) -> None:
    spec = pod_spec(deployment)
    assert selects(deployment.body["spec"]["selector"]["matchLabels"], pod_labels(deployment))
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    # Our processes never call the Kubernetes API (the Istio gateway's proxy may: leave it its default).
    assert is_istio_gateway(deployment) or spec.get("automountServiceAccountToken") is False
    for container in spec["containers"]:
        own = container["securityContext"]
        assert own["allowPrivilegeEscalation"] is False and own["readOnlyRootFilesystem"] is True
        assert own["capabilities"]["drop"] == ["ALL"]
        resources = container["resources"]
        for resource in ("cpu", "memory"):
            assert quantity(resources["requests"][resource]) <= quantity(resources["limits"][resource]), resource
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert is_istio_gateway(deployment) or "/tmp" in mounts, "read-only root: /tmp must be a volume"
    # Istio: a sidecar on every pod of the mesh.
    assert pod_labels(deployment).get("sidecar.istio.io/inject") == "true"


def test_the_namespace_is_in_the_mesh() -> None:
    assert one("Namespace", "llmgw").body["metadata"]["labels"]["istio-injection"] == "enabled"


@pytest.mark.parametrize("deployment", [pytest.param(d, id=d.name) for d in python_deployments()])
def test_commands_parse_and_listen_on_the_container_ports(deployment: Doc) -> None:
    args = command_args(deployment)
    ports = container_ports(deployment)
    assert args.host == "0.0.0.0", "listen on the pod's address, not loopback"
    listened = {args.port} | ({args.metrics_port} if getattr(args, "metrics_port", None) else set())
    assert listened == {p for p in ports.values()}, f"listens on {listened}, declares {set(ports.values())}"
    if getattr(args, "config", None):
        mounts = {m["mountPath"]: m["name"] for m in pod_spec(deployment)["containers"][0]["volumeMounts"]}
        directory, _, key = args.config.rpartition("/")
        volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == mounts[directory])
        assert volume["configMap"]["name"] == "llmgw-config" and key in one("ConfigMap", "llmgw-config").body["data"]


@pytest.mark.parametrize("deployment", [pytest.param(d, id=d.name) for d in python_deployments()])
def test_probes_reach_ports_the_container_has(deployment: Doc) -> None:
    ports = container_ports(deployment)
    found = list(probes(deployment))
    assert {name.split(".")[1] for name, _ in found} == {"startupProbe", "readinessProbe", "livenessProbe"}
    for name, probe in found:
        if "grpc" in probe:
            assert probe["grpc"]["port"] in ports, name
            assert probe["grpc"].get("service") == "", f"{name}: probe the server's overall health (service \"\")"
        else:
            assert probe["httpGet"]["port"] in ports and probe["httpGet"]["path"] == "/health", name


def test_extproc_is_probed_over_grpc_health_on_its_grpc_port() -> None:
    extproc = one("Deployment", "llmgw-extproc")
    grpc_port = container_ports(extproc)["grpc"]
    assert command_args(extproc).port == grpc_port
    for name, probe in probes(extproc):
        assert probe["grpc"]["port"] == grpc_port, name
    annotations = extproc.body["spec"]["template"]["metadata"]["annotations"]
    # Only the metrics port skips the sidecar (Prometheus in plain HTTP); gRPC stays in the mesh.
    assert annotations["traffic.sidecar.istio.io/excludeInboundPorts"] == str(container_ports(extproc)["metrics"])


# -- services, budgets, autoscalers -------------------------------------------------------------


@pytest.mark.parametrize("svc", [pytest.param(d, id=d.name) for d in of_kind("Service")])
def test_services_select_one_deployment_and_its_ports(svc: Doc) -> None:
    deployment = selected_deployment(svc.body["spec"]["selector"], svc.namespace)
    ports = container_ports(deployment)
    for port in svc.body["spec"]["ports"]:
        assert port["targetPort"] in ports, f"{svc.name}: targetPort {port['targetPort']} is no container port"
        assert port.get("appProtocol") in ("grpc", "http"), f"{svc.name}.{port['name']}: say it for Istio"


def test_extproc_coordinator_and_gateway_have_a_budget_and_an_autoscaler() -> None:
    hpas = {d.body["spec"]["scaleTargetRef"]["name"]: d for d in of_kind("HorizontalPodAutoscaler")}
    for name in CONTROL:
        deployment = one("Deployment", name)
        budget = one("PodDisruptionBudget", name)
        assert selected_deployment(budget.body["spec"]["selector"]["matchLabels"], budget.namespace) == deployment
        hpa = hpas[name].body["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
        assert hpa["minReplicas"] >= 2, f"{name}: one replica and a PDB would block node drains"
        min_available = budget.body["spec"].get("minAvailable")
        assert min_available is None or min_available < hpa["minReplicas"], f"{name}: the PDB allows no eviction"
        cpu = [m for m in hpa["metrics"] if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
        assert cpu and cpu[0]["resource"]["target"]["type"] == "Utilization"


def test_the_extproc_hpa_reads_a_metric_extproc_exports() -> None:
    """The HPA's Pods metric comes from prometheus-adapter's rule, from a series extproc exports."""
    hpa = one("HorizontalPodAutoscaler", "llmgw-extproc").body["spec"]
    [pods] = [m["pods"] for m in hpa["metrics"] if m["type"] == "Pods"]
    values = yaml.safe_load((ISTIO / "prometheus-adapter-values.yaml").read_text())
    rules = {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}
    assert quantity(pods["target"]["averageValue"]) > 0
    rule = rules[pods["metric"]["name"]]
    series, _ = promql_references(rule["seriesQuery"])
    assert series and series <= set(exported_metrics()), f"{series} exported by no process"
    assert re.fullmatch(rule["name"]["matches"], next(iter(series)))


def test_no_deployment_has_two_autoscalers() -> None:
    targets = [d.body["spec"]["scaleTargetRef"]["name"] for d in of_kind("HorizontalPodAutoscaler")]
    targets += [d.body["spec"]["scaleTargetRef"]["name"] for d in of_kind("ScaledObject")]
    assert len(targets) == len(set(targets)), "an HPA and a ScaledObject (KEDA's own HPA) would fight"
    for name in targets:
        one("Deployment", name)


def test_scaled_object_scales_the_pool_on_its_queue_and_kv_cache(tmp_path: Path) -> None:
    pools = set(llmgw_config(tmp_path).pools)
    exported = exported_metrics()
    [scaled] = of_kind("ScaledObject")
    spec = scaled.body["spec"]
    assert spec["scaleTargetRef"]["kind"] == "Deployment"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    read = {}
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] in ("AverageValue", "Value", "Utilization")
        metadata = trigger["metadata"]
        assert all(isinstance(value, str) for value in metadata.values()), "KEDA metadata values are strings"
        assert metadata["serverAddress"].startswith("http")
        metrics, labels = promql_references(metadata["query"])
        for metric in metrics:
            assert metric in exported and labels <= exported[metric], metadata["query"]
            read[metric] = (trigger["metricType"], float(metadata["threshold"]))
        for pool in re.findall(r'llmgw_pool="([^"]+)"', metadata["query"]):
            assert pool in pools, f"{pool} is no pool of the llmgw config"
    assert read["llmgw_pool_queue_depth"][0] == "AverageValue"   # waiting requests per replica
    assert read["llmgw_pool_kv_cache_usage_ratio"] == ("Value", 0.7)  # a ratio: scale like utilisation


def test_service_monitor_scrapes_every_metrics_port() -> None:
    [monitor] = of_kind("ServiceMonitor")
    spec = monitor.body["spec"]
    assert monitor.namespace in spec["namespaceSelector"]["matchNames"]
    services = [s for s in of_kind("Service") if selects(spec["selector"], s.body["metadata"]["labels"])]
    assert {s.name for s in services} == set(SCRAPED), "scrape our processes' /metrics, and only those"
    scraped = set()
    for endpoint in spec["endpoints"]:
        having = [s for s in services if endpoint["port"] in {p["name"] for p in s.body["spec"]["ports"]}]
        assert having, f"no selected Service has a port named {endpoint['port']}"
        scraped.update((s.name, endpoint["port"]) for s in having)
    for name in SCRAPED:
        assert any(svc == name for svc, _ in scraped), f"{name} is not scraped"
    extproc = command_args(one("Deployment", "llmgw-extproc"))
    extproc_service = one("Service", "llmgw-extproc").body["spec"]["ports"]
    assert ("llmgw-extproc", "metrics") in scraped
    assert next(p for p in extproc_service if p["name"] == "metrics")["port"] == extproc.metrics_port


def test_the_istio_gateway_serves_http_on_the_selected_pods() -> None:
    gateway = one("Deployment", "llmgw-gateway")
    assert is_istio_gateway(gateway)
    istio_gateway = one("Gateway", "llmgw-gateway").body["spec"]
    assert selects(istio_gateway["selector"], pod_labels(gateway))
    service = one("Service", "llmgw-gateway").body["spec"]
    server_ports = {server["port"]["number"] for server in istio_gateway["servers"]}
    assert server_ports <= {p["port"] for p in service["ports"]}, "Istio maps a Gateway port through the Service"
    virtual = one("VirtualService", "llmgw-gateway").body["spec"]
    assert virtual["gateways"] == ["llmgw-gateway"]


# -- the llmgw config ---------------------------------------------------------------------------


def test_the_configmap_holds_a_valid_llmgw_config_matching_the_services(tmp_path: Path) -> None:
    config = llmgw_config(tmp_path)
    extproc = one("Service", "llmgw-extproc").body["spec"]["ports"]
    assert config.server.port == next(p for p in extproc if p["name"] == "grpc")["port"]
    assert config.server.port == command_args(one("Deployment", "llmgw-extproc")).port
    coordinator = one("Service", "llmgw-coordinator").body["spec"]
    host, _, port = config.server.coordinator.rpartition(":")
    assert host == coordinator["clusterIP"], "server.coordinator must be the coordinator Service's pinned IP"
    assert int(port) == coordinator["ports"][0]["port"]
    pod_port = container_ports(one("Deployment", "vllm"))["http"]
    for pool in config.pools.values():
        assert all(endpoint.endswith(f":{pod_port}") for endpoint in pool.endpoints), pool.name
    env = pod_spec(one("Deployment", "llmgw-extproc"))["containers"][0]["env"]
    assert any(e["name"] == "LLMGW_REDIS_URL" and "secretKeyRef" in e["valueFrom"] for e in env)


# -- the EnvoyFilter (another builder writes it) ------------------------------------------------


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def test_envoyfilter_structure() -> None:
    filters = load(ENVOYFILTER)  # checked in (llmgw envoy-config istio writes it): a missing file fails
    assert filters, "envoyfilter.yaml holds no object"
    services = {(s.name, s.namespace): {p["port"] for p in s.body["spec"]["ports"]} for s in of_kind("Service")}
    accounts = {pod_spec(d)["serviceAccountName"] for d in of_kind("Deployment")}
    assert accounts <= {a.name for a in of_kind("ServiceAccount")}
    gateway_pods = pod_labels(one("Deployment", "llmgw-gateway"))
    for doc in filters:
        assert (doc.body["apiVersion"], doc.kind) in CRDS and doc.kind == "EnvoyFilter", doc.id
        spec = doc.body["spec"]
        assert spec["configPatches"], doc.id
        for i, patch in enumerate(spec["configPatches"]):
            assert patch["applyTo"] and patch["patch"]["operation"], f"{doc.id}: configPatches[{i}]"
        selector = spec.get("workloadSelector", {}).get("labels")
        assert selector is None or (isinstance(selector, dict) and selector), doc.id
        if selector is not None and doc.namespace == "llmgw":
            assert selects(selector, gateway_pods), f"{doc.id}: its workloadSelector picks no gateway pod of ours"
        # Every Service of the gateway's namespace it names (Istio's outbound|port||host cluster, its
        # outbound_.port_._.host SNI, a DNS name) is one of ours, on a port that Service has; every
        # mTLS identity it expects is the service account of that Service's pods.
        for text in _strings(spec):
            named = re.findall(r"outbound\|(\d+)\|\|([a-z0-9-]+)\.([a-z0-9-]+)\.svc", text)
            named += re.findall(r"outbound_\.(\d+)_\._\.([a-z0-9-]+)\.([a-z0-9-]+)\.svc", text)
            short = re.findall(r"^([a-z0-9-]+)\.([a-z0-9-]+)\.svc(?:\.cluster\.local)?$", text)
            named += [("", n, ns) for n, ns in short]
            for port, name, namespace in named:
                if namespace != "llmgw":
                    continue
                assert (name, namespace) in services, f"{doc.id}: names Service {name}.{namespace}, not in envoy/istio/"
                assert not port or int(port) in services[name, namespace], f"{doc.id}: {name} has no port {port}"
            for namespace, account in re.findall(r"^spiffe://[^/]+/ns/([a-z0-9-]+)/sa/([a-z0-9-]+)$", text):
                assert namespace == "llmgw" and account in accounts, f"{doc.id}: no pods run as {account}"
