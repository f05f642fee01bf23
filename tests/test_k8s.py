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
        want = {"grpc": config.port, "metrics": config.metrics_port}
        if name == "decode":
            want["http"] = config.openai_port
        assert ports == want
        assert config.host == "0.0.0.0" and config.device == "cuda"
        assert container["readinessProbe"]["grpc"]["port"] == config.port
        assert spec["terminationGracePeriodSeconds"] > config.shutdown_grace_s
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert f"/etc/disagg/{name}.yaml" in container["args"]
    smg = _by("Deployment", "smg")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"http://decode:{decode.openai_port}" in smg
    hpa = _by("HorizontalPodAutoscaler", "prefill")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "prefill"


def _pod(name: str) -> dict:
    return _by("Deployment", name)["spec"]["template"]["spec"]


def test_keys_come_from_a_mounted_secret_never_a_command_line(tmp_path):
    """Both services read the internal key from the Secret's file, mounted with a mode the key loader
    accepts; no container carries a key value in its args or env."""
    for name, parse in (("prefill", parse_prefill), ("decode", parse_decode)):
        spec = _pod(name)
        container = spec["containers"][0]
        args = container["args"]
        assert "--internal-api-key" not in args and "--api-key" not in args
        assert not any("KEY" in e.get("name", "") and "value" in e for e in container.get("env", ()))
        path = args[args.index("--internal-api-key-file") + 1]
        [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == "disagg-keys" and mount.get("readOnly") is True
        assert os.path.relpath(path, mount["mountPath"]) in [i["path"] for i in secret["items"]]
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]  # group read reaches us
        local = tmp_path / name  # the file as the kubelet writes it: the key, defaultMode
        local.write_text("k3y")
        local.chmod(secret["defaultMode"])
        config = tmp_path / "config.yaml"
        config.write_text(_by("ConfigMap", "disagg-config")["data"][f"{name}.yaml"])
        argv = [str(local) if a == path else str(config) if a.startswith("/etc/disagg/") else a for a in args[3:]]
        assert parse(argv).internal_api_key == "k3y"


def test_every_pod_runs_unprivileged_with_a_read_only_root():
    for name in ("prefill", "decode", "smg"):
        spec = _pod(name)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
            assert sc["readOnlyRootFilesystem"] is True, name
            scratch = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            for path in ("/tmp", "/home/disagg"):  # /tmp, and HOME's caches (Triton, Inductor, layout table)
                assert "emptyDir" in scratch[path], (name, path)


def _reach(policy: dict, port: str) -> list:
    """The `from` peers of the rules that open `port` (None: any peer)."""
    peers = []
    for rule in policy["spec"]["ingress"]:
        if not rule.get("ports") or any(p["port"] == port for p in rule["ports"]):
            peers.append(rule.get("from"))
    return peers


def test_network_policies_let_only_decode_reach_prefill_and_only_the_gateway_reach_decode():
    for target, caller in (("prefill", "decode"), ("decode", "gateway")):
        policy = _by("NetworkPolicy", f"{target}-ingress")
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        pods = _by("Deployment", target)["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pods.items()
        [peers] = _reach(policy, "grpc")
        assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers] == [caller]
        assert None in _reach(policy, "metrics")  # the scraper, wherever it runs
        ports = {p["name"] for p in _pod(target)["containers"][0]["ports"]}
        assert {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]} <= ports
