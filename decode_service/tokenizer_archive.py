"""The tokenizer folder as a zip (files at the archive root), for the GetTokenizer RPC.

Only the files a tokenizer needs are packed (never weights); the sha256 of the whole zip goes on
the last chunk, as smg expects.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from collections.abc import Iterator

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "config.json",
    "generation_config.json",
)


def tokenizer_zip(folder: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
        if "tokenizer.json" not in names and "tokenizer.model" not in names:
            raise FileNotFoundError(f"{folder}: no tokenizer.json or tokenizer.model")
        for name in names:
            zf.write(os.path.join(folder, name), arcname=name)
    return buf.getvalue()


def chunks(data: bytes, chunk_bytes: int = 1 << 20) -> Iterator[tuple[bytes, str]]:
    """(piece, sha256-or-empty) pairs; the digest of the whole archive rides on the last piece."""
    digest = hashlib.sha256(data).hexdigest()
    for start in range(0, max(len(data), 1), chunk_bytes):
        last = start + chunk_bytes >= len(data)
        yield data[start : start + chunk_bytes], digest if last else ""
