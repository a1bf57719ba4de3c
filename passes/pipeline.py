"""The pass pipeline: the only place that orders passes. Reads as a table of contents.

Phase 1  parallel layout   TP heads, EP, token-sharded prefill entry, DCP (ctx.options tp/ep/dcp; no-ops at 1)
Phase 2  fuse              the serving techniques of DESIGN §5 as fusions (on the per-rank graph)
Phase 3  memory            packed block-row cache plan (module attr `cache_layout`, written to plan.json)
Phase 4  select kernels    codegen/select.py (run by `k31c compile` after the passes)

`run_pipeline` verifies between passes when asked (tests, K31C_VERIFY=1), writes the text IR after
every pass to `dump_dir/NNN_<pass>.ir` (re-parseable), honours `disable` and `print_after`, and
returns per-pass timings and rewrite counts.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass, field

from ir.core import Module
from ir.printer import print_module
from ir.verifier import verify

from .base import PassContext, PassError

PHASES: list[tuple[str, list[str]]] = [
    ("parallel", [  # before the fusions: they then see per-rank shapes and the collectives
        "shard_tp",               # TP: heads/gates/output projections split by the params' shard; all-reduce after row-parallel
        "shard_ep",               # EP: experts split; local routing + all-reduce of the latent partial sums (before the norm)
        "shard_tokens",           # T3: @prefill_token_sharded, all-to-all heads<->tokens around indexer + sparse MLA
        "shard_dcp",              # T4/T5: interleaved caches, exact top-k merge + LSE combine; gathered-context prefill
    ]),
    ("fuse", [
        "packed_projection",      # linears reading one input -> one GEMM
        "moe_expert_input_split",  # decode: the experts' input z out of the shared expert's pack (own GEMM)
        "fused_indexer_front",    # indexer q projection/rotation/FP8, key norm/rotation/FP8/cache write, head weights
        "overlapped_mla_query",   # MLA query path + latent cache write, scheduled beside the indexer (2nd stream)
        "fused_indexer_select",   # indexer scorer + exact top-k emitting pool rows; attention reads rows
        "value_gate",             # absorbed MLA split at W_UV; value projection + sigmoid output gate
        "query_absorption",       # decode: q~ = W_UK^T q_nope beside the indexer (2nd stream), not after its top-k
        "latent_moe_tail",        # latent RMSNorm + cast + up-projection + shared-expert add
        "attn_res_fusion",        # prefix add + AttnRes mix + the following RMSNorm
        "kda_decode_fusion",      # decode/verify KDA: conv + gate + recurrence + gated RMSNorm
        "embedding_norm",         # embedding rows gathered and RMS-normalised in one kernel (layer 0's input norm)
        "widening_cast_fold",     # bf16 -> f32 cast read by a GEMM (router logits, LM head): widened in its loads
        "router_epilogue",        # MoE router in the epilogue of its logits GEMM (after the widening fold)
        "glu_epilogue",           # FFN gate/up packed GEMM + its GLU activation (last: others look for packs)
        "overlapped_moe_branches",  # decode: router beside the latent projection, shared down beside the experts
    ]),
    ("memory", [
        "plan_cache_layout",      # T1: one packed row per block (MLA latent + key pages) + per-request KDA slot
    ]),
]


def pass_names() -> list[str]:
    return [p for _, names in PHASES for p in names]


@dataclass
class PassRecord:
    name: str
    phase: str
    rewrites: int
    seconds: float


@dataclass
class PipelineResult:
    records: list[PassRecord] = field(default_factory=list)

    def table(self) -> str:
        rows = [f"{'phase':<10} {'pass':<28} {'rewrites':>8} {'ms':>9}"]
        rows += [f"{r.phase:<10} {r.name:<28} {r.rewrites:>8} {r.seconds * 1e3:>9.1f}" for r in self.records]
        return "\n".join(rows)


def run_pipeline(module: Module, ctx: PassContext | None = None, *, disable: tuple[str, ...] = (),
                 dump_dir: str | None = None, print_after: tuple[str, ...] = (), verify_each: bool | None = None,
                 out=None) -> PipelineResult:
    ctx = ctx or PassContext()
    known = set(pass_names())
    unknown = sorted((set(disable) | set(print_after)) - known)
    if unknown:
        raise PassError(f"unknown pass name(s) {unknown}; passes: {', '.join(pass_names())}")
    if verify_each is None:
        verify_each = os.environ.get("K31C_VERIFY") == "1"
    result = PipelineResult()
    step = 0
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        _dump(module, dump_dir, step, "input")
    for phase, names in PHASES:
        for name in names:
            if name in disable:
                continue
            mod = importlib.import_module(f"passes.{name}")
            t0 = time.perf_counter()
            n = mod.run(module, ctx)
            result.records.append(PassRecord(name, phase, n, time.perf_counter() - t0))
            if verify_each:
                verify(module)
            step += 1
            if dump_dir:
                _dump(module, dump_dir, step, name)
            if name in print_after:
                print(f"// IR after {name}\n{print_module(module)}", file=out or sys.stderr)
    return result


def _dump(module: Module, dump_dir: str, step: int, name: str):
    with open(os.path.join(dump_dir, f"{step:03d}_{name}.ir"), "w", encoding="utf-8") as f:
        f.write(print_module(module))
