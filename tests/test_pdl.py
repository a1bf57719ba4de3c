"""Programmatic dependent launch (codegen/triton/_pdl.py): which launches ask for it. On a CUDA sm_90+
device (live, or the build target an AOT build records for) a kernel that keeps the contract gets PDL=True
and launch_pdl; below sm_90, on AMD and in the interpreter it gets PDL=False only; the switch turns it off.
The built PTX holding the wait is checked in test_aot_build.py; races are checked on the GPU by the
runtime bench's graph_check (replays bitwise equal to the PDL-off eager step)."""

import pytest
import triton
from triton.backends.compiler import GPUTarget

from codegen.aot.record import FakeDriver
from codegen.triton import _pdl


@pytest.fixture
def device(monkeypatch):
    """Pretend Triton compiles for `target` (not interpreting), as an AOT recording does."""
    drv = triton.runtime.driver
    before = drv._active  # None on a machine without a GPU: there is no default driver to reset to

    def use(target):
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        drv.set_active(FakeDriver(target))
    yield use
    drv._active = before


@pytest.mark.parametrize("target, on", [(GPUTarget("cuda", 90, 32), True), (GPUTarget("cuda", 100, 32), True),
                                        (GPUTarget("cuda", 80, 32), False), (GPUTarget("hip", "gfx950", 64), False)])
def test_pdl_only_for_cuda_sm90_and_later(device, target, on):
    device(target)
    assert _pdl.launch_kwargs() == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})


def test_switch_and_interpreter_turn_it_off(device, monkeypatch):
    device(GPUTarget("cuda", 90, 32))
    before = _pdl.set_enabled(False)
    try:
        assert before is True and _pdl.launch_kwargs() == {"PDL": False} and not _pdl.enabled()
    finally:
        _pdl.set_enabled(before)
    assert _pdl.launch_kwargs()["PDL"] is True
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _pdl.launch_kwargs() == {"PDL": False}
