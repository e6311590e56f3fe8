"""The per-tenant heat map, drawn from a real Prometheus: one row per tenant, one column per
latency bucket, each cell coloured by the share of its requests that failed (4xx or 5xx, the
gateway's refusals included) and labelled with their count; beside it, the drill-down: for each
tenant, the error rate of each pod that served it. What the Grafana dashboard's two panels show
(``compose/grafana/dashboards/llmgw.json``), from ``llmgw_tenant_request_duration_seconds`` and
``llmgw_pod_requests_total``.

    python -m bench.tenant_heatmap --prometheus http://127.0.0.1:9090 [--window 15m] [--out docs/tenant-heatmap.png]

The compose lane (``tests/compose/``) draws it from the stack's Prometheus after its traffic.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

DOCS = Path(__file__).resolve().parents[1] / "docs"
OUT = DOCS / "tenant-heatmap.png"


def _vector(prometheus: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    if reply.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {reply}")
    return list(reply["data"]["result"])


def heat_map(prometheus: str, window: str = "15m") -> dict[str, Any]:
    """Per tenant: requests and failures in each latency bucket (not cumulative) over ``window``,
    and per tenant and pod: forwarded requests and failures."""
    cumulative: dict[str, dict[str, dict[float, float]]] = {"all": defaultdict(dict), "error": defaultdict(dict)}
    for which, matcher in (("all", ""), ("error", '{outcome="error"}')):
        expr = f"sum by (llmgw_tenant, le) (increase(llmgw_tenant_request_duration_seconds_bucket{matcher}[{window}]))"
        for sample in _vector(prometheus, expr):
            labels = sample["metric"]
            cumulative[which][labels["llmgw_tenant"]][float(labels["le"])] = float(sample["value"][1])
    bounds = sorted({le for rows in cumulative["all"].values() for le in rows})
    cells: dict[str, list[tuple[float, float]]] = {}
    for tenant, rows in sorted(cumulative["all"].items()):
        errors = cumulative["error"].get(tenant, {})
        counts = []
        below_all = below_error = 0.0
        for le in bounds:
            total, failed = rows.get(le, below_all), errors.get(le, below_error)
            counts.append((max(0.0, total - below_all), max(0.0, failed - below_error)))
            below_all, below_error = total, failed
        if sum(total for total, _ in counts) > 0:
            cells[tenant] = counts
    pods: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    by_pod = "sum by (llmgw_tenant, llmgw_pod) (increase(llmgw_pod_requests_total{matcher}[{window}]))"
    totals = _vector(prometheus, by_pod.format(matcher="", window=window))
    failures = {(s["metric"]["llmgw_tenant"], s["metric"]["llmgw_pod"]): float(s["value"][1])
              for s in _vector(prometheus, by_pod.format(matcher='{outcome="error"}', window=window))}
    for sample in totals:
        tenant, pod = sample["metric"]["llmgw_tenant"], sample["metric"]["llmgw_pod"]
        if float(sample["value"][1]) > 0:
            pods[tenant][pod] = (float(sample["value"][1]), failures.get((tenant, pod), 0.0))
    return {"bounds": bounds, "cells": cells, "pods": dict(pods), "window": window}


def _bucket_label(low: float, high: float) -> str:
    def short(seconds: float) -> str:
        return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:g}s"
    return f">{short(low)}" if math.isinf(high) else f"<={short(high)}"


def draw(data: dict[str, Any], out: Path) -> Path:
    """The PNG: the heat map on the left, the drill-down to pods on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells: dict[str, list[tuple[float, float]]] = data["cells"]
    bounds: list[float] = data["bounds"]
    if not cells:
        raise RuntimeError("no tenant had a request in the window")
    tenants = sorted(cells)
    shown = [i for i in range(len(bounds)) if any(cells[t][i][0] for t in tenants)]  # columns with requests
    rate = np.full((len(tenants), len(shown)), np.nan)
    for row, tenant in enumerate(tenants):
        for col, i in enumerate(shown):
            total, failed = cells[tenant][i]
            if total:
                rate[row, col] = failed / total
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.7 * len(tenants)),
                                         gridspec_kw={"width_ratios": [3, 2]})
    image = left.imshow(rate, cmap="RdYlGn_r", vmin=0, vmax=1, aspect="auto")
    labels = [_bucket_label(bounds[i - 1] if i else 0.0, bounds[i]) for i in shown]
    left.set_xticks(range(len(shown)), labels, rotation=45, ha="right", fontsize=8)
    left.set_yticks(range(len(tenants)), tenants)
    for row, tenant in enumerate(tenants):
        for col, i in enumerate(shown):
            total = cells[tenant][i][0]
            if total:
                left.text(col, row, f"{total:.0f}", ha="center", va="center", fontsize=8)
    left.set_title(f"Requests by tenant and latency (last {data['window']}): colour = error rate, "
                   "number = requests", fontsize=9)
    figure.colorbar(image, ax=left, label="error rate")
    pods: dict[str, dict[str, tuple[float, float]]] = data["pods"]
    bars = [(f"{tenant} -> {pod}", failed / total if total else 0.0, total)
            for tenant in tenants for pod, (total, failed) in sorted(pods.get(tenant, {}).items())]
    if bars:
        right.barh(range(len(bars)), [b[2] for b in bars], color=plt.get_cmap("RdYlGn_r")([b[1] for b in bars]),
                   edgecolor="black", linewidth=0.5)
        right.set_yticks(range(len(bars)), [f"{b[0]} ({b[1]:.0%} errors)" for b in bars], fontsize=8)
        right.invert_yaxis()
    right.set_xlabel("forwarded requests (colour: error rate, a 5xx or no answer)")
    right.set_title("Drill-down: the pods that served each tenant", fontsize=9)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tenant_heatmap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="the Prometheus that scrapes extproc")
    parser.add_argument("--window", default="15m")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    print(draw(heat_map(args.prometheus, args.window), args.out))


if __name__ == "__main__":
    main()
