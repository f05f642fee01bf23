"""Greedy answers of each engine and weight format against our float32 answers: what a faster dtype costs.

    python -m bench.quality_bench [--max-tokens 48] [--forced-tokens 0]
        [--engines ours,ours-w8,ours-bf16,ours-bf16-matmul,ours-w8a8,vllm,llamacpp-f32,llamacpp-q8,llamacpp-q4]

The same SmolLM2-135M-Instruct weights in every engine (bench/peers_bench.py starts them), the 50
chat questions below, greedy (temperature 0), one request at a time through each engine's OpenAI chat
endpoint. The reference is our float32 pair (the first engine), which the tests hold token-exact to
HF transformers. Per engine: the share of answers equal to the reference's, and for the others the
median position (in the reference tokenizer's tokens) of the first difference; and the answer to the
first question, which users ask first ("What is the capital of France?").

An answer is equal or not as a whole, and one early token apart sends the rest elsewhere, so the share is
coarse: formats whose every token is a little closer can score alike. `--forced-tokens N` adds a finer
measure: at each of the first N positions of every reference answer, the engine is given the chat prompt
and the reference's tokens before that position (token ids, through /v1/completions, one token, greedy)
and its token is compared with the reference's: the share of positions it picks the reference's token.
About 1% of positions are the measure's own: the reference is the answer's text tokenized again (not always
the ids generated) and tokens compare as text, so an engine whose answers all equal the reference's scored
98.9% (SmolLM2, BENCHMARKS.md issue 58 part 12). That share falls on every engine alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import urllib.request

from bench import peers_bench
from common.tools.demo import model_folder
from common.tools.procs import stop

QUESTIONS = [
    "What is the capital of France?",
    "What is the largest planet in our solar system?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name three primary colors.",
    "What is photosynthesis?",
    "How many continents are there?",
    "What is the chemical symbol for gold?",
    "Explain what a computer is in one sentence.",
    "What is the square root of 81?",
    "Give me a synonym for happy.",
    "What language is spoken in Brazil?",
    "What is the tallest mountain in the world?",
    "Who painted the Mona Lisa?",
    "What does DNA stand for?",
    "How many days are in a leap year?",
    "What is the freezing point of water in Fahrenheit?",
    "Name a mammal that can fly.",
    "What is the main ingredient in guacamole?",
    "What is the speed of light, roughly?",
    "Write a haiku about the sea.",
    "What is the opposite of cold?",
    "What gas do humans breathe out?",
    "Which ocean is the largest?",
    "What is 12 times 12?",
    "Who was the first person to walk on the moon?",
    "What is the capital of Japan?",
    "Why is the sky blue?",
    "What is an adjective?",
    "Name the three states of matter.",
    "What is the currency of the United Kingdom?",
    "How many legs does a spider have?",
    "What is the longest river in Africa?",
    "Give one tip for staying healthy.",
    "What is gravity?",
    "What is the capital of Italy?",
    "Translate 'thank you' into Spanish.",
    "What do bees make?",
    "What is the smallest prime number?",
    "Describe the color green to someone.",
    "What is a verb?",
    "What is the hottest planet in the solar system?",
    "Who invented the telephone?",
    "What is the capital of Canada?",
    "How many hours are in a day?",
    "What is the main function of the heart?",
    "Suggest a name for a pet cat.",
    "What is the largest desert in the world?",
    "What is a noun?",
    "What is the capital of Germany?",
]


def model_id(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def ask(base: str, model: str, question: str, max_tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


def next_token(base: str, model: str, ids: list[int]) -> str:
    """The engine's greedy next token after the token ids `ids`, as text."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    read = (out.get("usage") or {}).get("prompt_tokens")
    if read is not None and read != len(ids):  # e.g. a BOS added: not the reference's context
        raise RuntimeError(f"{base} read {read} prompt tokens for {len(ids)} ids")
    return out["choices"][0]["text"]


def forced_agreement(base: str, model: str, prompts: list[list[int]], ref_ids: list[list[int]], tokenizer,
                     n: int) -> float:  # fmt: skip
    """The share of the first `n` positions of each reference answer where the engine, given the prompt and
    the reference's tokens before it, picks the reference's token (compared as text)."""
    hits = total = 0
    for prompt, ref in zip(prompts, ref_ids):
        for j in range(min(n, len(ref))):
            hits += next_token(base, model, prompt + ref[:j]) == tokenizer.decode([ref[j]])
            total += 1
    return hits / total


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first token position where `a` and `b` differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.quality_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument(
        "--engines",
        default="ours,ours-w8,ours-bf16,ours-bf16-matmul,ours-w8a8,vllm,llamacpp-f32,llamacpp-q8,llamacpp-q4",
    )
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--forced-tokens", type=int, default=0, help="teacher-forced positions per answer (0: off)")
    p.add_argument("--vllm-dtype", default="float32")
    args = p.parse_args(argv)
    args.concurrency, args.input_len, args.output_len = "1", 64, args.max_tokens  # what peers_bench.start reads
    args.decode_flags = args.pair_flags = ""
    from transformers import AutoTokenizer

    rows, answers, forced = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        model = model_folder(args.model_path, False, tmp)
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 return_dict=False) for q in QUESTIONS]  # fmt: skip
        ref_ids = None
        ggufs = peers_bench.gguf_files() if any(e.startswith("llamacpp") for e in args.engines.split(",")) else {}
        for engine in args.engines.split(","):
            if not peers_bench.available(engine):
                continue
            procs, base, _ = peers_bench.start(engine, model, ggufs, os.path.join(tmp, f"{engine}.log"), args)
            try:
                served = model_id(base)
                answers[engine] = [ask(base, served, q, args.max_tokens) for q in QUESTIONS]
                if ref_ids is None:  # the first engine is the reference
                    ref_ids = [tokenizer(a, add_special_tokens=False).input_ids for a in answers[engine]]
                elif args.forced_tokens:
                    forced[engine] = forced_agreement(base, served, prompts, ref_ids, tokenizer, args.forced_tokens)
            finally:
                for proc in procs:
                    stop(proc)
            print(f"[quality] {engine}: {answers[engine][0]!r}", flush=True)
    for engine, theirs in answers.items():
        diffs = [first_difference(r, tokenizer(a, add_special_tokens=False).input_ids) for r, a in zip(ref_ids, theirs)]
        differing = [d for d in diffs if d is not None]
        rows.append(dict(engine=engine, same=sum(d is None for d in diffs) / len(diffs),
                         first_diff=statistics.median(differing) if differing else None, france=theirs[0],
                         forced=forced.get(engine)))  # fmt: skip
    extra = f" reference's token at each of the first {args.forced_tokens} positions |" if forced else ""
    print(f"| engine | answers equal to {next(iter(answers))}'s | median first differing token | "
          f"'{QUESTIONS[0]}' |{extra}")  # fmt: skip
    print("| --- | --- | --- | --- |" + (" --- |" if forced else ""))
    for r in rows:
        fd = "-" if r["first_diff"] is None else f"{r['first_diff']:.0f}"
        tf = "" if not forced else " - |" if r["forced"] is None else f" {100 * r['forced']:.2f}% |"
        print(f"| {r['engine']} | {100 * r['same']:.0f}% | {fd} | {r['france']!r} |{tf}")
    return rows


if __name__ == "__main__":
    main()
