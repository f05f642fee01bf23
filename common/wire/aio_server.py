"""AioServer: a grpc.aio server on its own event-loop thread, for services whose open streams must
not pin threads (a sync grpc.Server gives every open stream a handler thread, so enough open
streams starve health checks, HealthCheck, GetLoad and Abort). Both services use it. Health
(NOT_SERVING until `set_serving`) and reflection for the named services; the owner stays
synchronous: `start`, `stop`, `set_serving` and `run` may be called from any thread.

`answer_unimplemented(cls, service)` gives a servicer class an async UNIMPLEMENTED answer for every
method of the service it does not define, so clients (smg calls SubscribeKvEvents on connect) get a
clean status and the log no traceback.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.wire.grpc_server import SERVER_OPTIONS, channel_options


class AioServer:
    def __init__(
        self,
        host: str,
        port: int,
        service_names: list[str],
        interceptors: tuple = (),
        credentials=None,
        max_receive_bytes: int | None = None,
    ):
        """`interceptors` (e.g. the API-key check) and `credentials` (TLS; None: plaintext): security.py.
        An interceptor sees a call's method and metadata before its body is read: a handler it swaps in
        decides whether the body is read at all (security.py's refusal never reads it)."""
        self._interceptors = tuple(interceptors)
        self._max_receive_bytes = max_receive_bytes
        self._credentials = credentials
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()
        self.service_names = list(service_names)
        self.server, self.health, self.port = self.run(self._build(host, port))
        if self.port == 0:
            self.close_loop()
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self.set_serving(False)

    async def _build(self, host: str, port: int):
        options = channel_options() + SERVER_OPTIONS
        if self._max_receive_bytes is not None:  # a bound of the service's own (the front door's: by its context)
            key = "grpc.max_receive_message_length"
            options = [o for o in options if o[0] != key] + [(key, self._max_receive_bytes)]
        server = grpc.aio.server(options=options, interceptors=self._interceptors)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        if self._credentials is not None:
            return server, health_servicer, server.add_secure_port(f"{host}:{port}", self._credentials)
        return server, health_servicer, server.add_insecure_port(f"{host}:{port}")

    def run(self, coro, timeout: float | None = 30.0):
        """Run a coroutine on the server's loop and return its result (never from the loop itself)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("AioServer.run called from its own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def _set():
            for name in ["", *self.service_names]:
                await self.health.set(name, status)

        if threading.current_thread() is self._thread:
            self.loop.create_task(_set())
        elif self.loop.is_running():
            self.run(_set(), timeout=5.0)

    def start(self) -> AioServer:
        self.run(self.server.start())
        return self

    def stop(self, grace: float = 1.0) -> None:
        """NOT_SERVING, then stop: calls still open after `grace` seconds are cancelled."""
        if not self.loop.is_running():
            return
        self.set_serving(False)
        self.run(self.server.stop(grace), timeout=grace + 10)
        self.close_loop()

    def close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


def answer_unimplemented(cls, service) -> type:
    """Give `cls` an UNIMPLEMENTED coroutine for each method of `service` it does not implement."""
    generated = [c for c in cls.__mro__ if c.__module__.endswith("_pb2_grpc")]
    for method in service.methods:
        impl = getattr(cls, method.name, None)
        if impl is not None and all(impl is not vars(g).get(method.name) for g in generated):
            continue

        async def unimplemented(self, request, context, _name=method.name):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{service.name}.{_name} is not implemented")

        unimplemented.__name__ = method.name
        setattr(cls, method.name, unimplemented)
    return cls
