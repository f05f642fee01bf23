"""The prefill service's TP messages (prefill_service/tp_messages.py): each travels through the TP
codec whole, and a follower rank (tp_worker.follow) dispatches them by type until Stop."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from common.engine.handoff import HandoffRequest
from common.engine.sampling import SamplingParams
from common.parallel import tp_codec
from prefill_service.tp_messages import Abort, Admit, FailAll, Step, Stop
from prefill_service.tp_worker import follow

CPU = torch.device("cpu")


def _request(rid: str) -> HandoffRequest:
    return HandoffRequest(rid, [1, 2, 3], SamplingParams(stop_token_ids=(7,)), 5, kv_slots=torch.arange(3))


def _travel(message):
    return tp_codec.loads(tp_codec.dumps(message), CPU)


@pytest.mark.parametrize("message", [Abort("r1"), FailAll(), Step(), Stop()], ids=lambda m: type(m).__name__)
def test_plain_messages_travel_through_the_codec_whole(message):
    got = _travel(message)
    assert type(got) is type(message) and got == message
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.rid = "other"


def test_admit_carries_its_request_whole():
    got = _travel(Admit(_request("r1")))
    assert type(got) is Admit and type(got.request) is HandoffRequest
    assert (got.request.rid, got.request.prompt_ids, got.request.params) == ("r1", [1, 2, 3], _request("r1").params)
    assert torch.equal(got.request.kv_slots, torch.arange(3))


class _Group:
    """Rank 0's broadcasts as a follower receives them: each message through the codec."""

    def __init__(self, messages):
        self.messages = iter(messages)

    def broadcast_object(self, obj=None):
        assert obj is None
        return _travel(next(self.messages))


class _Worker:
    """Records what a follower runs; `step` fails when told to (as it would on rank 0 too)."""

    def __init__(self, failing_step: int = -1):
        self.calls, self.running, self.steps, self.failing_step = [], [], 0, failing_step

    def admit(self, request):
        self.calls.append(("admit", request.rid))
        self.running.append(SimpleNamespace(request=request))

    def abort(self, request):
        self.calls.append(("abort", request.rid))
        self.running = [w for w in self.running if w.request is not request]

    def fail_all(self):
        self.calls.append(("fail_all",))
        self.running = []

    def step(self):
        self.steps += 1
        self.calls.append(("step",))
        if self.steps == self.failing_step:
            raise RuntimeError("step broke")


def test_a_follower_runs_each_message_by_type_until_stop(caplog):
    worker = _Worker(failing_step=2)
    messages = [Admit(_request("a")), Admit(_request("b")), Step(), Abort("a"), Abort("gone"), Step()]
    messages += [("step",), FailAll(), Step(), Stop(), Step()]  # nothing after Stop is read
    group = _Group(messages)
    with caplog.at_level(logging.ERROR, logger="prefill_service.tp_worker"):
        follow(worker, group)
    assert worker.calls == [
        ("admit", "a"),
        ("admit", "b"),
        ("step",),
        ("abort", "a"),  # an rid not running is no call
        ("step",),  # it broke: logged, and the follower waits for the next message
        ("fail_all",),
        ("step",),
    ]
    assert next(group.messages) == Step()
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["TP follower: Step failed (as on rank 0)", "TP follower: tuple failed (as on rank 0)"]
