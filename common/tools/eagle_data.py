"""Training data for an EAGLE head: the target's own greedy answers to generated instructions, with
the target's features at every position (what the head reads at serving time).

Instructions come from templates x topics (seeded, distinct; one in 8 texts is held out for
evaluation and never fitted on); each is chat-formatted with the target's tokenizer, and answered
greedily by the colocated loop (common/engine/colocated.py) in batches, which keeps the target's
features of every position as it goes: the final normed hidden (EAGLE) or the captured layers (EAGLE3).
"""

from __future__ import annotations

import random
import sys
import time
import zlib

import torch

from common.engine.colocated import ColocatedLoop
from common.engine.sampling import SamplingParams

TEMPLATES = [
    "Explain {} to a child.",
    "Write a short poem about {}.",
    "List three facts about {}.",
    "What is the history of {}?",
    "Give me a tip about {}.",
    "Describe {} in one paragraph.",
    "Why do people like {}?",
    "Write a short story about {}.",
    "How does {} work?",
    "Compare {} and {}.",
    "What are the pros and cons of {}?",
    "Summarize what you know about {}.",
    "What would a beginner get wrong about {}?",
    "Write a haiku about {}.",
    "Teach me one thing about {}.",
    "What is the connection between {} and {}?",
    "Write an email to a friend about {}.",
    "Give three questions a student might ask about {}.",
    "What is surprising about {}?",
    "Describe a day in the life of someone who loves {}.",
    "Explain why {} matters today.",
    "Write a product description for something related to {}.",
]
TOPICS = [
    "the ocean",
    "volcanoes",
    "bread",
    "the moon",
    "bicycles",
    "music",
    "rain",
    "chess",
    "bees",
    "the internet",
    "mountains",
    "coffee",
    "trains",
    "photosynthesis",
    "friendship",
    "gravity",
    "cats",
    "Paris",
    "the Roman empire",
    "electricity",
    "gardening",
    "football",
    "winter",
    "robots",
    "rivers",
    "libraries",
    "the sun",
    "dinosaurs",
    "cooking pasta",
    "sleep",
    "airplanes",
    "mathematics",
    "forests",
    "the piano",
    "deserts",
    "recycling",
    "stars",
    "honey",
    "painting",
    "computers",
    "tea",
    "whales",
    "the printing press",
    "glaciers",
    "dogs",
    "birthdays",
    "bridges",
    "earthquakes",
    "chocolate",
    "maps",
    "vaccines",
    "the guitar",
    "ancient Egypt",
    "clouds",
    "marathons",
    "soap",
    "the brain",
    "tigers",
    "solar panels",
    "poetry",
    "jazz",
    "rice",
    "submarines",
    "the alphabet",
    "snow",
    "museums",
    "ants",
    "the telephone",
    "yoga",
    "islands",
    "cheese",
    "satellites",
    "origami",
    "the heart",
    "lighthouses",
    "owls",
    "money",
    "tomatoes",
    "the Olympics",
    "clocks",
    "wind",
    "newspapers",
    "penguins",
    "batteries",
    "camping",
    "the violin",
    "cities",
    "salt",
    "butterflies",
    "space travel",
    "ice cream",
    "the Amazon",
    "bridges in Japan",
    "video games",
    "wolves",
    "the Renaissance",
    "umbrellas",
    "democracy",
    "oak trees",
    "magnets",
    "knitting",
    "sharks",
]


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
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def answers(
    runner, prompts: list[list[int]], max_new_tokens: int, capture: tuple[int, ...] = (), batch: int = 32
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(prompt + the target's greedy answer (EOS ends it early), the target's features at every
    position but the last [len - 1, F]) for every prompt: the final normed hidden, or with `capture`
    (EAGLE3) those layers' outputs concatenated, kept while the answer is generated."""
    loop, seqs, feats = ColocatedLoop(runner, chunk_size=2048, capture=capture), [], []
    start = time.monotonic()
    for i in range(0, len(prompts), batch):
        for r in loop.generate(prompts[i : i + batch], SamplingParams(max_new_tokens=max_new_tokens)):
            seqs.append(r.prompt + r.output)
            feats.append(torch.cat(r.features))
        print(
            f"[fit] answers {len(seqs)}/{len(prompts)} ({time.monotonic() - start:.0f}s)", file=sys.stderr, flush=True
        )
    return seqs, feats
