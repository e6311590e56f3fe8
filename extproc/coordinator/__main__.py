"""``python -m extproc.coordinator --config FILE [--host H] [--port P]``: the batching coordinator.

Once listening it prints ``READY http://HOST:PORT`` on stdout (the launcher waits for that line).
It reads the node's pod states (the snapshot the extproc workers share, or scrapes it itself when
none of them does) to know when a pod has room. Stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from aiohttp import web

from extproc.config import ConfigError, GatewayConfig, load_config
from extproc.coordinator.merge import PromptRenderer
from extproc.coordinator.server import Coordinator, build_app
from extproc.routing.engines import scrape_targets
from extproc.routing.podstate import PodStates, default_state_path, gather_forever
from extproc.telemetry.tracing import RequestTracer


def chat_templates(config: GatewayConfig) -> Mapping[str, PromptRenderer]:
    """The chat template of each model that has its own (``models[].chat_template``), under its
    name and its aliases; the coordinator renders the other models' chats with ChatML."""
    return {name: model.chat_template for model in config.models if model.chat_template is not None
            for name in (model.name, *model.aliases)}


async def serve(config: GatewayConfig, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT."""
    scrape = config.endpoint_picker.scrape
    states = PodStates(stale_after_s=scrape.interval_s * scrape.stale_after_intervals)
    targets = scrape_targets(config)
    gatherer = None
    if scrape.enabled and targets:
        path = Path(scrape.path) if scrape.path else default_state_path(targets)
        gatherer = asyncio.create_task(gather_forever(lambda: targets, path, scrape.interval_s, states,
                                                      scrape.timeout_s))
    tracer = RequestTracer.from_config(config.tracing) if config.tracing.enabled else None
    coordinator = Coordinator(states, tracer, chat_templates(config), engines=targets)
    runner = web.AppRunner(build_app(coordinator), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"READY http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if gatherer is not None:
        gatherer.cancel()
    await runner.cleanup()
    if tracer is not None:
        tracer.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the arguments and serve."""
    parser = argparse.ArgumentParser(prog="python -m extproc.coordinator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the gateway config (its pools' pods)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: the config's server.coordinator port")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = load_config(Path(args.config))
    except ConfigError as error:
        sys.exit(f"{args.config}: {error}")
    port = args.port
    if port is None:
        port = int(config.server.coordinator.rpartition(":")[2]) if config.server.coordinator else 8081
    asyncio.run(serve(config, args.host, port))


if __name__ == "__main__":
    main()
