"""The CUDA GEMV (common/models/cuda_gemv.py) on CPU under Triton's interpreter, fp32: the kernel
against F.linear for every config, ragged shapes, with and without bias; the per-shape plan that
`tune` builds from a timer (tests hand in their own) and the forward's dispatch by row count."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("triton", reason="the triton package is a dev dependency (.ci/setup installs it)")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="CPU runs need TRITON_INTERPRET=1 before triton loads (tests/conftest.py sets it)",
)
cuda_gemv = pytest.importorskip("common.models.cuda_gemv")


@pytest.mark.parametrize("config", list(cuda_gemv.CONFIGS))
@pytest.mark.parametrize("rows,bias", [(1, False), (3, True), (16, False), (5, True)])
def test_gemv_matches_f_linear(config, rows, bias):
    g = torch.Generator().manual_seed(rows)
    n, k = 72, 600  # neither a multiple of the row blocks nor of the K steps
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k + 3, generator=g)[:, :k]  # rows with a stride of their own
    torch.testing.assert_close(cuda_gemv.gemv(x, w, b, config), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 48, bias=False), nn.Linear(64, 48, bias=False)  # one shape
        self.c = nn.Linear(48, 64, bias=True)  # another


def test_tune_gives_each_shape_one_plan_and_the_forward_follows_it():
    torch.manual_seed(0)
    block = _Block()
    ref = {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
           for name, m in block.named_children()}  # fmt: skip
    assert cuda_gemv.wrap(block) == 3
    timed = []

    def timer(fn, choice, rows):  # the GEMV (gemv32) fastest up to 2 rows, cuBLAS from 4
        timed.append(choice)
        return {None: 10.0, "gemv32": 5.0 if rows <= 2 else 20.0}.get(choice, 15.0)

    found = cuda_gemv.tune(block, timer=timer)
    assert len(found) == 2 and len(timed) == 2 * len(cuda_gemv.BUCKETS) * (1 + len(cuda_gemv.CONFIGS))
    assert block.a.plan is block.b.plan and block.a.plan == {1: "gemv32", 2: "gemv32", 4: None, 8: None, 16: None}
    calls = []
    kernel = cuda_gemv.gemv
    cuda_gemv.gemv = lambda *a: calls.append(a[-1]) or kernel(*a)
    try:
        for rows, via_gemv in ((1, True), (2, True), (3, False), (17, False)):
            x = torch.randn(rows, 48)
            before = len(calls)
            torch.testing.assert_close(block.c(x), F.linear(x, *ref["c"]), atol=1e-4, rtol=1e-5)
            assert (len(calls) > before) == via_gemv, rows
    finally:
        cuda_gemv.gemv = kernel
