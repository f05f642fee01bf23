"""Draft heads fitted to a target by the fitting tool (bench.fit_eagle), cached on disk (tests).

    fitted_head(target_dir, "EAGLE" | "EAGLE3") -> a head folder (config.json, model.safetensors,
    and for EAGLE token_map.json) that accepts drafts on chat-formatted prompts.

A fixed number of optimizer steps (not minutes), a fixed seed, one torch thread: the result does not
depend on the machine's speed. The folder is kept under $DISAGG_TEST_HEADS (default
~/.cache/disagg-serve/test-heads/) in a subfolder named by a hash of the target's files, the fit's
parameters and the fitting code, so a changed checkpoint, budget or fitting tool fits a new head.
Written atomically (fitted into a private folder, then renamed); a lock keeps two sessions from
fitting the same head at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil

import torch

# 64 prompts x 48 answer tokens, 200 steps at lr 3e-3: ~30 s a head for the tiny Llama on one core
# (data generation included); held-out accept length at num_steps 3 ~1.7 (EAGLE), ~1.5 (EAGLE3),
# random heads 1.0 (2026-11-26).
FIT = dict(prompts=64, answer_tokens=48, seed=0, max_steps=200, lr=3e-3, unroll=3, max_batch_tokens=1024)
ENV = "DISAGG_TEST_HEADS"


def cache_root() -> str:
    return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "disagg-serve", "test-heads")


def _key(target: str, algorithm: str, params: dict) -> str:
    from bench import fit_eagle
    from common.tools import eagle_data

    h = hashlib.sha256(json.dumps(dict(algorithm=algorithm, **params), sort_keys=True).encode())
    for root, dirs, files in sorted(os.walk(target)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, target).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    for module in (fit_eagle, eagle_data):  # a changed fitting tool fits anew
        with open(module.__file__, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:20]


def fitted_head(target: str, algorithm: str, root: str | None = None, **overrides) -> str:
    """The head folder for (target, algorithm, FIT | overrides), fitted on first use and cached."""
    from bench.fit_eagle import fit

    params = {**FIT, **overrides}
    root = root or cache_root()
    os.makedirs(root, exist_ok=True)
    out = os.path.join(root, f"{algorithm.lower()}-{_key(target, algorithm, params)}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be fitting this head
        if os.path.exists(os.path.join(out, "config.json")):
            return out
        work = f"{out}.fitting-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
                fit(target, algorithm, os.path.join(work, "head"), minutes=math.inf, **params)
            os.rename(os.path.join(work, "head"), out)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(work, ignore_errors=True)
    return out


# DeepSeek-V3's MTP layer fitted in place (common/tools/fit_nextn.py): a copy of the target folder
# whose MTP tensors are fitted, cached like the heads.
FIT_NEXTN = dict(steps=300, prompts=192, answer_tokens=48, seed=0, lr=3e-3)


def fitted_mtp(target: str, root: str | None = None, **overrides) -> str:
    """A copy of the DeepSeek-V3 folder `target` with its MTP layer fitted (FIT_NEXTN | overrides), cached."""
    from common.tools import fit_nextn, tiny_mtp

    params = {**FIT_NEXTN, **overrides}
    root = root or cache_root()
    os.makedirs(root, exist_ok=True)
    h = hashlib.sha256(_key(target, "NEXTN", params).encode())
    for module in (fit_nextn, tiny_mtp):
        with open(module.__file__, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    out = os.path.join(root, f"nextn-{h.hexdigest()[:20]}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(out, "config.json")):
            return out
        work = f"{out}.fitting-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(target, work)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):
                fit_nextn.fit(work, **params)
            os.rename(work, out)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(work, ignore_errors=True)
    return out
