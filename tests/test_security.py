"""Nobody unauthorised gets in: API keys on the front door and the prefill API, TLS and mutual TLS."""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.tools.client import Client
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from decode_service.config import DecodeConfig
from decode_service.server import DecodeService
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillService
from tests.grpc_harness import wait_for
from tests.oracle import hf_greedy

PROMPT = [5, 6, 7, 8]


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(tmp, name: str, ca: str) -> None:
    """name.key / name.pem signed by the CA `ca`, valid for 127.0.0.1 and localhost."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=tmp)
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=tmp)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("certs")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}",
                 cwd=tmp)  # fmt: skip
    for name in ("prefill", "decode", "client"):
        _issue(tmp, name, "ca")
    _issue(tmp, "stranger", "other-ca")
    return lambda name: str(tmp / name)


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_api_keys_on_the_front_door_and_the_prefill_api(checkpoint):
    path = checkpoint("llama")
    prefill = PrefillService(PrefillConfig(path, port=0, internal_api_key="inside")).start()
    config = DecodeConfig(path, prefill_addr=prefill.address, port=0, api_key="outside", internal_api_key="inside")
    assert "outside" not in repr(config) and "inside" not in repr(config)  # keys never reach a log line
    decode = DecodeService(config).start()
    try:
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        wait_for("decode never saw the prefill replica", lambda: stub.HealthCheck(pb.HealthCheckRequest()).healthy)
        assert _health(grpc.insecure_channel(decode.address)) == health_pb2.HealthCheckResponse.SERVING
        request = pb.GenerateRequest(
            request_id="x",
            tokenized=pb.TokenizedInput(input_ids=PROMPT),
            sampling_params=pb.SamplingParams(max_new_tokens=4, ignore_eos=True),
        )
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "outside"),)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = Client(decode.address, api_key="outside")
        assert [t for c in client.generate_ids(PROMPT, 4, ignore_eos=True) for t in c] == hf_greedy(path, PROMPT, 4)
        # the internal API: the decode service sent the key; anyone else is refused
        inner = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
        with pytest.raises(grpc.RpcError) as err:
            list(inner.Prefill(prefill_pb2.PrefillRequest(request_id="p", input_ids=PROMPT), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert prefill.num_prefilled == 1  # only the keyed call reached the prefill worker
    finally:
        decode.stop()
        prefill.stop()


def test_the_internal_key_is_proven_per_call_never_sent(checkpoint):
    """Decode proves the internal key with a token per call (security.signed_metadata): whoever answers
    at --prefill-addr sees no key, and the prefill API admits a token for its own method, fresh, once.
    The Bearer form of the key itself is refused."""
    from common.wire import security
    from common.wire.aio_server import AioServer
    from decode_service.prefill_replicas import GET_LOAD_METHOD, PREFILL_METHOD

    path, key = checkpoint("llama"), "inside-" + "k" * 40
    prefill = PrefillService(PrefillConfig(path, port=0, internal_api_key=key)).start()
    seen: list[tuple] = []

    class Listening(grpc.aio.ServerInterceptor):  # a stranger at the prefill address: records what it hears
        async def intercept_service(self, continuation, details):
            seen.append(tuple(details.invocation_metadata or ()))
            return await continuation(details)

    service = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
    impostor = AioServer("127.0.0.1", 0, [service], interceptors=(Listening(),)).start()
    impostor.set_serving(True)  # healthy, so decode calls it (GetLoad: each carries decode's token)
    decode = DecodeService(
        DecodeConfig(path, prefill_addr=f"{prefill.address},{impostor.address}", port=0, internal_api_key=key)
    ).start()
    try:
        client = Client(decode.address)
        for _ in range(3):
            assert [t for c in client.generate_ids(PROMPT, 2, ignore_eos=True) for t in c] == hf_greedy(path, PROMPT, 2)
        heard = [v for md in seen for k, v in md if k == "authorization"]
        assert heard and all(key not in str(v) for v in heard), "the stranger heard the key"
        inner = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
        load = lambda md: inner.GetLoad(prefill_pb2.LoadRequest(), metadata=md, timeout=10)  # noqa: E731
        token = security.signed_metadata(key, GET_LOAD_METHOD)
        load(token)
        refused = [
            token,  # the same token again: a replay
            (("authorization", f"Bearer {key}"),),  # the key itself
            security.signed_metadata(key, PREFILL_METHOD),  # a token for another method
            security.signed_metadata(key, GET_LOAD_METHOD, now=time.time() - 2 * security.TOKEN_WINDOW_S),
            security.signed_metadata("another key", GET_LOAD_METHOD),
        ]
        for md in refused:
            with pytest.raises(grpc.RpcError) as err:
                load(md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
    finally:
        decode.stop()
        prefill.stop()
        impostor.stop(0.1)


def test_mutual_tls_on_both_hops(checkpoint, certs):
    path = checkpoint("llama")
    prefill = PrefillService(
        PrefillConfig(
            path,
            port=0,
            tls_cert_file=certs("prefill.pem"),
            tls_key_file=certs("prefill.key"),
            tls_ca_file=certs("ca.pem"),
        )  # fmt: skip
    ).start()
    decode = DecodeService(
        DecodeConfig(
            path,
            prefill_addr=prefill.address,
            port=0,
            tls_cert_file=certs("decode.pem"),
            tls_key_file=certs("decode.key"),
            tls_ca_file=certs("ca.pem"),
            prefill_tls_ca_file=certs("ca.pem"),
        )  # fmt: skip
    ).start()
    try:
        client = Client(decode.address, tls_ca_file=certs("ca.pem"), tls_cert_file=certs("client.pem"),
                        tls_key_file=certs("client.key"))  # fmt: skip
        wait_for("decode never saw the prefill replica over TLS", lambda: client.stub.HealthCheck(
            pb.HealthCheckRequest(), timeout=5).healthy)  # fmt: skip
        got = [t for c in client.generate_ids(PROMPT, 4, ignore_eos=True) for t in c]
        assert got == hf_greedy(path, PROMPT, 4)
        strangers = [
            Client(decode.address, tls_ca_file=certs("ca.pem"), tls_cert_file=certs("stranger.pem"),
                   tls_key_file=certs("stranger.key")),  # a certificate from another CA
            Client(decode.address, tls_ca_file=certs("ca.pem")),  # no client certificate
            Client(decode.address),  # plaintext
        ]  # fmt: skip
        for stranger in strangers:
            with pytest.raises(grpc.RpcError) as err:
                stranger.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        plain = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
        with pytest.raises(grpc.RpcError) as err:
            plain.GetLoad(prefill_pb2.LoadRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        decode.stop()
        prefill.stop()
