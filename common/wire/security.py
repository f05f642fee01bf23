"""Who may call: API keys and TLS for both services' servers and for the clients that call them.

- API keys: a server given a key admits a call only with gRPC metadata `authorization: Bearer <key>`
  (compared in constant time), else UNAUTHENTICATED; health checks (grpc.health.v1, and the
  client API's HealthCheck, which gateways probe) stay open. A call is judged on its metadata alone,
  before its body is read: a refused call's body is never parsed, nor buffered past HTTP/2's flow
  window (the refusing handler takes the request as a stream it never reads). The decode front door takes
  `--api-key` from clients. Keys never appear in logs or reprs.
- The internal key is never sent: decode's prefill client proves it, a call at a time, with
  `authorization: Signed <unix s>.<nonce>.<HMAC-SHA256(key, method, time, nonce)>` (`signed_metadata`),
  and the prefill API (`SignedKeyInterceptor`) admits a token for its own method, within
  TOKEN_WINDOW_S of its clock, once. Whoever answers at `--prefill-addr` (a port taken by another
  local user between `free_port` and prefill's bind, say) learns nothing that admits a call.
- TLS: `--tls-cert-file` and `--tls-key-file` make a server speak TLS; with `--tls-ca-file` it also
  requires a client certificate signed by that CA (mutual TLS). A client verifies the server against
  a CA file and, for mutual TLS, presents its own certificate and key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/", "/sglang.grpc.scheduler.SglangScheduler/HealthCheck")
REFUSAL = "missing or wrong API key (send gRPC metadata authorization: Bearer <key>)"
SIGNED_REFUSAL = "missing, wrong, stale or replayed internal token (authorization: Signed ...)"
TOKEN_WINDOW_S = 300.0  # a token's age either way (clock skew between the services' hosts)


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


def _token_mac(key: bytes, method: str, stamp: str, nonce: str) -> str:
    return hmac.new(key, f"{method}\0{stamp}\0{nonce}".encode(), hashlib.sha256).hexdigest()


def signed_metadata(key: str | None, method: str, now: float | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata of one internal call of `method` (e.g. "/disagg.v1.Prefill/Prefill"): a fresh token
    made with the key, never the key (none without one)."""
    if not key:
        return ()
    stamp, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(16)
    return (("authorization", f"Signed {stamp}.{nonce}.{_token_mac(key.encode(), method, stamp, nonce)}"),)


class SignedKeyInterceptor(grpc.aio.ServerInterceptor):
    """The internal API's check: UNAUTHENTICATED for every call (but health) without a token made with
    the key for this very method, within TOKEN_WINDOW_S of this host's clock, not seen before."""

    def __init__(self, key: str):
        self._key = key.encode()
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten (its token is stale by then)

    def __repr__(self) -> str:
        return "SignedKeyInterceptor(<key>)"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        if self._admits(details.method, details.invocation_metadata, time.time()):
            return handler
        return _refusing(handler, SIGNED_REFUSAL)

    def _admits(self, method: str, metadata, now: float) -> bool:
        given = next((v for k, v in metadata or () if k == "authorization"), "")
        given = given.decode(errors="replace") if isinstance(given, bytes) else given
        parts = given[len("Signed ") :].split(".") if given.startswith("Signed ") else []
        if len(parts) != 3 or not parts[0].isdigit() or len(parts[1]) != 32:
            return False
        stamp, nonce, mac = parts
        if abs(now - int(stamp)) > TOKEN_WINDOW_S:
            return False
        if not hmac.compare_digest(mac, _token_mac(self._key, method, stamp, nonce)):
            return False
        if len(self._seen) > 4096:  # forget the nonces whose tokens are stale anyway
            self._seen = {n: t for n, t in self._seen.items() if t > now}
        if nonce in self._seen:
            return False  # a replay
        self._seen[nonce] = now + 2 * TOKEN_WINDOW_S
        return True


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


def _refusing(handler: grpc.RpcMethodHandler, why: str = REFUSAL) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request: gRPC reads (and parses) a
    unary request before its handler runs, but a streaming one only when the handler asks for it, so
    the refusal takes the request as a stream, whatever the method's shape (the wire is the same)."""

    async def refuse(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    return grpc.stream_stream_rpc_method_handler(
        refuse, request_deserializer=_never_parsed, response_serializer=handler.response_serializer
    )


def _never_parsed(data: bytes):
    raise RuntimeError("the body of an unauthenticated call was read")


def interceptors(key: str | None, signed: bool = False) -> tuple:
    """The key check of a server: a Bearer key (the front door), or with `signed` the internal API's tokens."""
    if not key:
        return ()
    return (SignedKeyInterceptor(key),) if signed else (ApiKeyInterceptor(key),)
