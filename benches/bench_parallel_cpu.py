"""CPU bench of the parallel layouts (issue 8): gloo ranks started by k31c.parallel.launch, the reference
interpreter, a k31-tiny variant with 8 KDA / 8 MLA heads. What it shows is the *mechanics*: per layout
(DCP and EP over the whole world or, at W >= 4, in groups of W/2 consecutive ranks) the step time on each
world size, the cache blocks a rank reserves per request (under DCP only its share of the positions),
the bytes each rank's collectives move per step (from
the IR's costs of the inserted collective ops, at the step's shape) and the measured DCP top-k merge
traffic against W·⌈1.5k/W⌉·4 (first round) and W·k·8 (generic merge). Every time is set against the
unsharded model run on every rank at the same moment (same machine load). CPU times with W processes
over few cores are not a performance claim; the cost-model section gives the planner's head- vs
token-sharding crossover for k31-pro on real targets.

    PYTHONPATH=. python benches/bench_parallel_cpu.py [--worlds 2,4] [--prompt 32] [--decode-steps 3]

One JSON document on stdout, and in $OUT/parallel_cpu.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sympy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benches._report import BenchReport  # noqa: E402
from ir.ops import get_op  # noqa: E402
from ir.shapes import sym  # noqa: E402
from k31c.model.build import build_module  # noqa: E402
from k31c.model.init_weights import random_weights  # noqa: E402
from k31c.model.presets import get_preset  # noqa: E402
from k31c.parallel.dcp_attention import MERGE_TRAFFIC  # noqa: E402
from k31c.parallel.dcp_topk import candidates_per_rank  # noqa: E402
from k31c.parallel.launch import add_launch_args, launch_main  # noqa: E402
from k31c.parallel.prefill_choice import choose_prefill_function  # noqa: E402
from k31c.parallel.groups import build_groups  # noqa: E402
from k31c.parallel.serving import ParallelLayout, shard_module, use_local_cache_rows  # noqa: E402
from k31c.parallel.weights import shard_weights  # noqa: E402
from k31c.runtime.reference import ReferenceRuntime  # noqa: E402

CFG = get_preset("k31-tiny").replace(name="k31-tiny-par8", kda_num_heads=8, kda_head_dim=32,
                                    num_attention_heads=8).validate()
COLLECTIVES = ("all_reduce", "all_gather", "heads_to_tokens", "tokens_to_heads", "dcp_mla", "dcp_mla_dense",
               "dcp_gather_context")
BASE = "unsharded (every rank alone)"
LAYOUTS = {  # name -> (tp, ep, dcp, token-sharded prefill allowed): group sizes as divisors of the world W
    # (1 = the whole world, 2 = W/2: runs of W/2 consecutive ranks, 0 = off); tp 0 = the one-process model
    BASE: (0, 0, 0, False), "tp": (1, 0, 0, False), "tp+ep": (1, 1, 0, False),
    "tp+ep token-sharded prefill": (1, 1, 0, True), "tp+ep+dcp": (1, 1, 1, False),
    "tp+ep+dcp merge-free prefill": (1, 1, 1, True),
    "tp, ep W/2, dcp W/2": (1, 2, 2, False), "tp, ep W/2, dcp W/2 merge-free prefill": (1, 2, 2, True)}


def comm_bytes(module, fn: str, env: dict) -> float:
    """Bytes one rank's collective ops move in one step of `fn` (IR costs at the step's shape; the
    workspace gather of merge-free DCP prefill is costed at its whole workspace, R·MB·W·bs rows, an upper
    bound)."""
    total = sympy.Integer(0)
    for n in module.function(fn).nodes:
        if n.op in COLLECTIVES:
            op = get_op(n.op)
            _, by = op.cost([v.type for v in n.inputs], [v.type for v in n.outputs], n.attrs)
            total += sympy.sympify(by)
    total = total.subs({sym(k): v for k, v in env.items()})
    if total.free_symbols:
        raise ValueError(f"comm bytes of @{fn} still depend on {sorted(map(str, total.free_symbols))}")
    return float(total)


def serve_timed(module, weights, prompt: int, decode_steps: int, token_sharded: bool,
                layout: ParallelLayout | None = None) -> dict:
    g = torch.Generator().manual_seed(3)
    rows = 4 * (prompt + decode_steps + 16)
    rt = ReferenceRuntime(module, weights, max_rows=rows, max_requests=4)
    if layout is not None:
        use_local_cache_rows(rt, layout)  # under DCP: blocks for this rank's share of each request only
    for rid in "ab":
        rt.add_request(rid, prompt + decode_steps + 1)
    chunks = {rid: torch.randint(0, CFG.vocab_size, (prompt,), generator=g).tolist() for rid in "ab"}
    fn = choose_prefill_function(module, [prompt, prompt]) if token_sharded else "prefill"
    t = time.perf_counter()
    rt.step(fn, chunks)
    prefill_ms = (time.perf_counter() - t) * 1e3
    dec = []
    for s in range(decode_steps):
        t = time.perf_counter()
        rt.decode({"a": s + 1, "b": s + 2})
        dec.append((time.perf_counter() - t) * 1e3)
    ctx = prompt + decode_steps
    bs = module_block_size(module)
    ctx_env = {"N": rt.blocks.num_blocks * bs, "NB": rt.blocks.num_blocks, "L": ctx, "MB": len(rt.blocks_of("a"))}
    return {"prefill_fn": fn, "prefill_ms": prefill_ms, "decode_median_ms": statistics.median(dec),
            "cache_blocks_per_request": len(rt.blocks_of("a")), "block_size": bs,
            "prefill_comm_bytes": comm_bytes(module, fn, {"B": 2 * prompt, "R": 2, **ctx_env}),
            "decode_comm_bytes": comm_bytes(module, "decode", {"R": 2, **ctx_env})}


def module_block_size(module) -> int:
    for n in module.function("decode").nodes:
        if "block_size" in n.attrs:
            return int(n.attrs["block_size"])
    return 1


def rank_main(args) -> int:
    """Every rank runs every layout on the same steps; rank 0 writes the rows."""
    layout: ParallelLayout = args.parallel
    weights = random_weights(CFG, 0)
    rows = []
    for name, (tp, ep, dcp, tokens) in LAYOUTS.items():
        if 2 in (ep, dcp) and layout.tp < 4:
            continue  # groups of W/2 need W >= 4 (W/2 = 1 is the layout without them)
        w_of = lambda part: layout.tp // part if part else 1  # noqa: E731
        lay = ParallelLayout(tp=w_of(tp), ep=w_of(ep), dcp=w_of(dcp), rank=layout.rank if tp else 0)
        if tp:
            build_groups(lay.tp, lay.dcp, lay.ep)
        m = shard_module(build_module(CFG), lay)
        if not tokens and "prefill_token_sharded" in m.functions:
            del m.functions["prefill_token_sharded"]
        w = shard_weights(m, weights, tp_rank=lay.rank, ep_rank=lay.ep_rank)
        torch.manual_seed(0)
        MERGE_TRAFFIC.clear()
        dist.barrier()
        row = {"layout": name, "world": layout.tp, "tp": lay.tp, "ep": lay.ep, "dcp": lay.dcp,
               **serve_timed(m, w, args.prompt, args.decode_steps, tokens, lay)}
        if dcp:
            k, c = CFG.index_topk, candidates_per_rank(CFG.index_topk, lay.dcp)
            row["merge"] = {"rows": MERGE_TRAFFIC["rows"],
                            "first_round_B_per_row": MERGE_TRAFFIC["first_round_bytes"] / max(1, MERGE_TRAFFIC["rows"]),
                            "issue_first_round_B_per_row": lay.dcp * c * 4,
                            "resend_rows": MERGE_TRAFFIC["resend_rows"],
                            "resend_B_per_row": MERGE_TRAFFIC["resend_bytes"] / max(1, MERGE_TRAFFIC["rows"]),
                            "generic_B_per_row": lay.dcp * k * 8}
        rows.append(row)
    if layout.rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--prompt", type=int, default=32, help="tokens per request in the prefill step (2 requests)")
    p.add_argument("--decode-steps", type=int, default=3)
    a = p.parse_args()
    rep = BenchReport("parallel_cpu")
    rep.doc["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "backend": "gloo", "engine": "reference interpreter fp32"}
    rep.doc["notes"].append("W processes share this machine's cores: CPU times show mechanics, not speed-ups; "
                            "the baseline row runs the unsharded model on every rank at once (same load)")

    @rep.section
    def layouts():
        for world in [int(x) for x in a.worlds.split(",")]:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            lp = argparse.ArgumentParser()
            add_launch_args(lp)
            args = lp.parse_args(["--tp", str(world)])
            args.out, args.prompt, args.decode_steps, args.device = out, a.prompt, a.decode_steps, "cpu"
            code = launch_main(args, rank_main)
            if code != 0:
                raise RuntimeError(f"W={world}: launch returned {code}")
            rows = json.load(open(out))
            base = next(r for r in rows if r["layout"] == BASE)
            for row in rows:
                row["decode_vs_unsharded"] = row["decode_median_ms"] / base["decode_median_ms"]
                row["prefill_vs_unsharded"] = row["prefill_ms"] / base["prefill_ms"]
                rep.doc["measurements"].append(row)
            os.unlink(out)

    @rep.section
    def cost_model():
        from k31c.plan.options import plan_options
        from k31c.plan.sharding_cost import prefill_sharding

        for target in ("gb300", "mi355x"):  # k31-pro does not fit h200 / b200 at tp=8
            opts = plan_options("k31-pro", target=target, tp=8)
            ps = prefill_sharding(opts)
            rep.doc["ceilings"][f"k31-pro {target} tp=8 prefill sharding"] = {
                "crossover_tokens": ps["crossover_tokens"],
                "rows": [{k: r[k] for k in ("tokens", "head_ms", "token_ms", "choice")} for r in ps["rows"]]}
        k = 2048
        rep.doc["ceilings"]["k31-pro DCP merge per row (k=2048)"] = {
            f"W={w}": {"first_round_B": w * candidates_per_rank(k, w) * 4, "generic_B": w * k * 8} for w in (2, 4, 8)}

    layouts()
    cost_model()
    print(rep.save())


if __name__ == "__main__":
    main()
