"""The CPU fp32 linear layouts (common/models/packed_linear.py) against F.linear: the row-block GEMV
path (up to GEMV_MAX_ROWS rows) and the oneDNN-packed GEMM path, with bias and a fused residual."""

import pytest
import torch
import torch.nn.functional as F

from common.models import packed_linear
from common.models.packed_linear import GEMV_MAX_ROWS, LinearWeight

pytestmark = pytest.mark.skipif(
    not packed_linear.available(torch.device("cpu"), torch.float32), reason="needs oneDNN on CPU"
)


@pytest.mark.parametrize("out_features", [96, 100, 37])  # 8, 4 and 1 row blocks
@pytest.mark.parametrize("bias", [False, True])
def test_both_layouts_equal_f_linear(out_features, bias):
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 48, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    lin = LinearWeight(w, b)
    for rows in (1, 2, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 17):
        for shape in ((rows, 48), (1, rows, 48)):
            x = torch.randn(shape, generator=gen)
            residual = torch.randn(shape[:-1] + (out_features,), generator=gen)
            want = F.linear(x, w, b)
            got = lin(x)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lin(x, residual), residual + want, atol=1e-5, rtol=1e-5)


def test_blocks_view_the_weight_and_stay_put():
    """The GEMV layout is a view of the plain weight (no copy); the weight is detached."""
    w = torch.randn(64, 16, requires_grad=True)
    lin = LinearWeight(w)
    assert lin.blocks.shape == (8, 8, 16) and lin.blocks.data_ptr() == w.data_ptr()
    assert not lin(torch.randn(1, 16)).requires_grad
