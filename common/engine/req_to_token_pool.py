"""ReqToTokenPool: the int32 table [req_pool_size + 1, max_context] mapping (request slot, position)
to the KV slot holding that token. Row 0 is padding; a request keeps its row (`req_pool_idx`,
1..req_pool_size) from admission to release.
"""

from __future__ import annotations

import torch

from common.engine.slot_allocator import SlotAllocator
from common.forward.host_copy import to_device


class ReqToTokenPool:
    def __init__(self, size: int, max_context: int, device: torch.device | str = "cpu"):
        self.size = size
        self.max_context = max_context
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size + 1, max_context), dtype=torch.int32, device=self.device)
        self.allocator = SlotAllocator(size, name="request slots")

    def alloc(self) -> int:
        return int(self.allocator.alloc(1)[0])

    def free(self, req_pool_idx: int) -> None:
        self.allocator.free([req_pool_idx])

    def write(self, req_pool_idx: int, start: int, kv_slots: torch.Tensor) -> None:
        """Map positions start.. of the row to `kv_slots`."""
        end = start + kv_slots.numel()
        if end > self.max_context:
            raise ValueError(
                f"request slot {req_pool_idx}: positions up to {end} exceed max_context {self.max_context}"
            )
        self.req_to_token[req_pool_idx, start:end] = to_device(kv_slots, self.device, torch.int32)

    def slots(self, req_pool_idx: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[req_pool_idx, start:end].to(torch.int64)
