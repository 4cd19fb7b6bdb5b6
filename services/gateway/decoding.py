"""Public methods registered with a request parser that never raises.

gRPC answers a request whose bytes do not parse with INTERNAL ("Exception
deserializing request!"), which reads as a server bug. Here the parser hands
the method a `Malformed` instead, and the method refuses it with
INVALID_ARGUMENT and protobuf's reason.
"""
from __future__ import annotations

import grpc

from kvpop.runtime.pb import generate_pb2


class Malformed:
    def __init__(self, type_name: str, error: Exception):
        self.message = f"the request is not a valid {type_name} message: {error}"


def _parser(message_cls):
    name = message_cls.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return Malformed(name, e)
    return parse


def add_kvpop_servicer(servicer, server: grpc.aio.Server) -> None:
    """generate_pb2_grpc.add_KVpopServicer_to_server with tolerant parsers."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_parser(generate_pb2.GenerateRequest),
            response_serializer=generate_pb2.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=_parser(generate_pb2.GetModelInfoRequest),
            response_serializer=generate_pb2.ModelInfo.SerializeToString),
    }
    name = generate_pb2.DESCRIPTOR.services_by_name["KVpop"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
