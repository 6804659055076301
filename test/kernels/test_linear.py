"""The C linear layer (sgl_kernel_ext.linear) against a float64 matmul written out here:
every tile shape the kernel has (rows 1 to ROWS_MAX against 1 to 3 weight rows, one row
against 1 to 6, a shared dimension with and without a tail past 8), a bias, rows that are
views of a wider tensor, an output written in place; each row's result the same bit for bit
whatever rows sit beside it and however many threads run; and what it does not take
refused, nothing written."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_ext import native
from sgl_kernel_ext.linear import ROWS_MAX, linear

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: linear returns None")


def reference(x, weight, bias=None):
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, ROWS_MAX])
@pytest.mark.parametrize("n, k", [(1, 1), (2, 8), (3, 9), (7, 23), (11, 40), (64, 576)])
def test_linear_matches_a_float64_matmul(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(linear(x, w), reference(x, w), rtol=1e-5, atol=1e-5 * k**0.5)
    torch.testing.assert_close(linear(x, w, b), reference(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


def test_linear_reads_strided_rows_and_writes_into_out():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 3 * 40, generator=g)
    x = wide[:, 40:80]  # a view: row stride 120
    w = torch.randn(11, 40, generator=g)
    out_wide = torch.full((6, 30), 7.0)
    out = out_wide[:, 5:16]
    got = linear(x, w, out=out)
    assert got is out
    torch.testing.assert_close(out, reference(x, w), rtol=1e-5, atol=1e-5)
    assert (out_wide[:, :5] == 7).all() and (out_wide[:, 16:] == 7).all()  # nothing outside out


def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(ROWS_MAX, 100, generator=g), torch.randn(37, 100, generator=g)
    full = linear(x, w)
    for r in range(ROWS_MAX):
        assert torch.equal(linear(x[r : r + 1], w)[0], full[r])
        assert torch.equal(linear(x[r:], w)[0], full[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(linear(x, w), full)
    finally:
        torch.set_num_threads(threads)


def test_linear_refuses_what_it_does_not_take_and_writes_nothing():
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    out = torch.zeros(2, 4)
    assert linear(torch.randn(ROWS_MAX + 1, 16), w) is None  # a prefill's rows: torch's GEMM
    assert linear(x.double(), w.double()) is None
    assert linear(x.bfloat16(), w.bfloat16()) is None
    assert linear(x, torch.randn(16, 4).T) is None  # a weight that is a transposed view
    assert linear(x, torch.randn(4, 15)) is None  # shapes that do not meet
    assert linear(torch.randn(1, 16).expand(2, 16), w) is None  # rows that overlap
    assert linear(x, w, bias=torch.randn(5)) is None
    assert linear(x, w, out=torch.zeros(2, 5)) is None
    assert linear(x, w, out=torch.zeros(4, 2).T) is None  # an output whose rows are not contiguous
    assert linear(x, w, out=out.double()) is None
    assert (out == 0).all()
