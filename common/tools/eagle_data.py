"""Training data for an EAGLE head: the target's own greedy answers to generated instructions, with
the target's features at every position (what the head reads at serving time).

Instructions come from templates x topics (seeded, distinct; one in 8 texts is held out for
evaluation and never fitted on); each is chat-formatted with the target's
tokenizer, answered greedily by our serving engine (common.tools.offline), and the whole sequence is run once more as
one extend to take the features: the final normed hidden (EAGLE) or the captured layers (EAGLE3).
"""

from __future__ import annotations

import random
import sys
import time
import zlib

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.sampling import SamplingParams
from common.tools import offline

TEMPLATES = ["Explain {} to a child.", "Write a short poem about {}.", "List three facts about {}.",
             "What is the history of {}?", "Give me a tip about {}.", "Describe {} in one paragraph.",
             "Why do people like {}?", "Write a short story about {}.", "How does {} work?",
             "Compare {} and {}.", "What are the pros and cons of {}?", "Summarize what you know about {}.",
             "What would a beginner get wrong about {}?", "Write a haiku about {}.", "Teach me one thing about {}.",
             "What is the connection between {} and {}?", "Write an email to a friend about {}.",
             "Give three questions a student might ask about {}.", "What is surprising about {}?",
             "Describe a day in the life of someone who loves {}.", "Explain why {} matters today.",
             "Write a product description for something related to {}."]
TOPICS = ["the ocean", "volcanoes", "bread", "the moon", "bicycles", "music", "rain", "chess", "bees",
          "the internet", "mountains", "coffee", "trains", "photosynthesis", "friendship", "gravity", "cats",
          "Paris", "the Roman empire", "electricity", "gardening", "football", "winter", "robots", "rivers",
          "libraries", "the sun", "dinosaurs", "cooking pasta", "sleep", "airplanes", "mathematics", "forests",
          "the piano", "deserts", "recycling", "stars", "honey", "painting", "computers", "tea", "whales",
          "the printing press", "glaciers", "dogs", "birthdays", "bridges", "earthquakes", "chocolate", "maps",
          "vaccines", "the guitar", "ancient Egypt", "clouds", "marathons", "soap", "the brain", "tigers",
          "solar panels", "poetry", "jazz", "rice", "submarines", "the alphabet", "snow", "museums", "ants",
          "the telephone", "yoga", "islands", "cheese", "satellites", "origami", "the heart", "lighthouses",
          "owls", "money", "tomatoes", "the Olympics", "clocks", "wind", "newspapers", "penguins", "batteries",
          "camping", "the violin", "cities", "salt", "butterflies", "space travel", "ice cream", "the Amazon",
          "bridges in Japan", "video games", "wolves", "the Renaissance", "umbrellas", "democracy", "oak trees",
          "magnets", "knitting", "sharks"]


def held_out(text: str) -> bool:
    """One instruction in 8 (by a hash of its text) is only ever used to evaluate a head, never to fit one."""
    return zlib.crc32(text.encode()) % 8 == 0


def instructions(n: int, seed: int, evaluation: bool = False) -> list[str]:
    """n distinct generated instructions (seeded) from the fitting split, or with `evaluation` from the
    held-out split (disjoint: a head is never scored on an instruction it was fitted on)."""
    rng, out, seen = random.Random(seed), [], set()
    for _ in range(1000 * n):
        if len(out) == n:
            break
        template = rng.choice(TEMPLATES)
        text = template.format(*rng.sample(TOPICS, template.count("{}")))
        if text not in seen and held_out(text) == evaluation:
            seen.add(text)
            out.append(text)
    return out


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def answers(runners: tuple, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """prompt + the target's greedy answer (EOS ends it early), for every prompt; `runners` are the
    (decode, prefill) ModelRunners of the target."""
    outputs, _ = offline.generate(*runners, prompts, SamplingParams(max_new_tokens=max_new_tokens), progress="fit answers")
    return [p + o for p, o in zip(prompts, outputs)]


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
