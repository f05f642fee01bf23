"""deploy/k8s: every object validates against the Kubernetes schemas (kubernetes-validate, offline;
the Prometheus Operator's PodMonitor, a CRD, is checked by hand), and the pieces agree: the config
files parse with the services' own parsers, decode finds prefill through the headless Service, probes
and ports match, and the grace period outlasts the drain."""

import os

import kubernetes_validate
import pytest
import yaml

from decode_service.config import parse_args as parse_decode
from prefill_service.config import parse_args as parse_prefill

K8S = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "k8s")
VERSION = "1.30"
CRDS = {"PodMonitor"}


def _objects() -> list[dict]:
    kustomization = yaml.safe_load(open(os.path.join(K8S, "kustomization.yaml")))
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all(open(os.path.join(K8S, name))) if d]
    return docs


def _by(kind: str, name: str) -> dict:
    return next(o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name)


def test_every_object_validates_against_the_kubernetes_schemas():
    objects = _objects()
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler"}
    for o in objects:
        if o["kind"] in CRDS:
            assert o["apiVersion"] == "monitoring.coreos.com/v1" and o["spec"]["podMetricsEndpoints"][0]["port"]
            continue
        kubernetes_validate.validate(o, VERSION, strict=True)  # raises naming the bad field


def test_a_broken_object_is_caught():
    bad = _by("Deployment", "prefill")
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "thirty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_the_pieces_agree(tmp_path):
    data = _by("ConfigMap", "disagg-config")["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    prefill = parse_prefill(["--config", str(tmp_path / "prefill.yaml")])
    decode = parse_decode(["--config", str(tmp_path / "decode.yaml")])
    headless = _by("Service", "prefill-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert decode.prefill_addr == f"dns:///{headless['metadata']['name']}:{prefill.port}"
    assert headless["spec"]["ports"][0]["port"] == prefill.port
    for config, name in ((prefill, "prefill"), (decode, "decode")):
        spec = _by("Deployment", name)["spec"]["template"]["spec"]
        container = spec["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": config.port, "metrics": config.metrics_port}
        assert config.host == "0.0.0.0" and config.device == "cuda"
        assert container["readinessProbe"]["grpc"]["port"] == config.port
        assert spec["terminationGracePeriodSeconds"] > config.shutdown_grace_s
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert f"/etc/disagg/{name}.yaml" in container["args"]
    smg = _by("Deployment", "smg")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"grpc://decode:{decode.port}" in smg
    hpa = _by("HorizontalPodAutoscaler", "prefill")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "prefill"
