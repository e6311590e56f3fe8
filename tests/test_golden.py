"""Golden files pin the exact ProcessingResponse messages sent back to Envoy.

A pure refactor must leave them unchanged. Regenerate on purpose with ``UPDATE_GOLDEN=1 pytest``.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.json_format import MessageToDict

from extproc.accounting import NAMESPACE as METADATA_NAMESPACE
from extproc.gateway import Gateway
from extproc.routing.picker import Picker
from extproc.server import ExternalProcessor
from tests.helpers import deterministic_id_source, make_config, post_headers, request_body, request_headers

GOLDEN = Path(__file__).parent / "golden"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

SCENARIOS: dict[str, list[pb.ProcessingRequest]] = {
    "chat_alias_rewritten": [
        request_headers(post_headers(**{"x-request-id": "req-1", "traceparent": TRACEPARENT,
                                        "authorization": "Bearer sk-tenant", "x-llmgw-route": "batch"})),
        request_body(b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"stream":true}'),
    ],
    "chat_pool_credential": [
        request_headers(post_headers(**{"x-request-id": "req-2"})),
        request_body(b'{"model":"qwen-72b","messages":[{"role":"user","content":"hi"}]}'),
    ],
    "models_list": [request_headers({":method": "GET", ":path": "/v1/models", "x-request-id": "req-3"}, True)],
    "invalid_json": [request_headers(post_headers(**{"x-request-id": "req-4"})), request_body(b"{oops")],
    "unknown_model": [
        request_headers(post_headers(**{"x-request-id": "req-5"})),
        request_body(b'{"model":"gpt-5","messages":[{"role":"user","content":"hi"}]}'),
    ],
    "unsupported_media_type": [
        request_headers(post_headers(**{"x-request-id": "req-6", "content-type": "text/plain"})),
    ],
}


class _Context:
    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"aborted: {details}")


async def _run(messages: list[pb.ProcessingRequest]) -> list[dict[str, object]]:
    gateway = Gateway(make_config(), Picker(random.Random(0)), deterministic_id_source())

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            yield message

    responses = ExternalProcessor(gateway).Process(requests(), _Context())  # type: ignore[arg-type]
    return [_timeless(_readable(MessageToDict(r))) async for r in responses]


def _readable(value: object) -> object:
    """Decode the base64 of bytes fields (header values, bodies) so a golden diff reads as text."""
    if isinstance(value, dict):
        return {k: base64.b64decode(v).decode() if k in ("rawValue", "body") else _readable(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_readable(v) for v in value]
    return value


def _timeless(response: object) -> object:
    """Blank the decision metadata's clock readings, which differ each run: its start (``started_ns``)
    and the phases' offsets and durations (``name:start_us:duration_us,...``)."""
    assert isinstance(response, dict)
    carried = response.get("dynamicMetadata", {}).get(METADATA_NAMESPACE)
    if carried is not None:  # the decision rides as one JSON string: shown decoded
        decision = carried["decision"] = json.loads(carried["decision"])
        decision["started_ns"] = "<ns>"
        decision["phases"] = re.sub(r":\d+", ":<us>", decision["phases"])
    return response


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_golden(name: str) -> None:
    got = await _run(SCENARIOS[name])
    path = GOLDEN / f"{name}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())
