"""The draft head's forward against a plain re-implementation written here (a few lines of torch over
the head's safetensors, in the public layout's names), fed with the HF target's own features: the
prefill's draft extend over a chunked prompt (position p reads token p+1 and the target's features
at p; the last position reads the first sampled token) must give the reference's draft KV, the
head's hidden at the last position and its top-k (ids and probabilities) -- the draft seed.

EAGLE: x = fc([embed(token); final normed hidden]); h = x + attn(x); y = h + mlp(norm(h)); logits
from the target's lm_head. EAGLE3: c = fc([3 captured layer outputs]); h = c + attn([norm(embed);
norm(c)]); y = h + mlp(norm(h)); logits = lm_head(norm(y)) over the draft vocabulary, id = j + d2t[j].
Rotary as the target's (HF's own rotary module), the head's layer shares the target's rope.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from common.engine.draft_runner import SpecArgs
from common.engine.handoff import HandoffRequest
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from prefill_service.worker import PrefillWorker
from tests.oracle import hf_model
from tests.test_eagle import chat_prompts

TOPK = 4


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, cos, sin):  # x [T, heads, d]; HF's rotate_half convention
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def _layer(w, pre, x_attn, residual, cfg, cos, sin):
    """One decoder layer (attention input `x_attn`, residual stream `residual`) -> (output, rotated K)."""
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = x_attn.shape[0]

    def proj(name, x):
        b = w.get(f"{pre}self_attn.{name}.bias")
        return F.linear(x, w[f"{pre}self_attn.{name}.weight"], b)

    q = _rotate(proj("q_proj", x_attn).view(t, heads, d), cos, sin)
    k = _rotate(proj("k_proj", x_attn).view(t, kv_heads, d), cos, sin)
    v = proj("v_proj", x_attn).view(t, kv_heads, d)
    kk, vv = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))
    scores = torch.einsum("thd,shd->hts", q, kk) * d**-0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), vv).reshape(t, heads * d)
    h = residual + proj("o_proj", attn)
    m = _rms(h, w[f"{pre}post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    gate, up = F.linear(m, w[f"{pre}mlp.gate_proj.weight"]), F.linear(m, w[f"{pre}mlp.up_proj.weight"])
    return h + F.linear(F.silu(gate) * up, w[f"{pre}mlp.down_proj.weight"]), k


@torch.inference_mode()
def reference(target: str, head: str, algorithm: str, ids: list[int]):
    """(draft K [T, kv_heads, d], head hidden [T, H], logits over the target vocabulary [T, V]) of the
    draft extend over `ids` (the prompt then the first token), from HF's target features."""
    model = hf_model(target)
    cfg, w = json.load(open(f"{head}/config.json")), load_file(f"{head}/model.safetensors")
    captured = {}
    hooks = [model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("final", o[0]))]
    for i, layer in enumerate(model.model.layers):
        out = lambda i: lambda m, inp, o: captured.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0])  # noqa: E731
        hooks.append(layer.register_forward_hook(out(i)))
    try:
        model(torch.tensor([ids[:-1]]))
    finally:
        for h in hooks:
            h.remove()
    positions = torch.arange(len(ids) - 1)
    embed = model.model.embed_tokens.weight[torch.tensor(ids[1:])]
    cos, sin = (z[0] for z in model.model.rotary_emb(embed[None], positions[None]))
    eps = cfg["rms_norm_eps"]
    if algorithm == "EAGLE":
        x = F.linear(torch.cat([embed, captured["final"]], -1), w["fc.weight"], w["fc.bias"])
        y, k = _layer(w, "layers.0.", x, x, cfg, cos, sin)
        return k, y, F.linear(y, model.lm_head.weight)
    aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    c = F.linear(torch.cat([captured[i] for i in aux], -1), w["fc.weight"])
    pre = "midlayer." if any(name.startswith("midlayer.") for name in w) else "layers.0."
    x = torch.cat(
        [_rms(embed, w[f"{pre}input_layernorm.weight"], eps), _rms(c, w[f"{pre}hidden_norm.weight"], eps)], -1
    )
    y, k = _layer(w, pre, x, c, cfg, cos, sin)
    draft = F.linear(_rms(y, w["norm.weight"], eps), w["lm_head.weight"])
    full = torch.full((len(ids) - 1, model.config.vocab_size), float("-inf"))
    full[:, torch.arange(draft.shape[1]) + w["d2t"]] = draft
    return k, y, full


@pytest.mark.parametrize("arch,algorithm", [("llama", "EAGLE"), ("llama", "EAGLE3"), ("qwen3", "EAGLE3")])
def test_prefill_draft_seed_matches_a_plain_reimplementation(checkpoint, fitted_head, arch, algorithm):
    target = checkpoint(arch)
    head = fitted_head(arch, algorithm)
    spec = SpecArgs(algorithm, head, 3, TOPK, 8)
    runner = ModelRunner(RunnerArgs(target, max_total_tokens=256, max_running_requests=2, spec=spec))
    worker = PrefillWorker(runner, chunk_size=16)  # the prompt's draft extend runs over several chunks
    prompt = chat_prompts(target, 1)[0]
    assert len(prompt) > 2 * 16
    (handoff,) = worker.prefill([HandoffRequest("r", prompt, SamplingParams(max_new_tokens=4), 0)])
    ref_k, ref_hidden, ref_logits = reference(target, head, algorithm, prompt + [handoff.first_token])
    torch.testing.assert_close(handoff.draft_k[0].float(), ref_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(handoff.draft_hidden.float().reshape(-1), ref_hidden[-1], rtol=1e-4, atol=1e-4)
    probs, ids = ref_logits[-1].softmax(-1).topk(TOPK)
    assert handoff.draft_topk_ids.reshape(-1).tolist() == ids.tolist()
    torch.testing.assert_close(handoff.draft_topk_p.float().reshape(-1), probs, rtol=1e-4, atol=1e-5)
