"""``python -m llmgw_sim``: run one simulated vLLM pod until SIGTERM/SIGINT.

Once listening it prints ``READY http://HOST:PORT`` and flushes stdout (launchers wait for
it); with ``--batch-grpc-port``, the line ``BATCH-GRPC HOST:PORT`` comes just before it. ``--port 0``
(and ``--batch-grpc-port 0``) picks a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from extproc.resources import DEFAULT_TOKENIZER
from llmgw_sim.costmodel import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DECODE_BASE_S,
    DEFAULT_DECODE_PER_SEQ_S,
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFILL_PER_TOKEN_S,
    CostParams,
)
from llmgw_sim.embed import DEFAULT_EMBEDDING_DIM
from llmgw_sim.faults import FaultConfig
from llmgw_sim.generate import DEFAULT_OUTPUT_LEN_MEAN, DEFAULT_OUTPUT_LEN_SIGMA, LengthModel
from llmgw_sim.options import DEFAULT_MODEL, SimOptions
from llmgw_sim.scheduler import ENGINE_KINDS
from llmgw_sim.server import SIM_POD, build_app

_SHUTDOWN_TIMEOUT_S = 1.0
log = logging.getLogger("llmgw_sim")


def parse_args(argv: Sequence[str] | None = None) -> SimOptions:
    """Command-line flags -> ``SimOptions`` (argparse errors exit with status 2)."""
    p = argparse.ArgumentParser(prog="python -m llmgw_sim",
                                description="A simulated vLLM pod (OpenAI-compatible API, no GPU).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--model", action="append", metavar="NAME",
                   help=f"served model name; repeat to serve several names (default {DEFAULT_MODEL})")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="tokenizer.json path or pkg:<package>/<file>")
    p.add_argument("--engine", choices=ENGINE_KINDS, default="continuous")
    cost = p.add_argument_group("GPU cost model (defaults: Llama-3-8B on one A100-80GB)")
    cost.add_argument("--decode-base-ms", type=float, default=DEFAULT_DECODE_BASE_S * 1e3)
    cost.add_argument("--decode-per-seq-ms", type=float, default=DEFAULT_DECODE_PER_SEQ_S * 1e3)
    cost.add_argument("--prefill-per-token-ms", type=float, default=DEFAULT_PREFILL_PER_TOKEN_S * 1e3)
    cost.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    cost.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    cost.add_argument("--kv-cache-tokens", type=int, default=DEFAULT_KV_CACHE_TOKENS)
    cost.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    cost.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--embedding-dim", type=int, default=DEFAULT_EMBEDDING_DIM,
                   help="width of /v1/embeddings vectors")
    lora = p.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                      help="adapters a request may name as its model")
    lora.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch")
    cost.add_argument("--time-scale", type=float, default=1.0,
                      help="multiplies all simulated GPU time; 0 = instant")
    out = p.add_argument_group("output length")
    out.add_argument("--output-len-mean", type=float, default=DEFAULT_OUTPUT_LEN_MEAN)
    out.add_argument("--output-len-sigma", type=float, default=DEFAULT_OUTPUT_LEN_SIGMA)
    out.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    faults = p.add_argument_group("failure injection (all off by default)")
    faults.add_argument("--error-rate", type=float, default=0.0, help="answer 500/503")
    faults.add_argument("--spike-rate", type=float, default=0.0)
    faults.add_argument("--spike-ms", type=float, default=0.0, help="extra delay before the first token")
    faults.add_argument("--hang-rate", type=float, default=0.0, help="never answer")
    faults.add_argument("--crash-after", type=int, default=0, help="os._exit(1) after N requests")
    faults.add_argument("--retry-after", type=float, default=0.0, help="injected 503s carry retry-after: S seconds")
    faults.add_argument("--die-after-tokens", type=int, default=0, metavar="N",
                        help="os._exit(1) mid-answer, once one sequence has generated N tokens")
    p.add_argument("--batch-grpc-port", type=int, default=None, metavar="PORT",
                   help="also serve the batch protocol llmgw.v1.BatchGeneration over gRPC on this "
                        "port (0 picks a free one); off by default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", type=int, default=0, metavar="N",
                   help="keep the last N requests for GET /debug/requests")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        return SimOptions(
            host=args.host,
            port=args.port,
            model=(args.model or [DEFAULT_MODEL])[0],
            extra_models=tuple((args.model or [])[1:]),
            tokenizer=args.tokenizer,
            engine=args.engine,
            cost=CostParams(
                decode_base_s=args.decode_base_ms / 1e3,
                decode_per_seq_s=args.decode_per_seq_ms / 1e3,
                prefill_per_token_s=args.prefill_per_token_ms / 1e3,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_tokens=args.kv_cache_tokens,
                block_size=args.block_size,
            ),
            max_model_len=args.max_model_len,
            embedding_dim=args.embedding_dim,
            lengths=LengthModel(mean=args.output_len_mean, sigma=args.output_len_sigma),
            ignore_eos=args.ignore_eos,
            time_scale=args.time_scale,
            faults=FaultConfig(error_rate=args.error_rate, spike_rate=args.spike_rate,
                               spike_ms=args.spike_ms, hang_rate=args.hang_rate,
                               crash_after=args.crash_after, die_after_tokens=args.die_after_tokens,
                               retry_after_s=args.retry_after),
            seed=args.seed,
            record=args.record,
            enable_lora=args.enable_lora,
            lora_modules=tuple(args.lora_modules),
            max_loras=args.max_loras,
            batch_grpc_port=args.batch_grpc_port,
        )
    except ValueError as err:
        p.error(str(err))


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"not NAME=PATH: {text!r}")
    return name, path


async def serve(options: SimOptions) -> None:
    """Serve until SIGTERM or SIGINT, announcing ``READY http://HOST:PORT`` on stdout (after
    ``BATCH-GRPC HOST:PORT`` when the batch protocol is on)."""
    app = build_app(options)
    # vLLM's server (uvicorn, h11) reads a 16 KiB header block with no limit per line: so does this.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
                           access_log=None, max_field_size=16 * 1024, max_line_size=16 * 1024)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    shown = f"[{host}]" if ":" in host else host
    grpc_port = app[SIM_POD].batch_grpc_port
    if grpc_port is not None:
        print(f"BATCH-GRPC {shown}:{grpc_port}", flush=True)
    print(f"READY http://{shown}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse flags and run the pod on uvloop when it is installed."""
    options = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(options))
    else:
        uvloop.run(serve(options))


if __name__ == "__main__":
    main()
