"""The tiny checkpoint builder: deterministic, loadable by transformers, real tokenizer."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from common.models.config import load_model_config
from common.tools.tiny_checkpoint import build
from common.tools.tokenizer import load_tokenizer


def _digest(path: str) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))}


def test_build_is_deterministic(tmp_path, checkpoint):
    again = build(str(tmp_path / "again"), arch="qwen3")
    assert _digest(again) == _digest(checkpoint("qwen3"))
    other_seed = build(str(tmp_path / "seed1"), arch="qwen3", seed=1)
    assert _digest(other_seed)["model.safetensors"] != _digest(again)["model.safetensors"]


def test_tokenizer_round_trips_and_has_chat_template(checkpoint):
    path = checkpoint("llama")
    tok = load_tokenizer(path)
    text = "Hello, world! The decode service counts 1 2 3 — ünïcode too."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()), "BPE merges should compress the text"
    cfg = load_model_config(path)
    assert tok.eos_token_id in cfg.eos_token_ids and tok.bos_token_id == cfg.bos_token_id
    assert cfg.vocab_size == len(tok)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_runnable_as_a_module(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "common.tools.tiny_checkpoint", "--arch", "qwen2", "--tied", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "built tiny qwen2 checkpoint" in proc.stdout
    assert load_model_config(str(out)).tie_word_embeddings
