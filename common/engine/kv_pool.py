"""KVPool: per-layer K and V buffers [num_slots + 1, kv_heads, head_dim] (views of one buffer each);
slot 0 is the padding slot that padded lanes write to. Capacity is derived from a byte budget (`slots_for_budget`).

V may be narrower than K (`v_head_dim`). A latent pool (MLA, common/attention/latent.py) is one K
"head" of kv_lora_rank + qk_rope_head_dim per slot and a V of width 0: the value is part of the
latent, so V holds no bytes and every K-and-V path (gather, handoff chunks, writes) carries the
latent alone.
"""

from __future__ import annotations

import torch

from common.forward.host_copy import to_device


def bytes_per_slot(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, v_head_dim: int | None = None
) -> int:
    width = head_dim + (head_dim if v_head_dim is None else v_head_dim)
    return num_layers * num_kv_heads * width * torch.empty(0, dtype=dtype).element_size()


def slots_for_budget(
    budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, v_head_dim=None
) -> int:
    """How many usable KV slots fit in `budget_bytes` (the padding slot included in the budget)."""
    n = budget_bytes // bytes_per_slot(num_layers, num_kv_heads, head_dim, dtype, v_head_dim) - 1
    if n <= 0:
        raise ValueError(f"KV budget of {budget_bytes} bytes holds no slot")
    return n


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


def resolve_kv_dtype(
    choice: str, model_dtype: torch.dtype, device: torch.device, latent: bool, quantized: bool = False
) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype `choice`. bfloat16: a float32 model on CPU keeps K and V rounded to
    bf16 (half the bytes a decode step's attention reads, twice the slots per byte; the attention still
    computes in float32, each value widened exactly). auto: the model's, except that a float32 model on CPU
    whose linears run in a low-precision format (`quantized`: --quantization other than none, never token-exact
    with float32) takes bfloat16: measured, its answers stay as close to float32's and its decode steps are
    ~10% shorter at 16-64 requests (docs/deployment.md). float32: a float32 model's KV in float32 whatever its
    linears."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {choice!r}")
    cpu_gqa = device.type == "cpu" and model_dtype == torch.float32 and not latent
    if choice == "auto":
        return torch.bfloat16 if quantized and cpu_gqa else model_dtype
    if choice == "float32":
        if model_dtype != torch.float32:
            raise ValueError(f"--kv-cache-dtype float32 is for a float32 model, this one runs in {model_dtype}")
        return torch.float32
    if model_dtype == torch.bfloat16:
        return model_dtype
    if not cpu_gqa:
        raise ValueError("--kv-cache-dtype bfloat16 is for a float32 model on CPU with grouped-query attention")
    return torch.bfloat16


GATHER_BYTES = 16 << 20  # gather_many: the largest copy of one index_select


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        allocate=None,
        v_head_dim: int | None = None,
    ):
        """`allocate(shape, dtype) -> (path, tensor)` (CPU): each buffer is a file it makes, which a
        prefill replica on this host maps and writes handoffs into (common/kv_transfer/shm_files.py);
        `files` lists (path, buffer). `v_head_dim`: V's
        width when not head_dim (0: a latent pool)."""
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        v_shape = shape[:-1] + (head_dim if v_head_dim is None else v_head_dim,)
        # one buffer per K and V, each layer a contiguous view: reading a request's slots out of every
        # layer is one index_select (`gather`), not one per layer
        self.files: list[tuple[str, torch.Tensor]] = []
        if allocate is not None:
            if self.device.type != "cpu":
                raise ValueError("KV pool buffers in files are host memory: the pool's device must be the CPU")
            self.files = [allocate(s, dtype) for s in (shape, v_shape) if s[-1]]
            self.k_all = self.files[0][1]
            self.v_all = self.files[1][1] if len(self.files) > 1 else torch.zeros(v_shape, dtype=dtype)
        else:
            self.k_all = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v_all = torch.zeros(v_shape, dtype=dtype, device=self.device)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))

    def write_layers(self, layer_start: int, loc: torch.Tensor, k, v) -> None:
        """write() for consecutive layers from layer_start, from host or device tensors: K and V each
        [layers, len(loc), kv_heads, head_dim] (or a list of per-layer tensors, stacked here), moved
        once, then one index_copy_ into the buffer (a handoff chunk's many small per-layer writes cost
        a dispatch each, and on CUDA a copy each)."""
        n = len(k)
        for whole, parts in ((self.k_all, k), (self.v_all, v)):
            stacked = parts if isinstance(parts, torch.Tensor) else torch.stack(parts)
            stacked = to_device(stacked, self.device, self.dtype)  # one host-to-device copy
            whole[layer_start : layer_start + n].index_copy_(1, loc, stacked)

    def gather(self, loc: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of KV slots `loc` in every layer (copies): ([layers] of [len(loc), kv_heads, head_dim]) x 2."""
        return list(self.k_all.index_select(1, loc).unbind(0)), list(self.v_all.index_select(1, loc).unbind(0))

    def gather_many(self, locs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """gather() for several requests at once: per request (K, V), each [layers, len(loc), kv_heads,
        head_dim], contiguous (request-major views into a shared copy). One index_select per K and V
        for as many requests as fill GATHER_BYTES, not one per request: each is a parallel region,
        and on a host shared with another service each region waited for a core. The bound keeps
        each copy in glibc's heap, reused from one step to the next: a copy above glibc's mmap
        threshold (32 MiB at most) is fresh pages every time, and faulting them in took 3/4 of the
        time of 63 prompts' 72 MiB (23 ms against 6 ms in 16 MiB groups). A group's copy lives as long
        as any of its requests' views: a slow stream keeps its group's other KV (at most 16 MiB)."""
        layers, slots, *rest = self.k_all.shape
        per_layer = torch.arange(layers, device=self.device)[:, None] * slots
        token_bytes = layers * self.k_all[0, 0].numel() * self.k_all.element_size()  # V's copy is no larger
        groups: list[list[torch.Tensor]] = []
        size = 0
        for loc in locs:
            if not groups or size + len(loc) * token_bytes > GATHER_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(loc)
            size += len(loc) * token_bytes
        out = []
        for group in groups:
            index = torch.cat([(per_layer + to_device(loc, self.device)[None, :]).reshape(-1) for loc in group])
            k, v = (whole.flatten(0, 1).index_select(0, index) for whole in (self.k_all, self.v_all))
            start = 0
            for loc in group:
                n, shape = layers * len(loc), (layers, len(loc))
                out.append((k[start : start + n].view(*shape, *rest), v[start : start + n].view(*shape, *v.shape[1:])))
                start += n
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at KV slots `loc` [T] (index_copy_: ~10x cheaper than an
        indexed assignment on CPU; padded lanes may all write the padding slot 0, never read)."""
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k[layer].index_copy_(0, loc, k)
        self.v[layer].index_copy_(0, loc, v)
