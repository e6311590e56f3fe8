"""The gateway in an Istio mesh: `EnvoyFilter` resources (networking.istio.io/v1alpha3) that turn a
dedicated Istio gateway deployment (envoy/istio/gateway.yaml) into the LLM gateway.

The patches carry the same pieces as the plain snippet (`snippet`): the HTTP filters, inserted
before the router of every HTTP connection manager of the selected workload and off unless a
gateway route turns them on; the gateway's routes, first in every virtual host; the access-log
settings; and the clusters, added with their endpoints from Istio's EDS (the ``outbound|port||host``
names Istio serves over ADS) and Istio's mutual TLS: certificates from the proxy's SDS
(``sds-grpc``: ``default`` and ``ROOTCA``), as Istio builds an ``ISTIO_MUTUAL`` cluster.
Envoy's OpenAI-shaped local replies come as a second, optional EnvoyFilter: they apply to every
route of the gateway's listeners.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from extproc.config import GatewaySpec
from extproc.envoybuild import clusters, names
from extproc.envoybuild.addresses import COORDINATOR_PORT, EXTPROC_PORT, LOCAL, POD_PORT, HostPort
from extproc.envoybuild.envoyapi import clusterv3, corev3, matcherv3, protobuf, rawbufferv3, tlsv3
from extproc.envoybuild.output import data, seconds, typed
from extproc.envoybuild.snippet import snippet

API_VERSION = "networking.istio.io/v1alpha3"
SDS_CLUSTER = "sds-grpc"  # the istio-proxy bootstrap's cluster to its agent's SDS server
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


@dataclass(frozen=True, slots=True)
class Service:
    """A Kubernetes Service in the mesh, and the service account its pods run as (their mTLS
    identity; None: any workload with a certificate of the mesh)."""

    name: str
    port: int
    service_account: str | None


@dataclass(frozen=True, slots=True)
class Mesh:
    """Where the gateway's parts run in the cluster (the manifests of envoy/istio/).

    The EnvoyFilters select the gateway deployment (an Istio gateway of its own, gateway.yaml) in
    ``namespace``, where the services live too. ``pods`` is one Service over the inference pods of
    every pool (Envoy's override_host policy picks among the hosts of one cluster).
    ``virtual_host`` (Istio's ``host:port`` name, e.g. ``llm.example.com:80``) confines the
    gateway's routes to one virtual host; None: every virtual host of the gateway gets them, first,
    under ``/v1/`` only.
    """

    namespace: str = "llmgw"
    gateway_labels: tuple[tuple[str, str], ...] = (("app", "llmgw-gateway"),)  # the workloadSelector
    extproc: Service = Service("llmgw-extproc", EXTPROC_PORT, "llmgw-extproc")
    coordinator: Service = Service("llmgw-coordinator", COORDINATOR_PORT, "llmgw-coordinator")
    pods: Service = Service("vllm", POD_PORT, "vllm")
    virtual_host: str | None = None
    trust_domain: str = "cluster.local"
    cluster_domain: str = "cluster.local"

    def host(self, service: Service) -> str:
        """The service's cluster-local DNS name."""
        return f"{service.name}.{self.namespace}.svc.{self.cluster_domain}"


MESH = Mesh()


def _sds(name: str) -> tlsv3.SdsSecretConfig:
    """A secret of the proxy's SDS server, as Istio asks for it."""
    server = corev3.GrpcService(envoy_grpc=corev3.GrpcServiceEnvoyGrpc(cluster_name=SDS_CLUSTER))
    return tlsv3.SdsSecretConfig(name=name, sds_config=corev3.ConfigSource(
        api_config_source=corev3.ApiConfigSource(
            api_type=corev3.ApiConfigSourceApiType.GRPC, set_node_on_first_message_only=True,
            transport_api_version=corev3.ApiVersion.V3, grpc_services=[server]),
        initial_fetch_timeout=seconds(0), resource_api_version=corev3.ApiVersion.V3))


def istio_mutual(mesh: Mesh, service: Service, *, http2: bool) -> corev3.TransportSocket:
    """Istio's ``ISTIO_MUTUAL`` upstream TLS: the workload certificate (``default``) and the mesh
    root (``ROOTCA``) from SDS, the SNI Istio's own clusters send (``outbound_.port_._.host``), and
    its in-mesh ALPN, so the server's sidecar takes the connection as mesh mTLS."""
    alpn = ["istio-peer-exchange", "istio", *(["h2"] if http2 else [])]
    identities = []
    if service.service_account is not None:
        identity = f"spiffe://{mesh.trust_domain}/ns/{mesh.namespace}/sa/{service.service_account}"
        identities.append(tlsv3.SubjectAltNameMatcher(san_type=tlsv3.SubjectAltNameMatcherSanType.URI,
                                                      matcher=matcherv3.StringMatcher(exact=identity)))
    versions = tlsv3.TlsParametersTlsProtocol
    context = tlsv3.UpstreamTlsContext(
        sni=f"outbound_.{service.port}_._.{mesh.host(service)}",
        common_tls_context=tlsv3.CommonTlsContext(
            tls_params=tlsv3.TlsParameters(tls_minimum_protocol_version=versions.TLSv1_2,
                                           tls_maximum_protocol_version=versions.TLSv1_3),
            alpn_protocols=alpn,
            tls_certificate_sds_secret_configs=[_sds("default")],
            combined_validation_context=tlsv3.CommonTlsContextCombinedCertificateValidationContext(
                default_validation_context=tlsv3.CertificateValidationContext(match_typed_subject_alt_names=identities),
                validation_context_sds_secret_config=_sds("ROOTCA")),
        ))
    return corev3.TransportSocket(name="envoy.transport_sockets.tls", typed_config=typed(context))


def _from_eds(cluster: clusterv3.Cluster, mesh: Mesh, service: Service) -> clusterv3.Cluster:
    """``cluster`` with the service's endpoints from Istio's EDS instead of its own list."""
    source = corev3.ConfigSource(ads=corev3.AggregatedConfigSource(), initial_fetch_timeout=seconds(0),
                                 resource_api_version=corev3.ApiVersion.V3)
    return replace(cluster, type=clusterv3.ClusterDiscoveryType.EDS, load_assignment=None,
                   eds_cluster_config=clusterv3.ClusterEdsClusterConfig(
                       service_name=f"outbound|{service.port}||{mesh.host(service)}", eds_config=source))


def mesh_clusters(mesh: Mesh) -> list[clusterv3.Cluster]:
    """extproc and the coordinator over strict mTLS; the pods over mTLS where they run a sidecar
    (Istio labels such endpoints ``tlsMode: istio``), plain where they do not, as Istio's auto mTLS."""
    def at(service: Service) -> HostPort:
        return HostPort(mesh.host(service), service.port)

    extproc = _from_eds(clusters.extproc(at(mesh.extproc)), mesh, mesh.extproc)
    coordinator = _from_eds(clusters.coordinator(at(mesh.coordinator)), mesh, mesh.coordinator)
    pods = _from_eds(clusters.pods([at(mesh.pods)]), mesh, mesh.pods)
    plain = corev3.TransportSocket(name="envoy.transport_sockets.raw_buffer",
                                   typed_config=typed(rawbufferv3.RawBuffer()))
    return [
        replace(extproc, transport_socket=istio_mutual(mesh, mesh.extproc, http2=True)),
        replace(coordinator, transport_socket=istio_mutual(mesh, mesh.coordinator, http2=False)),
        replace(pods, transport_socket_matches=[
            clusterv3.ClusterTransportSocketMatch(
                name="tlsMode-istio", match=protobuf.Struct.from_dict({"tlsMode": "istio"}),
                transport_socket=istio_mutual(mesh, mesh.pods, http2=False)),
            clusterv3.ClusterTransportSocketMatch(name="tlsMode-disabled", match=protobuf.Struct.from_dict({}),
                                                  transport_socket=plain),
        ]),
    ]


def _patch(apply_to: str, operation: str, value: dict[str, Any], **match: Any) -> dict[str, Any]:
    return {"applyTo": apply_to, "match": {"context": "GATEWAY", **match},
            "patch": {"operation": operation, "value": value}}


def _resource(name: str, mesh: Mesh, patches: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "EnvoyFilter",
            "metadata": {"name": name, "namespace": mesh.namespace},
            "spec": {"workloadSelector": {"labels": dict(mesh.gateway_labels)}, "configPatches": patches}}


def envoy_filters(spec: GatewaySpec, mesh: Mesh = MESH) -> list[dict[str, Any]]:
    """The EnvoyFilter resources: ``llmgw`` (everything the gateway needs) and ``llmgw-local-replies``
    (optional: Envoy's own errors as OpenAI error JSON)."""
    piece = replace(snippet(spec, LOCAL), clusters=mesh_clusters(mesh))  # the snippet, the mesh's clusters
    manager = {"filterChain": {"filter": {"name": names.CONNECTION_MANAGER}}}
    before_router = {"filterChain": {"filter": {"name": names.CONNECTION_MANAGER,
                                                "subFilter": {"name": names.ROUTER_FILTER}}}}
    host = {"routeConfiguration": {"vhost": {"name": mesh.virtual_host}}} if mesh.virtual_host else {}
    patches = [
        # ext_proc buffers whole bodies: the body limit and headers' room, no more (see bootstrap).
        _patch("LISTENER", "MERGE", {"per_connection_buffer_limit_bytes": piece.buffer_limit_bytes}),
        # Each is inserted just before the router, so they keep this order.
        *(_patch("HTTP_FILTER", "INSERT_BEFORE", data(f), listener=before_router) for f in piece.http_filters),
        _patch("NETWORK_FILTER", "MERGE", {"name": names.CONNECTION_MANAGER, "typed_config": {
            "@type": HCM_TYPE, **piece.connection_manager_fields()}}, listener=manager),
        # Each goes first in the virtual host: listed last to first, they end in the snippet's order.
        *(_patch("HTTP_ROUTE", "INSERT_FIRST", data(r), **host) for r in reversed(piece.routes)),
        *(_patch("CLUSTER", "ADD", data(c)) for c in piece.clusters),
    ]
    replies = [_patch("NETWORK_FILTER", "MERGE", {"name": names.CONNECTION_MANAGER, "typed_config": {
        "@type": HCM_TYPE, "local_reply_config": data(piece.local_reply_config)}}, listener=manager)]
    return [_resource("llmgw", mesh, patches), _resource("llmgw-local-replies", mesh, replies)]
