"""Plan the packed block-cache row (DESIGN §5 T1, T7; SPEC §7) from the per-rank IR and record it.

Pattern (no node changes). The pool inputs of the entry functions, after the step metadata
(`tokens, token_pos, token_req, cu_seqlens, block_table, state_slot`):
    %latent.{i}       : dt[NB, B, W]          one MLA layer's latent page          (block view)
    %index_keys.{i}   : dt[NB, B, W]          its index keys                       (block view)
    %index_scales.{i} : dt[NB, B] | [NB, B, W] their scales                        (block view)
    %kda_state.{i}    : dt[S, H, D, D]        one KDA layer's recurrent state      (per-request slot)
    %conv_state.{i}   : dt[S, K-1, C]         its conv tail                        (per-request slot)
become ONE row per cache block: for every MLA layer in model order its latent page, then its key page
(keys, then scales), each page at a multiple of the alignment, no padding to a common width; and one
per-request slot of every KDA layer's state and conv tail (`k31c.runtime.block_layout`, which says
why the state is not folded into rows). Recorded as the module attribute `cache_layout`, the JSON
text of plan.json's `cache_layout`:
    attr cache_layout = "{\"block_size\": 64, \"row_bytes\": ..., \"pages\": [...], \"kda_state\": {...}}"
`k31c compile` writes it into plan.json and checks it against the memory planner's formats; the runtime
allocates its one pool from it (`ReferenceRuntime._packed_pool`).

It runs after the parallel phase, so the row is a rank's: KDA heads / tp in the slot, the DCP shard
of a request's rows in the pool.

Options: `ctx.options["cache_alignment"]` (bytes, a power of two; default 128).
Preconditions (PassError naming the function and pool otherwise): every entry function that takes pools
takes the same pools with the same types; block pools are views [NB, block_size, ...] of the module's
`block_size` (a power of two); every pool is a section this layout knows.
Postconditions: `module.attrs["cache_layout"]` is set (1 rewrite), or absent when the pools are flat
[N, ...] tensors (`pool_view="flat"`, 0 rewrites); the graph is unchanged.
"""

from __future__ import annotations

import json

from ir.core import Module
from k31c.model.build import METADATA_INPUTS
from k31c.runtime.block_layout import POOL_SECTIONS, SLOT_POOLS, LayoutError, layout_for_pools

from .base import PassContext, PassError

NAME = "plan_cache_layout"
# IR dtype name -> the layout's dtype name
_LAYOUT_DTYPE = {"f8e4m3": "e4m3", "u8": "u8", "bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f64"}


def step_functions(module: Module) -> list:
    """The entry functions that take the step metadata (and then the cache pools)."""
    n = len(METADATA_INPUTS)
    return [f for f in module.functions.values() if tuple(v.name for v in f.inputs[:n]) == METADATA_INPUTS]


def run(module: Module, ctx: PassContext) -> int:
    steps = step_functions(module)
    if not steps:
        return 0
    n = len(METADATA_INPUTS)
    fn, pools = steps[0], steps[0].inputs[n:]
    sig = {v.name: str(v.type) for v in pools}
    for other in steps[1:]:  # precondition: one pool signature for every step function
        got = {v.name: str(v.type) for v in other.inputs[n:]}
        if got != sig:
            diff = sorted(k for k in set(got) | set(sig) if got.get(k) != sig.get(k))
            raise PassError(f"{NAME}: @{other.name} and @{fn.name} take different cache pools: "
                            + ", ".join(f"%{k}: {got.get(k, 'absent')} vs {sig.get(k, 'absent')}" for k in diff[:4]))
    bs = int(module.attrs.get("block_size", 1))
    block_pools, slot_pools, flat = [], [], []
    for v in pools:
        shape, lead = v.type.shape, str(v.type.shape[0])
        dt = _LAYOUT_DTYPE.get(v.type.dtype.name)
        prefix = v.name.rpartition(".")[0]
        if dt is None:
            raise PassError(f"{NAME}: pool %{v.name} of @{fn.name} has dtype {v.type.dtype.name}, which no cache "
                            f"section holds ({sorted(_LAYOUT_DTYPE)})")
        if lead == "NB" and prefix in POOL_SECTIONS:
            if len(shape) < 2 or str(shape[1]) != str(bs):
                raise PassError(f"{NAME}: block pool %{v.name}: {v.type} is not a view [NB, {bs}, ...] of the "
                                f"module's block_size {bs}")
            block_pools.append((v.name, dt, tuple(int(d) for d in shape[2:])))
        elif lead == "S" and prefix in SLOT_POOLS:
            slot_pools.append((v.name, dt, tuple(int(d) for d in shape[1:])))
        elif lead == "N":
            flat.append(v.name)
        else:
            raise PassError(f"{NAME}: pool %{v.name}: {v.type} of @{fn.name} is neither a block view "
                            f"[NB, {bs}, ...] ({', '.join(POOL_SECTIONS)}), a per-request slot [S, ...] "
                            f"({', '.join(SLOT_POOLS)}) nor a flat pool [N, ...]")
    if flat or not block_pools:
        return 0  # flat pools (one tensor each) or no MLA layer: there is no packed row to plan
    try:
        layout = layout_for_pools(module.name, bs, block_pools, slot_pools,
                                  alignment=int(ctx.options.get("cache_alignment", 128)),
                                  tp=int(module.attrs.get("tp", 1)))
    except LayoutError as e:
        raise PassError(f"{NAME}: {e}") from e
    module.attrs["cache_layout"] = json.dumps(layout.to_json(), sort_keys=True)
    ctx.count(NAME)
    return 1
