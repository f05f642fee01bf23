"""Step 1 of a Generate call: the front door's checks before anything is reserved.

In this order, the first that fails deciding the status: UNAVAILABLE while draining or with the
scheduler down; INVALID_ARGUMENT for bad input (decode_service/request_validation.py) or a
request_id already in flight; UNAVAILABLE with no prefill replica serving (the caller has re-checked
the replicas live first); RESOURCE_EXHAUSTED with `max_running_requests + max_queued_requests`
calls already open. A call that passes gets its CheckedRequest (decode_service/submit_checks.py: the
scheduler's one check of the prompt and params against the model and pool).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

import grpc

from decode_service.request_validation import InvalidRequest, parse_generate
from decode_service.submit_checks import CheckedRequest


class Rejected(Exception):
    """A call refused (here) or failed (decode_service/responses.py): the gRPC status it ends with, and why."""

    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class Admission:
    def __init__(self, config, runner, scheduler, health):
        self.config, self.runner, self.scheduler, self.health = config, runner, scheduler, health

    def _default_max_new_tokens(self) -> int:
        """A request without max_new_tokens: on-demand KV runs it to the end of the context (OpenAI's
        reading of a missing max_tokens: it costs no KV until used); the full reservation takes the flag."""
        if self.scheduler.growth.on_demand:
            return self.runner.context_length
        return self.config.default_max_new_tokens

    def check(self, request, in_flight: Container[str], open_calls: int, seed: int | None = None) -> CheckedRequest:
        """The request, checked (the scheduler's CheckedRequest), or Rejected; `in_flight`: the client
        request_ids of open calls; `seed`: the sampling seed (the OpenAI API's; gRPC has no field)."""
        if self.health.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if not self.scheduler.alive:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "decode scheduler is not running")
        try:
            ids, params = parse_generate(
                request,
                self.runner.context_length,
                self._default_max_new_tokens(),
                kv_room=self.scheduler.books.room,
                spec_extra=self.scheduler.books.extra,
            )
            if seed is not None:
                params = dataclasses.replace(params, seed=seed)
            checked = self.scheduler.check(ids, params)  # the one check against the model and pool
        except InvalidRequest as e:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if request.request_id in in_flight:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request.request_id!r} is already in flight")
        if not self.health.prefill_serving:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "no prefill replica is serving")
        bound = self.config.max_running_requests + self.config.max_queued_requests
        if open_calls >= bound:
            raise Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{open_calls} requests open: the admission queue is full (max_queued_requests)",
            )
        return checked
