"""KV on demand on CUDA (issue 55): rows grown a few slots at a time (the block table extended on the
stream) and requests retracted mid-answer, re-prefilled and resumed, stay token-exact against HF in
every decode mode the GPU serves: eager, and EAGLE3 tree with Triton attention replayed from CUDA graphs
(a grown row changes no captured shape). Closing the pair checks every slot was freed once."""

from __future__ import annotations

import pytest

from common.engine.draft_runner import SpecArgs
from common.engine.sampling import SamplingParams
from common.tools.eagle_checkpoint import build as build_head
from tests.oracle import hf_greedy
from tests.test_retraction import PROMPTS, N, _run


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "tree-graphs"])
def test_retraction_on_cuda_matches_hf(checkpoint, tmp_path, mode):
    path = checkpoint("llama")
    kw = dict(device="cuda", dtype="float32")
    if mode == "tree-graphs":
        head = build_head(path, "EAGLE3", str(tmp_path / "head"))
        kw.update(spec=SpecArgs("EAGLE3", head, 3, 2, 6), attention_backend="triton", cuda_graph=True)
    pair = _run(path, [SamplingParams(max_new_tokens=N, ignore_eos=True)] * 3, retract=True, **kw)
    for i in range(3):
        assert pair.out.tokens[str(i)] == hf_greedy(path, PROMPTS[i], N), i
