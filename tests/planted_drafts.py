"""Drafts planted from a reference output (decode_service/hooks.py): what a test verifies in place of the
draft head's, so acceptance is a property of the code, not of a head's fit. Plain data and top-level
classes: the hooks travel to a TP decode's follower ranks through the spawn pipe, and every rank plants
alike from the same batch. `refs` maps a client request id (the part of the internal id before '#',
decode_service/server.py) to the output to draft; past its end, token 0."""

from __future__ import annotations

import torch

from decode_service.hooks import DecodeHooks


def _ref(refs: dict, rid: str) -> list[int]:
    return refs[rid.partition("#")[0]]


class PlantChain(DecodeHooks):
    """EAGLE chain: each lane's drafts are `refs[rid]` from the token after the pending bonus on."""

    def __init__(self, refs: dict):
        self.refs = refs

    def propose(self, lanes, committed_lens, drafts):
        out = drafts.clone()
        for lane, ((rid, prompt_len), n) in enumerate(zip(lanes, committed_lens)):
            ref, pos = _ref(self.refs, rid), n - prompt_len  # output index of the pending bonus token
            for k in range(drafts.shape[1]):
                out[lane, k] = ref[pos + 1 + k] if pos + 1 + k < len(ref) else 0
        return out


class PlantTree(DecodeHooks):
    """EAGLE tree: `refs[rid]`'s continuation on the path root -> last child -> ..., other nodes token 0."""

    def __init__(self, refs: dict):
        self.refs = refs

    def propose_tree(self, lanes, committed_lens, tokens, parent, depth):
        out = torch.zeros_like(tokens)
        out[:, 0] = tokens[:, 0]
        for lane, ((rid, prompt_len), n) in enumerate(zip(lanes, committed_lens)):
            ref, pos, node = _ref(self.refs, rid), n - prompt_len, 0
            while kids := [i for i in range(1, tokens.shape[1]) if int(parent[lane, i]) == node]:
                node = kids[-1]
                d = pos + int(depth[lane, node])
                out[lane, node] = ref[d] if d < len(ref) else 0
        return out
