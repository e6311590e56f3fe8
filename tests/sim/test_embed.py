"""Feature-hashing embeddings and the ``/v1/embeddings`` route."""

from __future__ import annotations

import base64
import math
import struct

import orjson
import pytest

from llmgw_sim.embed import embed, to_base64, truncate
from tests.sim.conftest import ClientFactory

MODEL = "llama-3-8b-instruct"


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # inputs are unit vectors


@pytest.mark.parametrize(
    ("a", "b", "low", "high"),
    [
        pytest.param([1, 2, 3, 4], [1, 2, 3, 4], 0.999, 1.001, id="same tokens: identical"),
        pytest.param([1, 2, 3, 4], [4, 3, 2, 1], 0.999, 1.001, id="a bag: order does not matter"),
        pytest.param([1, 2, 3, 4], [1, 2, 3, 9], 0.5, 0.95, id="three of four shared: similar"),
        pytest.param([1, 2, 3, 4], [5, 6, 7, 8], -0.2, 0.2, id="nothing shared: near orthogonal"),
    ],
)
def test_similarity_follows_overlap(a: list[int], b: list[int], low: float, high: float) -> None:
    assert low <= cosine(embed(a, 512), embed(b, 512)) <= high


def test_unit_length_and_truncation() -> None:
    vec = embed(list(range(100)), 256)
    assert math.isclose(sum(x * x for x in vec), 1.0)
    short = truncate(vec, 32)
    assert len(short) == 32 and math.isclose(sum(x * x for x in short), 1.0)


def test_base64_is_little_endian_float32() -> None:
    vec = [0.5, -0.25, 1.0]
    assert struct.unpack("<3f", base64.b64decode(to_base64(vec))) == (0.5, -0.25, 1.0)


async def test_embeddings_route(make_client: ClientFactory) -> None:
    client = await make_client(embedding_dim=64)
    resp = await client.post("/v1/embeddings", data=orjson.dumps(
        {"model": MODEL, "input": ["the cat sat", "the cat sat", "stock market"]}),
        headers={"x-request-id": "e1"})
    body = await resp.json()
    assert resp.status == 200 and body["id"] == "embd-e1" and body["object"] == "list"
    vectors = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and len(vectors[0]) == 64
    assert vectors[0] == vectors[1] and vectors[0] != vectors[2]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert body["usage"]["completion_tokens"] == 0


async def test_embeddings_base64_dimensions_and_tokens(make_client: ClientFactory) -> None:
    client = await make_client(embedding_dim=64)
    resp = await client.post("/v1/embeddings", data=orjson.dumps(
        {"input": [[1, 2, 3]], "encoding_format": "base64", "dimensions": 16}))
    body = await resp.json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 16 * 4 and body["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        pytest.param({"model": MODEL}, 400, "input", id="no input"),
        pytest.param({"input": ""}, 400, "input", id="empty string"),
        pytest.param({"input": "x", "encoding_format": "hex"}, 400, "encoding_format", id="bad format"),
        pytest.param({"input": "x", "dimensions": 65}, 400, "dimensions", id="wider than the model"),
        pytest.param({"input": "x", "model": "nope"}, 404, "model", id="unknown model"),
    ],
)
async def test_embedding_errors(make_client: ClientFactory, body: object, status: int, param: str) -> None:
    client = await make_client(embedding_dim=64)
    resp = await client.post("/v1/embeddings", data=orjson.dumps(body))
    assert resp.status == status and (await resp.json())["error"]["param"] == param
