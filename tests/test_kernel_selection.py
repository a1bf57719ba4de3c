"""Kernel selection over whole models: no template's `supports()` raises on the symbolic compile-time types of
any node, for every tiny preset after the full pass pipeline and every target family (a raise is caught by
`codegen/select.py` and turns into a silent-looking reference fallback, as it did for two new fused GEMMs in
session 8 before their own tests asserted their selection)."""

from __future__ import annotations

import pytest

from codegen.select import select_kernels
from passes.base import PassContext
from passes.pipeline import run_pipeline
from tests.conftest import tiny_model
from tests.test_pass_pipeline import copy_module

TARGETS = ("cpu", "h200", "gb300", "mi355x")


@pytest.mark.parametrize("preset", ["k31-tiny", "k3-tiny", "kimi-linear-tiny"])
def test_no_template_raises_while_kernels_are_selected(preset):
    module = copy_module(tiny_model(preset)[1])
    run_pipeline(module, PassContext())
    for target in TARGETS:
        raised = [(c.function, c.op, c.reason) for c in select_kernels(module, target) if "raised" in c.reason]
        assert not raised, f"{preset} on {target}: {raised[:3]}"
