"""common.model.llama.linear: F.linear's answer for every row count, whichever way it computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.llama import FEW_ROWS, linear


@pytest.mark.parametrize("rows", [1, 2, 7, FEW_ROWS, FEW_ROWS + 1, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    got, want = linear(x, w, b), F.linear(x, w, b)
    assert got.shape == (rows, 160) and got.is_contiguous()
    # another summation order for 1..FEW_ROWS rows: equal up to rounding, never compared bit for bit
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_few_rows_take_the_weight_first_product() -> None:
    """The path is the transposed product for 1..FEW_ROWS fp32 rows: its result is exactly that of
    torch.mm(weight, x.T).T (one row: sent as two, the first column kept), and a bf16 input keeps
    F.linear's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=g), torch.randn(48, 64, generator=g)
    assert torch.equal(linear(x, w), torch.mm(w, x.t()).t())  # the same computation, so bit for bit
    one = x[:1]
    assert torch.equal(linear(one, w), torch.mm(w, torch.cat((one, one)).t()).t()[:1])
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))
