"""A request is checked once per service (issue 54): decode's front door and scheduler used to run the
prompt and sampling rules twice (request_validation, then submit), and prefill twice (request_bounds,
then the worker's admit). Every module of either service that holds `validate_prompt` is watched
while one Generate goes through the pair over gRPC: each service runs it exactly once."""

from __future__ import annotations

import sys

import pytest

from common import request_rules
from tests.grpc_harness import GrpcPair


@pytest.fixture
def counted(monkeypatch):
    counts = {"decode_service": 0, "prefill_service": 0}

    def watched(service):
        def validate_prompt(*args, **kwargs):
            counts[service] += 1
            return request_rules.validate_prompt(*args, **kwargs)

        return validate_prompt

    for name, module in list(sys.modules.items()):
        service = name.split(".")[0]
        if service in counts and getattr(module, "validate_prompt", None) is request_rules.validate_prompt:
            monkeypatch.setattr(module, "validate_prompt", watched(service))
    return counts


def test_one_generate_is_checked_once_by_each_service(checkpoint, counted):
    pair = GrpcPair(checkpoint("llama"))
    try:
        counted.update(decode_service=0, prefill_service=0)  # what starting the pair ran is not the request's
        ids, _ = pair.collect(pair.generate([5, 6, 7], 3))
        assert len(ids) == 3
        assert counted == {"decode_service": 1, "prefill_service": 1}, counted
    finally:
        pair.close()
