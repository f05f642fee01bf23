"""deploy/grafana/disagg-serve.json: the dashboard parses, and every series its queries name is one
the services export (scraped after a little traffic, EAGLE on so its series exist too)."""

import json
import os
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.grpc_harness import GrpcPair
from tests.test_eagle import heads  # noqa: F401 (fixture)

DASHBOARD = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "grafana", "disagg-serve.json"
)
SERIES = re.compile(r"\b((?:sglang:|disagg_)[a-z0-9_:]+)")


def _exported(port: int) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dashboard_query_names_an_exported_series(checkpoint, heads):
    dash = json.load(open(DASHBOARD))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    titles = {p["title"] for p in dash["panels"]}
    assert {"Time to first token", "Inter-token latency", "KV transfer speed", "EAGLE accept length"} <= titles
    named = {m for e in exprs for m in SERIES.findall(e)} | set(SERIES.findall(json.dumps(dash["templating"])))
    path = checkpoint("llama")
    flags = dict(speculative_algorithm="EAGLE", speculative_draft_model_path=heads(path, "EAGLE"), metrics_port=0)
    pair = GrpcPair(path, prefill_kw=flags, decode_kw=flags)
    try:
        pair.collect(pair.generate([5, 6, 7, 8], 6, rid="g", ignore_eos=True))
        exported = _exported(pair.decode.metrics_port) | _exported(pair.prefill.metrics_port)
    finally:
        pair.close()
    missing = sorted(m for m in named if m not in exported)
    assert not missing, f"the dashboard queries series nobody exports: {missing}"
    assert len(named) >= 15
