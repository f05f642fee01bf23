"""The compose check: the CPU form of the deployment (compose.cpu.yaml) built and run for real.

    python -m bench.compose_check [--out-json FILE] [--require]

1. an engine: Debian's docker.io / docker-compose installed where missing (as root), a daemon started
   when none answers (bench/docker_engine.py); where none can run, the check SKIPS and says why, loudly
   (exit 0; with --require, exit 1);
2. the image: the base pulled, or made from Debian packages; the CPU wheelhouse made from the lock
   (deploy/docker/wheelhouse.sh cpu); `docker build --build-arg VARIANT=cpu`; its size;
3. `up` with SmolLM2-135M-Instruct mounted (converted by common.tools.smollm2), timed until smg answers;
4. an OpenAI chat through smg and a Generate straight to decode: the same answer, token for token the
   in-process path's (bench/offline.py: both schedulers and workers in this process); decode's log
   says the fused CPU ops loaded (the image's compiler built them);
5. prefill crashes mid-stream (its process killed from the host, as an OOM kill would): the stream
   finishes, decode's health probe says NOT_SERVING, the container comes back by itself (restart
   policy), the next request succeeds: each step timed;
6. `--scale prefill=2`: both replicas take requests (each one's disagg_prefill_requests_total);
7. `down -v`, nothing of the project left; the daemon stopped if this check started it.

It prints its timings and the answer (and writes them as JSON with --out-json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request

from bench import docker_engine as de
from bench.docker_engine import log, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = "disaggcheck"
IMAGE = "disagg-serve:cpu"
PROMPT = "What is the capital of France?"
ANSWER_TOKENS = 24
STREAM_TOKENS = 300


class Stack:
    """compose.cpu.yaml under one project name, and a look at its containers."""

    def __init__(self, engine: de.Engine, env: dict[str, str]):
        self.cmd = engine.compose + ["-p", PROJECT, "-f", os.path.join(ROOT, "compose.cpu.yaml")]
        self.env = {**os.environ, **env}

    def compose(self, *args: str, timeout: float = 900) -> str:
        return run(self.cmd + list(args), timeout=timeout, env=self.env, cwd=ROOT).stdout

    def containers(self, service: str | None = None) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={PROJECT}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        return run(["docker", "ps", "-aq", *filters], timeout=30).stdout.split()

    def state(self, cid: str) -> dict:
        fmt = '{"status": "{{.State.Status}}", "pid": {{.State.Pid}}, "restarts": {{.RestartCount}}, '
        fmt += '"health": "{{if .State.Health}}{{.State.Health.Status}}{{end}}"}'
        return json.loads(run(["docker", "inspect", "-f", fmt, cid], timeout=30).stdout)

    def host_port(self, cid: str, port: int) -> int:
        fmt = f'{{{{(index (index .NetworkSettings.Ports "{port}/tcp") 0).HostPort}}}}'
        return int(run(["docker", "inspect", "-f", fmt, cid], timeout=30).stdout)

    def wait(self, cid: str, pred, timeout: float, what: str) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if pred(self.state(cid)):
                return time.time() - t0
            time.sleep(0.5)
        raise TimeoutError(f"{what}: not within {timeout:.0f} s ({self.state(cid)})")

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={PROJECT}"
        out = []
        for kind in ("ps -aq", "network ls -q", "volume ls -q"):
            out += [f"{kind.split()[0]}:{x}" for x in run(["docker", *kind.split(), "--filter", label]).stdout.split()]
        return out


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def scrape(port: int, series: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))


def in_process_ids(model: str, ids: list[int], max_new_tokens: int) -> list[int]:
    """The same greedy request through both schedulers and workers in this process (bench/offline.py)."""
    from bench import offline
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.engine.sampling import SamplingParams

    size = dict(max_total_tokens=4096, max_running_requests=4)
    runners = ModelRunner(RunnerArgs(model, **size)), ModelRunner(RunnerArgs(model, **size))
    outs, _ = offline.generate(*runners, [ids], SamplingParams(max_new_tokens=max_new_tokens))
    return list(outs[0])


def build_image(base: str, report: dict) -> None:
    t0 = time.time()
    run(["bash", os.path.join(ROOT, "deploy/docker/wheelhouse.sh"), "cpu"], timeout=1800, cwd=ROOT)
    report["wheelhouse_s"] = round(time.time() - t0, 1)
    t0 = time.time()
    build_args = ["--build-arg", "VARIANT=cpu", "--build-arg", f"BASE_IMAGE={base}"]
    run(["docker", "build", "--network", "host", *build_args, "-t", IMAGE, ROOT], timeout=2400)
    report["build_s"] = round(time.time() - t0, 1)
    report["image_mb"] = round(de.image_size(IMAGE) / 1e6)
    report["base_image"], report["base_mb"] = base, round(de.image_size(base) / 1e6)
    log(f"built {IMAGE}: {report['image_mb']} MB on {base} ({report['base_mb']} MB) in {report['build_s']} s")


def bring_up(stack: Stack, model_name: str, report: dict) -> None:
    t0 = time.time()
    stack.compose("up", "-d", "--no-build", timeout=900)  # returns once decode is healthy (depends_on)
    deadline = time.time() + 300
    while True:
        try:
            models = http_json("http://127.0.0.1:8000/v1/models", timeout=5)
            if any(m.get("id") == model_name for m in models.get("data", [])):
                break
        except OSError:
            pass
        if time.time() > deadline:
            raise TimeoutError("smg did not list the model within 300 s of up")
        time.sleep(0.5)
    report["up_to_answering_s"] = round(time.time() - t0, 1)
    log(f"up: smg lists {model_name} after {report['up_to_answering_s']} s")


def answers(stack: Stack, client, model_path: str, model_name: str, report: dict) -> list[int]:
    tok = client.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    t0 = time.time()
    chat = http_json(
        "http://127.0.0.1:8000/v1/chat/completions",
        {"model": model_name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": ANSWER_TOKENS,
         "temperature": 0},
    )  # fmt: skip
    report["smg_chat_s"] = round(time.time() - t0, 2)
    smg_text = chat["choices"][0]["message"]["content"]
    t0 = time.time()
    direct = [t for new in client.generate_ids(ids, max_new_tokens=ANSWER_TOKENS) for t in new]
    report["decode_generate_s"] = round(time.time() - t0, 2)
    reference = in_process_ids(model_path, ids, ANSWER_TOKENS)
    direct_text = tok.decode(direct, skip_special_tokens=True)
    report.update(answer=direct_text, smg_answer=smg_text, same_as_in_process=direct == reference)
    log(f"smg: {smg_text!r}\n[compose-check] decode Generate: {direct_text!r}")
    assert direct == reference, f"decode's ids {direct} differ from the in-process path's {reference}"
    assert smg_text.strip() == direct_text.strip(), "smg's answer differs from decode's"
    assert "Paris" in direct_text, direct_text
    return ids


def fused_ops_line(stack: Stack) -> str:
    """decode's log line on the fused CPU ops (loaded, or why not: the image has g++ and ninja)."""
    proc = run(["docker", "logs", stack.containers("decode")[0]], timeout=60)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "CPU fused ops" in line]
    return lines[-1].strip() if lines else "(no CPU fused ops line in decode's log)"


def crash_prefill(stack: Stack, client, ids: list[int], report: dict) -> None:
    [prefill] = stack.containers("prefill")
    [decode] = stack.containers("decode")
    got, done, errors = [], threading.Event(), []

    def stream():
        try:
            for new in client.generate_ids(ids, max_new_tokens=STREAM_TOKENS, ignore_eos=True):
                got.extend(new)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    while len(got) < 10 and not done.is_set():
        time.sleep(0.02)
    before = stack.state(prefill)
    run(["kill", "-9", str(before["pid"])])  # a crash, as the kernel's OOM killer would do it
    t_kill = time.time()
    log(f"killed prefill's process (pid {before['pid']}) after {len(got)} streamed tokens")
    time.sleep(1.5)  # decode's watcher looks every 0.25 s
    probe = ["python", "-m", "common.tools.health_probe", "127.0.0.1:30000", "sglang.grpc.scheduler.SglangScheduler"]
    report["decode_probe_while_prefill_down"] = run(["docker", "exec", decode, *probe], check=False).stdout.strip()
    first_error, ok_at, back_at, healthy_at = None, None, None, None
    while (ok_at is None or healthy_at is None) and time.time() - t_kill < 600:
        state = stack.state(prefill)
        if back_at is None and state["restarts"] > before["restarts"] and state["status"] == "running":
            back_at = time.time() - t_kill
        if healthy_at is None and back_at is not None and state["health"] == "healthy":
            healthy_at = time.time() - t_kill
        if ok_at is None:
            try:
                list(client.generate_ids(ids, max_new_tokens=8))
                ok_at = time.time() - t_kill
            except Exception as e:  # noqa: BLE001 - the refusal while no replica serves
                first_error = first_error or (e.details() if hasattr(e, "details") else repr(e))
        time.sleep(0.5)
    done.wait(900)  # a loaded 2-core host streams at a few tokens a second
    state = stack.state(prefill)
    report.update(
        stream_tokens=len(got),
        stream_errors=errors,
        refusal_while_down=first_error,
        prefill_restarts=state["restarts"] - before["restarts"],
        kill_to_running_s=back_at and round(back_at, 1),
        kill_to_healthy_s=healthy_at and round(healthy_at, 1),
        kill_to_next_success_s=ok_at and round(ok_at, 1),
    )
    log(f"stream: {len(got)} tokens {errors or ''}; next request ok {ok_at and round(ok_at, 1)} s after the kill")
    assert len(got) == STREAM_TOKENS and not errors, (len(got), errors)
    assert "NOT_SERVING" in report["decode_probe_while_prefill_down"], report["decode_probe_while_prefill_down"]
    assert back_at is not None and healthy_at is not None and ok_at is not None, report


def scale_prefill(stack: Stack, client, report: dict) -> None:
    t0 = time.time()
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "prefill=2", timeout=900)
    replicas = stack.containers("prefill")
    assert len(replicas) == 2, replicas
    for cid in replicas:
        stack.wait(cid, lambda s: s["health"] == "healthy", 300, "second prefill replica")
    report["scale_to_2_healthy_s"] = round(time.time() - t0, 1)
    time.sleep(6)  # decode resolves dns:///prefill again every 5 s
    ports = [stack.host_port(cid, 9091) for cid in replicas]
    series = "disagg_prefill_requests_total"
    start = [scrape(p, series) for p in ports]
    tok = client.tokenizer
    for round_ in range(4):
        threads = [
            threading.Thread(
                target=lambda i=i, round_=round_: list(
                    client.generate_ids(tok.encode(f"Story {round_}-{i}: once upon"), max_new_tokens=4)
                )
            )
            for i in range(8)
        ]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        taken = [scrape(p, series) - s for p, s in zip(ports, start)]
        if all(n > 0 for n in taken):
            break
    report["requests_per_replica"] = taken
    log(f"scaled prefill to 2 in {report['scale_to_2_healthy_s']} s; requests per replica {taken}")
    assert all(n > 0 for n in taken), taken


def check(engine: de.Engine, args, report: dict) -> None:
    from common.tools.client import Client
    from common.tools.smollm2 import ensure_smollm2

    model = ensure_smollm2()
    unreadable = [n for n in os.listdir(model) if not os.stat(os.path.join(model, n)).st_mode & 0o004]
    assert not unreadable and os.stat(model).st_mode & 0o005 == 0o005, f"uid 1000 cannot read {model}: {unreadable}"
    t0 = time.time()
    base = de.base_image(args.base_image)
    report["base_s"] = round(time.time() - t0, 1)
    build_image(base, report)
    model_name = os.path.basename(model)
    env = {"MODEL_DIR": os.path.dirname(model), "MODEL_NAME": model_name, "BASE_IMAGE": base}
    env["TORCH_THREADS"] = str(args.torch_threads)  # both services, smg and this check share the host's cores
    stack = Stack(engine, env)
    try:
        bring_up(stack, model_name, report)
        client = Client("127.0.0.1:30000", tokenizer_path=model)
        ids = answers(stack, client, model, model_name, report)
        report["decode_cpu_fused"] = fused_ops_line(stack)
        log(f"decode: {report['decode_cpu_fused']}")
        assert "CPU fused ops: loaded" in report["decode_cpu_fused"], "the CPU image should build the fused ops"
        crash_prefill(stack, client, ids, report)
        scale_prefill(stack, client, report)
        client.close()
    finally:
        t0 = time.time()
        stack.compose("down", "-v", "--remove-orphans", "-t", "40", timeout=300)
        report["down_s"] = round(time.time() - t0, 1)
        report["left_after_down"] = stack.leftovers()
    assert not report["left_after_down"], report["left_after_down"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compose_check", description=__doc__.split("\n")[0])
    p.add_argument("--base-image", default="python:3.11-slim", help="pulled if it can be, else a stand-in is made")
    p.add_argument("--torch-threads", type=int, default=1, help="each service's torch threads (TORCH_THREADS)")
    p.add_argument("--out-json", default=None)
    p.add_argument("--require", action="store_true", help="fail, not skip, where no engine can run")
    args = p.parse_args(argv)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model()}
    t0 = time.time()
    engine = de.Engine()
    try:
        try:
            engine.start()
            report.update({k: round(v, 1) for k, v in engine.timings.items()}, compose=" ".join(engine.compose))
            check(engine, args, report)
        except de.EngineUnavailable as e:  # no engine, or no base image can be had: before anything ran
            banner = f"COMPOSE CHECK SKIPPED: no Docker engine can run here: {e}"
            print(f"\n{'!' * len(banner)}\n{banner}\n{'!' * len(banner)}\n", file=sys.stderr, flush=True)
            report["status"] = f"skipped: {e}"
            return 1 if args.require else 0
        report["status"] = "passed"
    except Exception as e:
        report["status"] = f"FAILED: {e!r}"[:2000]
        raise
    finally:
        engine.close()
        report["total_s"] = round(time.time() - t0, 1)
        print(json.dumps(report, indent=1))
        if args.out_json:
            with open(args.out_json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


def _cpu_model() -> str:
    for line in run(["lscpu"], check=False).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
