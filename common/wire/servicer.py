"""Register a servicer on a grpc.aio server from its service descriptor, parsing requests tolerantly.

gRPC's generated registration parses each request before the handler runs; bytes that are not the
request message make it answer INTERNAL and log a traceback. Here a request that does not parse
reaches the handler's wrapper as `Malformed` and is answered INVALID_ARGUMENT, naming the method.
(Client-streaming methods, which neither service has, keep gRPC's own parsing.)
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError


class Malformed:
    def __init__(self, error: str):
        self.error = error


def _parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Malformed(str(e) or "not a valid message")

    return parse


async def _refuse(request: Malformed, context, name: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name} request: {request.error}")


def _unary(impl, name: str):
    async def handle(request, context):
        if isinstance(request, Malformed):
            await _refuse(request, context, name)
        return await impl(request, context)

    return handle


def _stream(impl, name: str):
    async def handle(request, context):
        if isinstance(request, Malformed):
            await _refuse(request, context, name)
        responses = impl(request, context)
        if inspect.isawaitable(responses):  # a coroutine that only aborts (answer_unimplemented)
            await responses
            return
        async for response in responses:
            yield response

    return handle


def add_servicer(server: grpc.aio.Server, servicer, service) -> None:
    """Serve every method of `service` (a ServiceDescriptor) from the same-named coroutine of `servicer`."""
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        impl = getattr(servicer, method.name)
        if method.client_streaming:
            make = (
                grpc.stream_stream_rpc_method_handler
                if method.server_streaming
                else grpc.stream_unary_rpc_method_handler
            )
            handlers[method.name] = make(
                impl, request_deserializer=request_cls.FromString, response_serializer=serialize
            )
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _stream(impl, method.name), request_deserializer=_parser(request_cls), response_serializer=serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, method.name), request_deserializer=_parser(request_cls), response_serializer=serialize
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def serve(config, servicer, service, api_key: str | None, max_receive_bytes: int | None = None, signed: bool = False):
    """The grpc.aio server (not started) of one service: `servicer` under `service`'s descriptor,
    callers checked against `api_key` (None: none needed; `signed`: tokens made with it, the internal
    API's, security.py), TLS from the config's --tls-* files,
    messages over `max_receive_bytes` (None: the shared bound) refused unparsed, and malformed requests
    answered INVALID_ARGUMENT (add_servicer)."""
    from common.wire import security
    from common.wire.aio_server import AioServer

    server = AioServer(
        config.host,
        config.port,
        [service.full_name],
        interceptors=security.interceptors(api_key, signed),
        credentials=security.server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_ca_file),
        max_receive_bytes=max_receive_bytes,
    )
    add_servicer(server.server, servicer, service)
    return server
