"""Sampling: greedy (temperature 0), temperature, top-p (nucleus), seeded per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def problems(self) -> list[str]:
        p = []
        if not self.temperature >= 0:
            p.append(f"temperature must be >= 0, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            p.append(f"top_p must be in (0, 1], found {self.top_p}")
        if self.max_new_tokens < 0:
            p.append(f"max_new_tokens must be >= 0, found {self.max_new_tokens}")
        return p

    def validate(self) -> "SamplingParams":
        p = self.problems()
        if p:
            raise ValueError("invalid sampling parameters: " + "; ".join(p))
        return self


class Sampler:
    """One per request: holds the request's generator so its draws do not depend on other requests."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (any float dtype / device). Returns the chosen token id."""
        logits = logits.detach().to("cpu", torch.float64)
        if not torch.isfinite(logits).all():
            raise FloatingPointError("logits contain NaN or inf; refusing to sample")
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True, stable=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # smallest prefix reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))
