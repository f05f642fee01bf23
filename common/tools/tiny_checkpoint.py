"""Build tiny random-weight checkpoints (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3) with a real
tokenizer, offline.

Deterministic: the same arguments give byte-identical folders. The tokenizer is a byte-level BPE
trained with `tokenizers` on the local corpus below, saved so AutoTokenizer loads it, with BOS/EOS
ids in the configs and a chat template. Weights are redrawn from a seeded generator so every tensor
(biases and norms included) is non-trivial, and the lm_head is scaled so greedy choices are not
decided by float noise.

    python -m common.tools.tiny_checkpoint --arch qwen3 --out /tmp/tiny-qwen3 [--tied] [--shard-bytes N]

`mtp` (DeepSeek-V3 only) also writes a random MTP (NextN) layer where DeepSeek keeps it (tiny_mtp.py).
`fp8_block` (DeepSeek-V3 only, `--fp8-block 16,24`) saves it in DeepSeek's block-quantized fp8 layout
(`write_fp8`; blocks small enough that the tiny shapes have ragged edge blocks).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

# deepseek_v3_nolora: no q_lora_rank (as V2-Lite), the rope not interleaved and not scaled, biases
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_nolora")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = """\
The prefill service reads the whole prompt at once and writes its keys and values into the cache.
The decode service then produces one token at a time, reading every earlier key and value again.
A scheduler decides which requests run together; while the device computes one step, the host
prepares the next. Speculative decoding lets a small draft model guess several tokens ahead, and
the large model checks all of the guesses in a single forward pass. Accepted tokens are kept and
the first rejected guess is replaced by the large model's own choice.
Once upon a time a small robot learned to count: one, two, three, four, five, six, seven, eight,
nine, ten. It counted stars at night and grains of sand by day, 1 2 3 4 5 6 7 8 9 0, and wrote the
numbers into a little notebook. "Why do you count?" asked the owl. "Because every number has a next
one," said the robot, "and I want to see where they end." The owl laughed, for they never end.
Engineers who run inference in production care about latency, throughput, memory and correctness.
They measure the time to the first token, the time between tokens, and how many requests per
second a server can hold before the queue grows without bound. Hello, world! How are you today?
I am fine, thank you. What is the capital of France? Paris is the capital of France.
def add(a, b):\n    return a + b\nfor i in range(10):\n    print(add(i, i * 2))
"""


def build_tokenizer(out_dir: str, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def hf_config(arch: str, vocab_size: int, bos: int, eos: int, tied: bool, hidden_size: int = 64, num_layers: int = 2):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=0,
    )
    if arch == "llama":  # llama3-style rope scaling and biases on q/k/v and o_proj
        return LlamaConfig(
            **common,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":  # q/k/v bias only
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch != "qwen3":
        return moe_config(arch, common)
    # qwen3: explicit head_dim (not hidden/heads) and q/k norm
    return Qwen3Config(**common, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def moe_config(arch: str, common: dict):
    """Qwen3-MoE (8 experts, top 2, a dense layer among sparse ones) or DeepSeek-V3 (MLA; 8 routed
    experts in 4 groups, top 3 of the best 2 groups, a shared expert, the first layer dense)."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    common = {**common, "intermediate_size": 2 * common["hidden_size"], "moe_intermediate_size": 32}
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **{**common, "num_hidden_layers": max(common["num_hidden_layers"], 3)},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    lora = arch == "deepseek_v3"
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if lora:  # YaRN with both mscales: cos/sin and the softmax scale are both scaled
        rope = {**rope, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
        rope.update(mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
    return DeepseekV3Config(
        **{**common, "num_hidden_layers": max(common["num_hidden_layers"], 3), "num_key_value_heads": 4},
        q_lora_rank=32 if lora else None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_interleave=lora,
        attention_bias=not lora,
        rope_parameters=rope,
    )


def randomize(model: torch.nn.Module, seed: int, lm_head_scale: float) -> None:
    """Redraw every parameter from a seeded generator; scale the output projection."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.dim() in (2, 3) and "embed_tokens" not in name and "lm_head" not in name:
                p.copy_(noise / p.shape[-1] ** 0.5)  # 3: stacked experts [E, out, in]
            else:  # embeddings / lm_head: logits of std ~lm_head_scale
                p.copy_(noise * lm_head_scale / hidden**0.5)
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias (a saved buffer)
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build(
    out_dir: str,
    arch: str = "llama",
    tied: bool = False,
    shard_bytes: int | None = None,
    seed: int = 0,
    lm_head_scale: float = 4.0,
    hidden_size: int = 64,
    num_layers: int = 2,
    mtp: bool = False,
    fp8_block: tuple[int, int] | None = None,
) -> str:
    """Write a tiny checkpoint + tokenizer into `out_dir` and return its absolute path."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    if mtp and not arch.startswith("deepseek_v3"):
        raise ValueError("an MTP layer is DeepSeek-V3's (--arch deepseek_v3 / deepseek_v3_nolora)")
    if fp8_block and not arch.startswith("deepseek_v3"):
        raise ValueError("the block-quantized fp8 layout is DeepSeek-V3's (--arch deepseek_v3 / deepseek_v3_nolora)")
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(out_dir)
    bos, eos = tok.convert_tokens_to_ids("<s>"), tok.convert_tokens_to_ids("</s>")
    config = hf_config(arch, len(tok), bos, eos, tied, hidden_size, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed, lm_head_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=[eos, tok.convert_tokens_to_ids("<|im_end|>")], pad_token_id=0
    )
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(out_dir, **kwargs)
    if mtp:
        from common.tools.tiny_mtp import mtp_tensors, write_mtp

        write_mtp(out_dir, mtp_tensors(model, seed + 7))
    if fp8_block:
        write_fp8(out_dir, fp8_block)
    return os.path.abspath(out_dir)


def fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether DeepSeek's published fp8 checkpoints quantize this tensor: the decoder layers' linear
    projections (attention, dense MLP, routed and shared experts), the MTP layer's included; not the
    embeddings, norms, router (`mlp.gate`), lm_head, nor the MTP layer's eh_proj / shared_head."""
    if not (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2):
        return False
    return (
        "norm" not in name
        and not name.endswith("mlp.gate.weight")
        and "eh_proj" not in name
        and all(part not in name for part in ("shared_head", "embed_tokens"))
    )


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block) with weight ~ fp8 * scale_inv; the edge
    blocks of a shape that is not a multiple of the block are the cut-short ones."""
    (rows, cols), (bn, bk) = weight.shape, block
    grid = (-(-rows // bn), -(-cols // bk))
    padded = torch.zeros(grid[0] * bn, grid[1] * bk)
    padded[:rows, :cols] = weight.float()
    blocks = padded.reshape(grid[0], bn, grid[1], bk)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    quantized = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)
    return quantized[:rows, :cols].contiguous(), scale_inv.contiguous()


def write_fp8(out_dir: str, block: tuple[int, int]) -> None:
    """Rewrite the checkpoint in DeepSeek-V3's fp8 layout: each quantized `W` as float8_e4m3fn with
    its `W_scale_inv` beside it (in its shard; the index updated), and config.json's
    quantization_config as DeepSeek publishes it, with `block` as weight_block_size."""
    from safetensors.torch import load_file, save_file

    index = os.path.join(out_dir, "model.safetensors.index.json")
    data = None
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
    files = sorted(set(data["weight_map"].values())) if data else ["model.safetensors"]
    for file in files:
        tensors = load_file(os.path.join(out_dir, file))
        for name in [n for n in sorted(tensors) if fp8_quantized(n, tensors[n])]:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensors[name], block)
            if data:
                data["weight_map"][name + "_scale_inv"] = file
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
    if data:
        with open(index, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
    config = os.path.join(out_dir, "config.json")
    with open(config) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    with open(config, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tied", action="store_true", help="tie lm_head to the embeddings")
    parser.add_argument("--shard-bytes", type=int, default=None, help="write a sharded checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64, help="bigger models for benchmarks")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--mtp", action="store_true", help="DeepSeek-V3: add a random MTP (NextN) layer")
    parser.add_argument(
        "--fp8-block", default=None, help="DeepSeek-V3: save in the block-quantized fp8 layout, blocks ROWS,COLS"
    )
    args = parser.parse_args(argv)
    path = build(
        args.out,
        args.arch,
        args.tied,
        args.shard_bytes,
        args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        mtp=args.mtp,
        fp8_block=tuple(int(b) for b in args.fp8_block.split(",")) if args.fp8_block else None,
    )
    print(f"built tiny {args.arch} checkpoint at {path}")


if __name__ == "__main__":
    main()
