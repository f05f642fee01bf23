"""The tokenizer of a checkpoint folder, through transformers' AutoTokenizer (local files only)."""

from __future__ import annotations


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
