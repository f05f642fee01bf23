"""The decode front door's health: readiness (grpc.health.v1 "" and HealthCheck) and liveness.

Ready: the scheduler (and every TP rank) runs, a prefill replica serves, and the service is not
draining. Whether a replica serves is cached: a watcher thread asks the replicas every 0.25 s, and
a Generate call that finds none serving asks once more, live, before it refuses (calls arriving
during that check share it). Live (grpc.health.v1 service `LIVENESS`, k8s' livenessProbe): the
scheduler and every TP rank run, whatever the prefill replicas do: a restart mends a dead
scheduler, not a missing prefill replica.
"""

from __future__ import annotations

import asyncio
import threading

from grpc_health.v1 import health_pb2

LIVENESS = "liveness"  # the grpc.health.v1 service name of decode's liveness (deploy/k8s/decode.yaml)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self, scheduler, tp_ranks, prefill, server):
        self.scheduler, self.tp_ranks, self.prefill, self.server = scheduler, tp_ranks, prefill, server
        self.draining = False  # set once: the service stops admitting and reports NOT_SERVING
        self.prefill_serving = False  # cached: some prefill replica answered SERVING
        self._recheck: asyncio.Future | None = None  # the replicas' live check in flight, if any
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="health-watch", daemon=True)

    def start(self) -> None:
        """A first look at the prefill replicas, then the watcher (before the server starts)."""
        self.prefill_serving = self.prefill.any_serving()
        self._watcher.start()

    def publish(self) -> None:
        """Readiness and liveness on the started server's grpc.health.v1."""
        self.server.set_serving(self.healthy())
        self._set_live()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join(timeout=5)

    def live(self) -> bool:
        """The scheduler and every TP rank run (False: only a restart mends it)."""
        return self.scheduler.alive and (self.tp_ranks is None or self.tp_ranks.alive())

    def healthy(self) -> bool:
        return self.live() and self.prefill_serving and not self.draining

    def report(self) -> tuple[bool, str]:
        """HealthCheck's answer: healthy, and a word on why not."""
        if self.healthy():
            return True, "ok"
        if self.draining:
            return False, "shutting down"
        return False, "scheduler down" if not self.scheduler.alive else "no prefill replica serving"

    async def recheck_prefill(self) -> None:
        """The cached health says no replica serves: every such call asks the replicas once before it
        fails (off the loop, over fresh channels, so a replica that just came up is used at once and a
        dead one refuses at once). Calls arriving while a check runs share it."""
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.get_running_loop().run_in_executor(None, self.prefill.any_serving, True)
        self.prefill_serving = await asyncio.shield(self._recheck)

    def _set_live(self) -> None:
        self.server.run(self.server.health.set(LIVENESS, SERVING if self.live() else NOT_SERVING), timeout=5.0)

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            self._set_live()  # first: a prefill replica slow to answer must not delay it
            self.prefill_serving = self.prefill.any_serving()
            if not self._stop.is_set():
                self.server.set_serving(self.healthy())
