"""common.model.llama.linear: F.linear's answer for every row count, whichever way it computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.llama import FEW_ROWS, _columns, linear


@pytest.mark.parametrize("rows", [1, 2, 7, 13, 23, FEW_ROWS, FEW_ROWS + 1, 100])
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
    """The path is the transposed product for 1..FEW_ROWS fp32 rows, over the column count _columns
    picks: its result is exactly that of torch.mm(weight, cols.T).T for those columns (one row: sent
    as two; 7..32 rows: zero rows added), and a bf16 input keeps F.linear's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    pairs = ((1, 2), (5, 5), (6, 6), (7, 16), (13, 16), (16, 16), (17, 24), (23, 24), (25, 32), (32, 32))
    for rows, cols in pairs:
        assert _columns(rows) == cols
        xs = x[:rows]
        sent = torch.cat((xs, xs)) if rows == 1 else torch.cat((xs, xs.new_zeros(cols - rows, 64)))
        got = linear(xs, w)
        assert got.is_contiguous()
        assert torch.equal(got, torch.mm(w, sent.t()).t()[:rows]), rows  # the same computation: bit for bit
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))
