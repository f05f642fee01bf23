"""Who may call: API keys and TLS for both services' servers and for the clients that call them.

- API keys: a server given a key admits a call only with gRPC metadata `authorization: Bearer <key>`
  (compared in constant time), else UNAUTHENTICATED; health checks (grpc.health.v1, and the
  client API's HealthCheck, which gateways probe) stay open. A call is judged on its metadata alone,
  before its body is read: a refused call's body is never parsed, nor buffered past HTTP/2's flow
  window (the refusing handler takes the request as a stream it never reads). The decode front door takes
  `--api-key` from clients; the prefill API takes `--internal-api-key`, which decode's prefill client
  sends. Keys never appear in logs or reprs.
- TLS: `--tls-cert-file` and `--tls-key-file` make a server speak TLS; with `--tls-ca-file` it also
  requires a client certificate signed by that CA (mutual TLS). A client verifies the server against
  a CA file and, for mutual TLS, presents its own certificate and key.
"""

from __future__ import annotations

import hmac

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/", "/sglang.grpc.scheduler.SglangScheduler/HealthCheck")
REFUSAL = "missing or wrong API key (send gRPC metadata authorization: Bearer <key>)"


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert_file: str | None, key_file: str | None, ca_file: str | None = None):
    """TLS credentials for a server (None: plaintext); with `ca_file`, client certificates are required."""
    if not cert_file and not key_file:
        if ca_file:
            raise ValueError("--tls-ca-file needs --tls-cert-file and --tls-key-file (the server's own identity)")
        return None
    if not (cert_file and key_file):
        raise ValueError("TLS needs both --tls-cert-file and --tls-key-file")
    ca = _read(ca_file)
    return grpc.ssl_server_credentials(
        [(_read(key_file), _read(cert_file))], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None):
    """TLS credentials for a client (None: plaintext): the CA to trust, and our identity for mutual TLS."""
    if not ca_file:
        return None
    return grpc.ssl_channel_credentials(_read(ca_file), _read(key_file), _read(cert_file))


def channel(address: str, options: list, credentials=None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def key_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `key` (none without one)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


class _SendKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the key's metadata to every call of a (sync) channel."""

    def __init__(self, metadata: tuple):
        self._metadata = metadata

    def _with_key(self, details):  # grpc's call details are a namedtuple
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


def with_key(channel: grpc.Channel, key: str | None) -> grpc.Channel:
    """`channel` sending `authorization: Bearer <key>` on every call (as is, without a key)."""
    return grpc.intercept_channel(channel, _SendKey(key_metadata(key))) if key else channel


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the key with UNAUTHENTICATED, except health checks."""

    def __init__(self, key: str):
        self._expected = f"Bearer {key}".encode()

    def __repr__(self) -> str:
        return "ApiKeyInterceptor(<key>)"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS) or self._admits(details.invocation_metadata):
            return handler
        return _refusing(handler)

    def _admits(self, metadata) -> bool:
        given = next((v for k, v in metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(given, self._expected)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request: gRPC reads (and parses) a
    unary request before its handler runs, but a streaming one only when the handler asks for it, so
    the refusal takes the request as a stream, whatever the method's shape (the wire is the same)."""

    async def refuse(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    return grpc.stream_stream_rpc_method_handler(
        refuse, request_deserializer=_never_parsed, response_serializer=handler.response_serializer
    )


def _never_parsed(data: bytes):
    raise RuntimeError("the body of an unauthenticated call was read")


def interceptors(key: str | None) -> tuple:
    return (ApiKeyInterceptor(key),) if key else ()
