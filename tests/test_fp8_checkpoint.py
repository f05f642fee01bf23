"""DeepSeek-V3 in its block-quantized fp8 layout (`weight_scale_inv`, common/models/fp8.py): dequantized
at load, it serves what HF serves from the same checkpoint dequantized here, by a plain loop over the
blocks (transformers' own fp8 loading wants whole blocks; the tiny checkpoint's edge blocks are cut
short, as DeepSeek's kv_a_proj_with_mqa's 576 rows are in blocks of 128)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.colocated import ColocatedLoop
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.models import fp8
from common.models.config import CheckpointError, load_model_config
from common.models.loader import load_model
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy, hf_logits
from tests.test_model_parity import _reserve, _runner

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3], list(range(100, 120))]
NEW = 12
SPEC = fp8.Fp8Spec(block=(16, 24), dtype=torch.float8_e4m3fn)


def reference_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W[i, j] * scale_inv[i // bn, j // bk], one block at a time."""
    out, (bn, bk) = weight.float(), block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale_inv[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_path(checkpoint):
    return checkpoint("deepseek-v3-fp8")


@pytest.fixture(scope="module")
def float_path(fp8_path, tmp_path_factory):
    """The same checkpoint, every fp8 weight dequantized by reference_dequantize, no quantization_config:
    what HF loads as the oracle."""
    out = str(tmp_path_factory.mktemp("deepseek-v3-fp8-dequantized"))
    shutil.copytree(fp8_path, out, dirs_exist_ok=True)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    scales = [n for n in tensors if n.endswith("_scale_inv")]
    assert len(scales) > 50, "the fp8 fixture should quantize every linear projection"
    for name in scales:
        weight = name.removesuffix("_scale_inv")
        assert tensors[weight].dtype == torch.float8_e4m3fn
        tensors[weight] = reference_dequantize(tensors[weight], tensors.pop(name), block)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def test_fixture_is_in_deepseeks_layout(fp8_path):
    tensors = load_file(os.path.join(fp8_path, "model.safetensors"))
    quantized = {n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith("_scale_inv")}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in quantized  # 40 rows: a short edge block
    assert "model.layers.1.mlp.experts.7.down_proj" in quantized and "model.layers.3.self_attn.o_proj" in quantized
    for plain in ("model.embed_tokens", "lm_head", "model.layers.1.mlp.gate", "model.layers.3.eh_proj"):
        assert plain not in quantized and tensors[plain + ".weight"].dtype == torch.float32
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 3)


@pytest.mark.parametrize("shape", [(37, 50), (2, 16, 48), (40, 24)])
def test_dequantize_matches_the_block_loop(shape, monkeypatch):
    """Ragged edges in both directions, experts stacked in front, whole blocks; a band of one block row
    at a time, as a large tensor would go."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(fp8.scale_grid(shape, SPEC.block), generator=g) + 0.01
    want = torch.stack(
        [
            reference_dequantize(w, s, SPEC.block)
            for w, s in zip(weight.reshape(-1, *shape[-2:]), scale.reshape(-1, *scale.shape[-2:]))
        ]
    )
    torch.testing.assert_close(fp8.dequantize(weight, scale, SPEC, torch.float32), want.reshape(shape), rtol=0, atol=0)
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(fp8.dequantize(weight, scale, SPEC, torch.float32), want.reshape(shape), rtol=0, atol=0)
    assert fp8.dequantize(weight, scale, SPEC, torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_agrees_with_transformers_on_whole_blocks():
    """The scale semantics (multiply by scale_inv) as transformers' own fp8 dequantization reads them."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 72, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=g)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)
    torch.testing.assert_close(fp8.dequantize(weight, scale, SPEC, torch.float32), theirs, rtol=0, atol=0)


def test_loaded_weights_equal_the_reference(fp8_path, float_path):
    ours, ref = load_model(fp8_path).checkpoint_tensors(), load_model(float_path).checkpoint_tensors()
    assert ours.keys() == ref.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


def test_runner_matches_hf_on_the_dequantized_checkpoint(fp8_path, float_path):
    runner = _runner(fp8_path)
    rows = [_reserve(runner, len(p)) for p in PROMPTS]
    table = runner.req_to_token_pool.req_to_token
    logits, _ = runner.forward(ForwardBatch.extend(table, rows, [0] * len(PROMPTS), PROMPTS, all_logits=True))
    torch.testing.assert_close(logits, torch.cat([hf_logits(float_path, p) for p in PROMPTS]), atol=1e-4, rtol=1e-4)
    runner = _runner(fp8_path)
    reqs = ColocatedLoop(runner, chunk_size=16).generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for prompt, req in zip(PROMPTS, reqs):
        assert req.output == hf_greedy(float_path, prompt, NEW), f"prompt of length {len(prompt)}"
    assert len({t for r in reqs for t in r.output}) > 4, "degenerate outputs make a weak oracle check"


def test_mtp_layer_is_dequantized_too(fp8_path, float_path):
    from common.models.nextn import load_nextn_head, nextn_layer_config

    with open(os.path.join(fp8_path, "config.json")) as f:
        hf = json.load(f)
    layer_cfg, prefix = nextn_layer_config(hf, fp8_path, load_model_config(fp8_path))
    ours, ref = (load_nextn_head(p, layer_cfg, prefix, "cpu", torch.float32) for p in (fp8_path, float_path))
    ref_tensors = ref.checkpoint_tensors()
    for name, tensor in ours.checkpoint_tensors().items():
        assert torch.equal(tensor, ref_tensors[name]), name


def test_two_ranks_serve_the_dequantized_weights(fp8_path, float_path):
    """TP slices the weights after they are dequantized: both ranks give HF's tokens."""
    from tests.test_moe_tp import _logits_and_tokens
    from tests.tp_harness import run_ranks

    ranks = run_ranks(_logits_and_tokens, 2, fp8_path, 1, PROMPTS[:2], 8)
    want = [hf_greedy(float_path, p, 8) for p in PROMPTS[:2]]
    assert [r["tokens"] for r in ranks] == [want, want]


def test_grpc_pair_serves_hf_tokens(fp8_path, float_path):
    pair = GrpcPair(fp8_path, prefill_kw=dict(max_chunk_bytes=4096))
    try:
        pair.check_against_oracle(float_path, PROMPTS[:2], NEW)
    finally:
        pair.close()


def _with_quant(fp8_path: str, tmp_path, **change) -> str:
    out = str(tmp_path / "ckpt")
    shutil.copytree(fp8_path, out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {**cfg["quantization_config"], **change}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(quant_method="awq"), "quant_method='awq'"),
        (dict(activation_scheme="static"), "activation_scheme='static'"),
        (dict(fmt="e5m2"), "fmt='e5m2'"),
        (dict(weight_block_size=None), "weight_block_size=None"),
    ],
)
def test_unknown_quantization_is_refused_by_name(fp8_path, tmp_path, change, named):
    path = _with_quant(fp8_path, tmp_path, **change)
    with pytest.raises(CheckpointError, match=named):
        load_model_config(path)
    with pytest.raises(CheckpointError, match=named):
        load_model(path, config=load_model_config(fp8_path))


def test_bad_fp8_tensors_are_named(fp8_path, tmp_path):
    cfg = load_model_config(fp8_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    cases = [
        (
            "_scale_inv",
            lambda t: t[:, :2],
            r"o_proj.weight': its weight_scale_inv has shape \(4, 2\), expected \(4, 3\)",
        ),
        ("", lambda t: t.float(), "is torch.float32; an fp8 weight with a scale_inv must be torch.float8_e4m3fn"),
        ("drop", None, "is torch.float8_e4m3fn without a 'model.layers.0.self_attn.o_proj.weight_scale_inv'"),
    ]
    for i, (suffix, edit, message) in enumerate(cases):
        out = str(tmp_path / f"bad{i}")
        shutil.copytree(fp8_path, out)
        tensors = load_file(os.path.join(out, "model.safetensors"))
        if suffix == "drop":
            del tensors[name + "_scale_inv"]
        else:
            tensors[name + suffix] = edit(tensors[name + suffix]).contiguous()
        save_file(tensors, os.path.join(out, "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_model(out, config=cfg)
    plain = _with_quant(fp8_path, tmp_path / "plain")
    with open(os.path.join(plain, "config.json")) as f:
        data = json.load(f)
    del data["quantization_config"]
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(data, f)
    with pytest.raises(CheckpointError, match="has a '.*weight_scale_inv' but config.json has no fp8"):
        load_model(plain)
