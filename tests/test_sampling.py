"""Sampling: greedy = argmax, seeded reproducibility, top-p truncation, temperature, bad params."""

from __future__ import annotations

import pytest
import torch

from k31c.runtime.sampling import Sampler, SamplingParams
from k31c.runtime.tokenizer import ByteTokenizer


def _logits(seed, n=64):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    for seed in range(5):
        lg = _logits(seed)
        assert Sampler(SamplingParams()).sample(lg) == int(lg.argmax())


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    lg = _logits(1)

    def draws(seed):
        smp = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [smp.sample(lg) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_p_keeps_the_smallest_nucleus():
    lg = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0], dtype=torch.float64)
    p = torch.softmax(lg, 0)
    assert p[0] < 0.9 < p[0] + p[1]  # nucleus at 0.9 is tokens {0, 1}
    smp = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=0))
    seen = {smp.sample(lg) for _ in range(400)}
    assert seen == {0, 1}
    smp = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert {smp.sample(lg) for _ in range(50)} == {0}


def test_temperature_frequencies_match_softmax():
    lg = torch.tensor([1.0, 0.0, -1.0])
    smp = Sampler(SamplingParams(temperature=2.0, seed=5))
    n = 6000
    counts = torch.bincount(torch.tensor([smp.sample(lg) for _ in range(n)]), minlength=3).double() / n
    expected = torch.softmax(lg.double() / 2.0, 0)
    assert (counts - expected).abs().max() < 0.03


def test_invalid_params_and_nan_logits():
    with pytest.raises(ValueError) as e:
        Sampler(SamplingParams(temperature=-1, top_p=0.0))
    assert "temperature" in str(e.value) and "top_p" in str(e.value)
    with pytest.raises(FloatingPointError):
        Sampler(SamplingParams()).sample(torch.tensor([0.0, float("nan")]))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(512)
    text = "Kimi K3 — ünïcödé"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([72, 300, 105]) == "H<300>i"
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        ByteTokenizer(100)
