"""The gateway as pieces for an Envoy that serves other traffic too (plain Envoy, an existing mesh).

The pieces: the HTTP filters to insert before the router, the routes to put first in the virtual
host that serves the LLM API, the clusters, and the access-log settings of the connection manager
(plus, optionally, OpenAI-shaped local replies). The filters are off by default (``HttpFilter.disabled``)
and the gateway's routes turn them on: Envoy builds a request's filter chain from the route it first
matched, so a request to any other route of that listener never meets extproc. The routes match
under ``/v1/`` only, and carry the response headers a dedicated virtual host would add.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from extproc.config import GatewaySpec
from extproc.envoybuild import clusters, filters, logs, names, routes
from extproc.envoybuild.addresses import Addresses
from extproc.envoybuild.bootstrap import buffer_limit_bytes, pod_addresses
from extproc.envoybuild.envoyapi import accesslogv3, clusterv3, hcmv3, routev3
from extproc.envoybuild.output import data, dump

API_PREFIX = "/v1/"  # the OpenAI API's paths; the gateway's routes match nothing else

HTTP_FILTERS_FILE = "http_filters.yaml"
ROUTES_FILE = "routes.yaml"
CLUSTERS_FILE = "clusters.yaml"
ACCESS_LOG_FILE = "access_log.yaml"
LOCAL_REPLY_FILE = "local_reply_config.yaml"
README_FILE = "README.md"


@dataclass(frozen=True, slots=True)
class Snippet:
    """The gateway's pieces, typed."""

    http_filters: list[hcmv3.HttpFilter]  # before the router, in this order
    routes: list[routev3.Route]  # first in the virtual host, in this order
    clusters: list[clusterv3.Cluster]
    access_log: list[accesslogv3.AccessLog]  # appended to the connection manager's
    access_log_options: hcmv3.HttpConnectionManagerHcmAccessLogOptions
    local_reply_config: hcmv3.LocalReplyConfig  # optional: listener-wide
    buffer_limit_bytes: int  # the listener's per_connection_buffer_limit_bytes

    def connection_manager_fields(self) -> dict[str, Any]:
        """What the connection manager gets, as YAML data: access logs appended, options set."""
        return {"access_log": [data(a) for a in self.access_log],
                "access_log_options": data(self.access_log_options)}


def snippet(spec: GatewaySpec, at: Addresses) -> Snippet:
    """The pieces for ``spec``, with extproc, the coordinator and the pods where ``at`` says."""
    enabled = [*names.DECOMPRESSORS, names.EXT_PROC_FILTER, names.RESPONSE_FILTER]
    return Snippet(
        http_filters=filters.gateway_filters(disabled=True),
        routes=routes.enable_filters(routes.gateway_routes(spec, API_PREFIX), enabled),
        clusters=[clusters.extproc(at.extproc), clusters.coordinator(at.coordinator),
                  clusters.pods(pod_addresses(spec, at))],
        access_log=[logs.settlement_log()],
        access_log_options=logs.log_options(spec),
        local_reply_config=logs.local_replies(),
        buffer_limit_bytes=buffer_limit_bytes(spec),
    )


def files(piece: Snippet, header: str) -> dict[str, str]:
    """Each piece's YAML file (and the README that says where it goes), by file name."""
    return {
        HTTP_FILTERS_FILE: dump([data(f) for f in piece.http_filters],
                                f"{header}\nInsert into the HttpConnectionManager's http_filters, in this order, "
                                f"just before {names.ROUTER_FILTER}."),
        ROUTES_FILE: dump([data(r) for r in piece.routes],
                          f"{header}\nPut first, in this order, in the routes of the virtual host that serves the "
                          "LLM API."),
        CLUSTERS_FILE: dump([data(c) for c in piece.clusters], f"{header}\nAdd to static_resources.clusters (or CDS)."),
        ACCESS_LOG_FILE: dump(piece.connection_manager_fields(),
                              f"{header}\nHttpConnectionManager fields: append access_log's entry to its own, "
                              "set access_log_options."),
        LOCAL_REPLY_FILE: dump({"local_reply_config": data(piece.local_reply_config)},
                               f"{header}\nOptional HttpConnectionManager field: Envoy's own error answers in "
                               "OpenAI's shape, for every route of the listener."),
        README_FILE: README.replace("{buffer_limit}", str(piece.buffer_limit_bytes)),
    }


def splice(bootstrap: dict[str, Any], listener: str, piece: Snippet) -> dict[str, Any]:
    """``bootstrap`` (YAML data) with ``piece`` in the first connection manager and virtual host of
    ``listener``: what the README says to do by hand, done on a copy."""
    config = copy.deepcopy(bootstrap)
    resources = config["static_resources"]
    target = next(item for item in resources["listeners"] if item["name"] == listener)
    target["per_connection_buffer_limit_bytes"] = piece.buffer_limit_bytes
    manager = next(f for f in target["filter_chains"][0]["filters"]
                   if f["name"] == names.CONNECTION_MANAGER)["typed_config"]
    chain = manager["http_filters"]
    router = next(i for i, f in enumerate(chain) if f["name"] == names.ROUTER_FILTER)
    chain[router:router] = [data(f) for f in piece.http_filters]
    host = manager["route_config"]["virtual_hosts"][0]
    host["routes"] = [*(data(r) for r in piece.routes), *host.get("routes", [])]
    resources.setdefault("clusters", []).extend(data(c) for c in piece.clusters)
    fields = piece.connection_manager_fields()
    manager["access_log"] = [*manager.get("access_log", []), *fields["access_log"]]
    manager["access_log_options"] = fields["access_log_options"]
    return config


README = f"""# llmgw in an Envoy you already run

Generated by `llmgw envoy-config --target snippet` (edit `extproc/envoybuild/`, not these files).
Each YAML file is one piece of Envoy config; put them into the listener that should serve the
OpenAI API, beside whatever it serves already.

| file | where it goes |
|---|---|
| `{HTTP_FILTERS_FILE}` | the listener's `HttpConnectionManager.http_filters`, in this order, just before `{names.ROUTER_FILTER}` |
| `{ROUTES_FILE}` | first in the `routes` of the virtual host that serves the API, in this order |
| `{CLUSTERS_FILE}` | `static_resources.clusters` (or your CDS): extproc, the batching coordinator, the pods |
| `{ACCESS_LOG_FILE}` | the same `HttpConnectionManager`: append the `access_log` entry, set `access_log_options` |
| `{LOCAL_REPLY_FILE}` | optional, same place: Envoy's own errors as OpenAI error JSON, for every route of the listener |

- The filters are `disabled: true`: only the gateway's routes (all under `{API_PREFIX}`) turn them on,
  so requests to your other routes never reach extproc. Envoy picks a request's filters from the
  first route it matches, which is why the routes must come before any route of yours that also
  matches `{API_PREFIX}`.
- Set the listener's `per_connection_buffer_limit_bytes` to {{buffer_limit}}: extproc's
  `server.max_body_bytes` and 64 KiB for headers. ext_proc buffers whole bodies: a smaller limit
  answers large bodies with Envoy's 413 before extproc sees them, a larger one lets a stalled
  upload pin more memory than any accepted request needs.
- `access_log_options.access_log_flush_interval` also makes your own access logs of that connection
  manager write periodic entries for long requests; filter them with a `log_type_filter` if unwanted.
- The clusters' `load_assignment`s say where extproc (ext_proc and the gRPC access-log service, one
  port), the coordinator and the pods are: here, extproc beside Envoy and the pods of the config's
  pools. `llmgw envoy-config --target snippet --config your.yaml --out DIR` writes these files for
  your config; edit the addresses if yours differ.
"""
