"""Shared fixtures: built modules and random weights of the tiny presets (built once per session)."""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

# Triton kernels run in the interpreter on CPU machines; it must be chosen before kernels are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pytest-xdist (the README's test command): the workers share the cores, so torch's own threads are split among them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests._interpreter_speed import install as _install_interpreter_speed

    _install_interpreter_speed()


@functools.lru_cache(maxsize=None)
def tiny_model(preset: str, seed: int = 0):
    from k31c.model.build import build_module
    from k31c.model.init_weights import random_weights
    from k31c.model.presets import get_preset

    cfg = get_preset(preset)
    return cfg, build_module(cfg), random_weights(cfg, seed)


@pytest.fixture(scope="session")
def tiny():
    return tiny_model
