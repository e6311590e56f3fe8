"""A pod that answers at once, whatever the prompt's size: for benchmarks of what the gateway
costs on long prompts, where ``llmgw_sim``'s real tokenizer (~80 ms of a core per 220 KB) would
be most of the work and of the latency.

OpenAI-compatible enough for the gateway: ``POST /v1/chat/completions`` and ``/v1/completions``
(plain or streamed: ``max_tokens`` one-word events, then the usage chunk when
``stream_options.include_usage`` is set), ``GET /v1/models``, ``/health`` and vLLM's queue gauges
on ``/metrics``. The prompt is not tokenized: ``usage.prompt_tokens`` is its byte count / 4.

    python -m bench.instant_pod --model NAME --port 0     # prints READY http://host:port
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvloop
from aiohttp import web

METRICS = (b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
           b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
           b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0\n")


def build_app(model: str) -> web.Application:
    """The pod's routes, serving ``model``."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fields = orjson.loads(body)
        chat = request.path.endswith("/chat/completions")
        tokens = int(fields.get("max_tokens") or 16)
        usage = {"prompt_tokens": len(body) // 4, "completion_tokens": tokens,
                 "total_tokens": len(body) // 4 + tokens}
        ident, created = f"cmpl-{time.monotonic_ns()}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not fields.get("stream"):
            text = " word" * tokens
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            return web.json_response({"id": ident, "object": kind, "created": created, "model": model,
                                      "choices": [choice], "usage": usage}, dumps=lambda o: orjson.dumps(o).decode())
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk_kind = kind + ".chunk" if chat else kind
        for i in range(tokens):
            last = i == tokens - 1
            choice = {"index": 0, "finish_reason": "length" if last else None,
                      **({"delta": {"content": " word"}} if chat else {"text": " word"})}
            await response.write(b"data: " + orjson.dumps({"id": ident, "object": chunk_kind, "created": created,
                                                           "model": model, "choices": [choice]}) + b"\n\n")
        if (fields.get("stream_options") or {}).get("include_usage"):
            await response.write(b"data: " + orjson.dumps({"id": ident, "object": chunk_kind, "created": created,
                                                           "model": model, "choices": [], "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=METRICS, content_type="text/plain")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.instant_pod", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()

    async def serve() -> None:
        runner = web.AppRunner(build_app(args.model), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"READY http://{host}:{port}", flush=True)
        while True:
            await asyncio.sleep(3600)

    uvloop.run(serve())


if __name__ == "__main__":
    main()
