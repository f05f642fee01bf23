"""Training data for an EAGLE head: the target's own greedy answers to generated instructions, with
the target's features at every position (what the head reads at serving time).

Instructions come from templates x topics (seeded); each is chat-formatted with the target's
tokenizer, answered greedily by our engine (batched), and the whole sequence is run once more as
one extend to take the features: the final normed hidden (EAGLE) or the captured layers (EAGLE3).
"""

from __future__ import annotations

import random
import sys
import time

import torch

from common.engine.colocated import ColocatedEngine
from common.engine.forward_batch import ForwardBatch
from common.engine.sampling import SamplingParams

TEMPLATES = ["Explain {} to a child.", "Write a short poem about {}.", "List three facts about {}.",
             "What is the history of {}?", "Give me a tip about {}.", "Describe {} in one paragraph.",
             "Why do people like {}?", "Write a short story about {}.", "How does {} work?",
             "Compare {} and {}.", "What are the pros and cons of {}?", "Summarize what you know about {}."]
TOPICS = ["the ocean", "volcanoes", "bread", "the moon", "bicycles", "music", "rain", "chess", "bees",
          "the internet", "mountains", "coffee", "trains", "photosynthesis", "friendship", "gravity", "cats",
          "Paris", "the Roman empire", "electricity", "gardening", "football", "winter", "robots", "rivers",
          "libraries", "the sun", "dinosaurs", "cooking pasta", "sleep", "airplanes", "mathematics", "forests",
          "the piano", "deserts", "recycling", "stars", "honey", "painting", "computers"]


def instructions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        template = rng.choice(TEMPLATES)
        out.append(template.format(*rng.sample(TOPICS, template.count("{}"))))
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def answers(runner, prompts: list[list[int]], max_new_tokens: int, batch: int = 32) -> list[list[int]]:
    """prompt + the target's greedy answer (EOS ends it early), for every prompt."""
    engine, out = ColocatedEngine(runner, chunk_size=1024), []
    start = time.monotonic()
    for i in range(0, len(prompts), batch):
        reqs = engine.generate(prompts[i:i + batch], SamplingParams(max_new_tokens=max_new_tokens))
        out += [r.prompt + r.output for r in reqs]
        print(f"[fit] answers {len(out)}/{len(prompts)} ({time.monotonic() - start:.0f}s)", file=sys.stderr, flush=True)
    return out


@torch.inference_mode()
def features(runner, seq: list[int], capture: tuple[int, ...] = ()) -> torch.Tensor:
    """The head's input features [len(seq), F] at every position of `seq` (one extend forward): the
    final normed hidden, or with `capture` (EAGLE3) those layers' outputs concatenated."""
    pool, kv = runner.req_to_token_pool, runner.kv_allocator
    row, slots = pool.alloc(), kv.alloc(len(seq))
    try:
        pool.write(row, 0, slots)
        out = runner.model(ForwardBatch.extend(pool.req_to_token, [row], [0], [seq]), runner.backend, capture=capture)
        return (out[1] if capture else out).float().cpu()
    finally:
        kv.free(slots)
        pool.free(row)
