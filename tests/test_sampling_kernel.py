"""Device sampling kernel (codegen/triton/sampling.py) vs the semantics of k31c/runtime/sampling.py:
greedy argmax, the top-p nucleus (stable sort, mass strictly before < top_p), an inverse-CDF draw with
the caller's uniform, and the resulting distribution. CPU: Triton interpreter, fp32, tiny shapes."""

from __future__ import annotations

import pytest
import torch

from codegen.triton.sampling import sample_tokens


def _nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The runtime's (k31c/runtime/sampling.py) sampling distribution, in float64."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return probs


def _inverse_cdf(probs: torch.Tensor, u: float) -> tuple[float, float, int]:
    """(cdf before, cdf through, index) of the token an inverse-CDF draw at u * total picks."""
    cum = torch.cumsum(probs, 0)
    j = int(((cum > u * cum[-1]) & (probs > 0)).nonzero()[0])
    return float(cum[j] - probs[j]) / float(cum[-1]), float(cum[j]) / float(cum[-1]), j


def test_greedy_rows_take_the_first_maximum():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 300, generator=g) * 4
    logits[1, 17] = logits[1, 200] = logits[1].max() + 1.0  # a tie: the lower index wins
    ids = sample_tokens(logits, torch.zeros(3), torch.ones(3), torch.rand(3, generator=g), block_v=128)
    assert ids.tolist() == [int(logits[0].argmax()), 17, int(logits[2].argmax())]


def test_temperature_top_p_rows_follow_the_runtime_rule():
    g = torch.Generator().manual_seed(1)
    R, V = 6, 256
    logits = torch.randn(R, V, generator=g) * 3
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1e-6, 0.95, 0.3])
    u = torch.rand(R, generator=g)
    ids = sample_tokens(logits, temp, top_p, u)
    for r in range(R):
        probs = _nucleus_probs(logits[r], float(temp[r]), float(top_p[r]))
        lo, hi, j = _inverse_cdf(probs, float(u[r]))
        got = int(ids[r])
        assert probs[got] > 0, f"row {r}: token {got} is outside the nucleus"
        # equal, unless the draw point sits within fp32 rounding of a CDF step
        assert got == j or min(abs(float(u[r]) - lo), abs(float(u[r]) - hi)) < 1e-5, (r, got, j)
    assert int(ids[3]) == int(logits[3].argmax()), "top_p -> 0 keeps only the most likely token"


def test_draws_have_the_runtime_distribution():
    g = torch.Generator().manual_seed(2)
    V = 64
    row = torch.randn(V, generator=g) * 2
    for top_p, N in ((1.0, 48), (0.8, 24)):  # the interpreter costs ~50-200 ms per row: few rows
        u = (torch.arange(N, dtype=torch.float64) + 0.5) / N  # a uniform grid: counts / N = the CDF steps
        ids = sample_tokens(row.expand(N, V).contiguous(), torch.full((N,), 0.8), torch.full((N,), top_p), u.float())
        freq = torch.bincount(ids, minlength=V).double() / N
        probs = _nucleus_probs(row, 0.8, top_p)
        probs = probs / probs.sum()
        assert (freq[probs == 0] == 0).all(), "a token outside the nucleus was drawn"
        assert (freq - probs).abs().max() <= 1.0 / N + 1e-9, f"top_p={top_p}: frequencies deviate from the nucleus"


def test_ties_at_the_nucleus_cutoff_keep_lower_indices():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, -9.0, -9.0, -9.0]])
    probs = torch.softmax(logits[0].double(), 0)
    top_p = float(probs[0] + 1.5 * probs[1])  # the nucleus is {0, 1, 2}: two of the four ties
    for u, want in ((0.0, 0), (0.999, 2)):
        got = sample_tokens(logits, torch.ones(1), torch.tensor([top_p]), torch.tensor([u]))
        assert int(got) == want, (u, int(got))


def test_bad_input():
    logits = torch.randn(2, 16)
    logits[1, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="rows \\[1\\]"):
        sample_tokens(logits, torch.ones(2), torch.ones(2), torch.full((2,), 0.5))
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens(torch.randn(1, 4), torch.ones(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="must be \\[2\\]"):
        sample_tokens(torch.randn(2, 4), torch.ones(3), torch.ones(2), torch.zeros(2))
