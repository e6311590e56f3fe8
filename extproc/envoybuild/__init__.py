"""Every Envoy configuration of the gateway, built from the llmgw config as typed Envoy messages
(the `envoy-data-plane` package's dataclasses), so that one builder serves every way in:

- `bootstrap`: a whole Envoy for a dedicated gateway: the local stack's (`llmgw up`, envoy/envoy.yaml)
  and the docker-compose stack's (compose/envoy.yaml); they differ only in `addresses`;
- `snippet`: the filters, routes, clusters and access-log settings to splice into an Envoy that
  already serves other traffic (envoy/snippet/);
- `istio`: the same pieces as Istio EnvoyFilters with mesh mTLS (envoy/istio/envoyfilter.yaml).

The layout follows Envoy's: `filters` (HTTP filters, Lua scripts beside them), `routes`,
`clusters`, `logs` (access logs, local replies). Every builder is a pure function of the config and
the addresses; `output` turns messages into Envoy's YAML, and `targets` names the checked-in files.
Import from the modules (`extproc.envoybuild.bootstrap.bootstrap`, ...): this package re-exports
nothing, so no function hides the module of the same name.
"""
