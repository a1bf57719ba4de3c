"""Programmatic dependent launch (PDL): the next kernel on a stream starts while this one finishes.

On CUDA devices of compute capability 9.0 and later a kernel launched with the launch attribute
`programmaticStreamSerialization` (Triton: `launch_pdl=True`) may be scheduled as soon as every program of
the kernel before it has executed `griddepcontrol.launch_dependents` (or exited), instead of after that
kernel has finished and flushed. Stream capture turns the attribute into a programmatic edge of the CUDA
graph, so a decode step's ~60 kernels overlap each one's launch, prologue and weight loads with the tail
of the previous one. The cost is a contract every kernel launched this way keeps:

    every program executes `pdl_wait(PDL)` exactly once, before its first load of anything an earlier
    kernel of the step writes (activations, caches, metadata, counters) and before its first store;
    loads of weights (never written while steps run) may come before it. Then it calls
    `pdl_launch_dependents(PDL)`.

`griddepcontrol.wait` returns once the previous kernel has completed and its memory is visible. Since
that kernel, too, waited for its own predecessor before completing, the wait covers every earlier kernel
on the stream (and one that exits without waiting would break that chain: hence "every program, every
path"). Triggering after the wait keeps at most one kernel's programs parked ahead of the running one.

What may come before the wait: a decode GEMV loads its first weight tile there, so its weight stream starts
while the previous kernel finishes. (Asking L2 for the next tiles there as well, `prefetch.global.L2`, was
measured slower on the H200: 710 vs 696 µs per rank decode graph, session 7; it was removed. Session 12 asked L2
for a whole prefix of each decode GEMV's weight there, one `cp.async.bulk.prefetch.L2` piece per program, so that
HBM would work while latency-bound kernels (KDA decode, attention-residual mixes) run: batch 1 at 8K, graph replay,
no prefetch 567.4-569.8 µs, 8 MB 571.8-575.0, 16 MB 585.3-588.2, 32 MB 602.4-604.1 (batch 8 unchanged, 1104-1108;
benches/results/h200-2026-11-30-s12/runtime_l2pf.json): the latency-bound kernels slow down more under the extra
traffic than the GEMVs gain. Removed.)

One more thing may: data whose last writer is at least two launches back on the stream. A kernel starts only
once every program of the kernel before it has triggered, and each triggers after its own wait, which
returned when the kernel two back had completed. The KDA decode's EARLY path (kda_decode.py) reads its
recurrent state and the step metadata there: only the same layer's KDA node of the previous step writes that
state, and the step-metadata kernel is the step's first launch. This holds only while no kernel triggers
before its wait (checked on the H200 by bench_kda.py's PDL race check: a chain of launches reading state
written two launches back, graph replays equal to PDL-off eager).

And data of the kernel just before, where a completion counter that kernel releases says it is written: the Gluon
MoE down kernel under config GDO (`_moe_down_gluon._await_expert`) reads an expert's h rows once the gate-up's
programs of that expert have counted in (each after its stores; an acquire load), and takes its `pdl_wait` only
before its first store, so that it computes while the gate-up's last programs run. Its programs launch only after
every gate-up program has triggered (at its start), so all the programs it waits for are already resident: no
program can wait for one that has no SM.

A template launches with `**launch_kwargs()`: {PDL: True, launch_pdl: True} when the device Triton
compiles for is CUDA sm_90+ (the live GPU, or the build target while an AOT build records launches) and
PDL is enabled, else {PDL: False}: the kernel is then compiled without the instructions (the interpreter
never sees them) and launched plainly. `K31C_PDL=0` or `set_enabled(False)` turns PDL off (benches compare
both); the choice is read at launch time, so graphs captured after the switch follow it. The executor turns it off
around single launches whose config carries its `_plain` option (k31c/runtime/executor.py PLAIN).
"""

from __future__ import annotations

import os
import weakref

import triton
import triton.language as tl

_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}
_enabled = os.environ.get("K31C_PDL", "1") != "0"
_by_driver: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_enabled(on: bool) -> bool:
    """Turn PDL launches on or off for this process; returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    return before


def enabled() -> bool:
    return _enabled


def _target_supports() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    drv = triton.runtime.driver.active
    hit = _by_driver.get(drv)
    if hit is None:
        target = drv.get_current_target()
        arch = target.arch if isinstance(target.arch, int) else 0
        hit = _by_driver[drv] = target.backend == "cuda" and arch >= 90
    return hit


def launch_kwargs() -> dict:
    """Keyword arguments of a launch of a kernel that keeps the contract above (a `PDL: tl.constexpr`
    parameter, `pdl_wait` / `pdl_launch_dependents` called as described)."""
    return _ON if _enabled and _target_supports() else _OFF


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel on the stream has completed and its writes are visible."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Allow the next kernel on the stream to be scheduled (its programs wait in their own `pdl_wait`)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """`pdl_wait` then `pdl_launch_dependents`: the prologue of a kernel that loads nothing before waiting."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
