"""An ext_proc server that decides nothing: the floor of what Python grpc.aio costs per request.

The overhead benchmark runs it behind the same Envoy filters as the real server, so the
difference between the two is llmgw's own work, and the rest is gRPC's. Where the gateway's
listener also streams access-log entries to extproc (gRPC AccessLogService), it reads and
drops those as well.

    python -m bench.null_extproc --port 0     # prints READY host:port
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

_ANSWERS = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


class NullProcessor(pb_grpc.ExternalProcessorServicer):
    """CONTINUE to every message; silence on observer streams."""

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            if not message.observability_mode:
                yield _ANSWERS[message.WhichOneof("request")]


class NullAccessLog(als_pb2_grpc.AccessLogServiceServicer):
    """Read every access-log entry Envoy streams and keep none (envoy.service.accesslog.v3)."""

    async def StreamAccessLogs(  # noqa: N802 (gRPC's name)
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                               context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for _message in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


async def _serve(port: int) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
    pb_grpc.add_ExternalProcessorServicer_to_server(NullProcessor(), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(NullAccessLog(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"READY 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.null_extproc")
    parser.add_argument("--port", type=int, default=0)
    import uvloop

    uvloop.run(_serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
