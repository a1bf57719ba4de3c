"""The model written once (build.py), its configuration and presets, parameters and checkpoints."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .config import ConfigError, ModelConfig
from .presets import PRESETS, get_preset


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict
    source: str  # "preset k31-tiny (random weights, seed 0)" or the checkpoint path


def load_model(spec: str, seed: int = 0) -> LoadedModel:
    """`spec` is a checkpoint directory or a preset name (random weights, seeded)."""
    if os.path.isdir(spec):
        from .checkpoint import load_checkpoint

        ck = load_checkpoint(spec)
        return LoadedModel(ck.config, ck.weights, os.path.abspath(spec))
    if spec in PRESETS:
        from .init_weights import random_weights

        cfg = get_preset(spec)
        return LoadedModel(cfg, random_weights(cfg, seed), f"preset {spec} (random weights, seed {seed})")
    raise ConfigError([f"--model {spec!r} is neither a checkpoint directory nor a preset; "
                       f"presets: {', '.join(sorted(PRESETS))}"], "--model")


__all__ = ["ConfigError", "LoadedModel", "ModelConfig", "PRESETS", "get_preset", "load_model"]
