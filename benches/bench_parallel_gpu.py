"""The parallel layouts on several GPUs over NCCL (issue 10): W ranks started by k31c.parallel.launch (one
process per GPU), every model run by the compiled kernels (Executor) in bf16, collectives through NCCL
with NVLink multicast off.

Sections (rank 0 writes one JSON document, $OUT/parallel_gpu.json, after every measurement):
- check: a small model (k31-tiny with 8 KDA / 8 MLA heads, 4 layers) served by each layout for two
  prefill steps and two decode steps; logits against the same model on one GPU. The bf16 tolerance is
  measured, not assumed: twice the error of the one-GPU bf16 run against the one-GPU fp32 reference
  interpreter (plus 1e-3). Merge-free DCP prefill (token-sharded prefill under DCP, T5) against
  token-sharded prefill without DCP on the same TP / EP layout: bitwise, and the largest difference.
- prefill: preset `pair` (below), one request of 8K / 32K / 128K prompt tokens: head-sharded vs
  token-sharded prefill on TP=W, and the unsharded model on one GPU (every rank alone at once); the cost
  model's choice (`choose_prefill_function`, crossover planned for h200 at this TP) against the faster
  measured one.
- decode: `pair`, context 32K / 128K at batch 1 and 8: one GPU, TP=W and TP=W with DCP=W (top-k merge +
  LSE combine of T4), eager steps and steps replayed from CUDA graphs with the NCCL collectives captured
  inside (on cuda; under DCP through the static-shape references of k31c/parallel/dcp_graph.py), with the
  graphed step's logits against the eager step's on the same state.
- merge: the exact one-round top-k merge (`dcp_topk`, k = 2048 as k31-pro) against a generic merge
  (every rank all-gathers its local top-k as (key, position) pairs, 8 B each, and selects from the union):
  time and bytes per row at context 32K / 128K, 1 / 8 / 64 rows.
- capacity: KV capacity in tokens of `pair` under TP=W with DCP 1 and W on this machine (free device
  memory after the weights and a max-batch prefill, over the runtime's bytes per cached token per rank;
  the pool of that size is allocated and a decode step served) against the plan's prediction for h200.

Preset `pair`: k31-pro cut to 4 layers (dense KDA, two MoE KDA, one MoE MLA; 3 KDA : 1 MLA as k31-pro)
with heads, experts, dense MLP and vocabulary / 4, so each of 2 TP ranks holds a TP=8 rank's share of
k31-pro (12 KDA + 12 MLA heads, 112 experts with expected top-k 2 per rank); hidden, latent, kv-lora and
indexer widths full. Random weights drawn on each GPU from one seed (identical on every rank).

    PYTHONPATH=. python benches/bench_parallel_gpu.py [--world 2] [--sections check,prefill,decode,merge,capacity]
    (CPU logic check: --device cpu --preset tiny, gloo + the Triton interpreter)
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

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast stays off (device/KINDS.md), also in the spawned ranks
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():  # before triton's first import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

from benches._parallel_tools import generic_merge, profile_step  # noqa: E402
from benches._report import BenchReport  # noqa: E402
from benches.bench_runtime_gpu import device_weights, fill_random, graph_and_eager, rel  # noqa: E402
from k31c.parallel.launch import add_launch_args, launch_main  # noqa: E402
from k31c.parallel.serving import ParallelLayout  # noqa: E402

MARGIN_BYTES = 2 * 1024**3  # left free on the real machine (allocator slack, NCCL buffers)
SECTIONS = ("check", "prefill", "decode", "merge", "capacity")


def check_config(index_topk: int = 16):
    from k31c.model.presets import get_preset

    return get_preset("k31-tiny").replace(name=f"k31-tiny-par8-k{index_topk}", num_hidden_layers=4,
                                          full_attn_layers=(3,), kda_num_heads=8, kda_head_dim=32,
                                          num_attention_heads=8, index_topk=index_topk).validate()


def pair_config():
    from k31c.model.presets import get_preset

    pro, f = get_preset("k31-pro"), 4
    return pro.replace(name="k31-pro-pair", num_hidden_layers=4, full_attn_layers=(3,),
                       kda_num_heads=pro.kda_num_heads // f, num_attention_heads=pro.num_attention_heads // f,
                       num_experts=pro.num_experts // f,
                       num_experts_per_token=pro.num_experts_per_token // f, num_shared_experts=1,
                       intermediate_size=pro.intermediate_size // f, vocab_size=pro.vocab_size // f,
                       attn_res_block_size=2).validate("pair preset")


# ---- one layout on this rank ----------------------------------------------------------------------
class Bench:
    """What every rank shares: the arguments, the device, rank 0's report and the agreed clock."""

    def __init__(self, args):
        self.args, self.layout = args, args.parallel
        self.rank, self.world = self.layout.rank, self.layout.tp
        self.device = args.device
        self.cuda = self.device.startswith("cuda")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.rep = BenchReport("parallel_gpu")
        self.doc = self.rep.doc
        self._weights = {}

    def agree(self, value):
        """Rank 0's value on every rank (decisions that steer collectives must be the same everywhere)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def over(self) -> bool:
        return self.agree(time.time() - self.rep.t0 > self.args.budget_s)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def record(self, m: dict):
        if self.rank == 0:
            self.doc["measurements"].append(m)
            print(json.dumps(m, default=str), flush=True)
            self.rep.save()

    def weights(self, cfg):
        if cfg.name not in self._weights:
            if self.cuda:
                self._weights[cfg.name] = device_weights(cfg, self.device)
            else:
                from k31c.model.init_weights import random_weights
                self._weights[cfg.name] = random_weights(cfg, 0)
        return self._weights[cfg.name]

    def runtime(self, cfg, tp=1, dcp=1, ep=None, interleave=1, rows=4096, requests=2, engine="compiled",
                dtype=None):
        """This rank's runtime for a layout (tp = 1: the unsharded model on this GPU alone)."""
        from k31c.compiler import CompileOptions, build_options, compile_model
        from k31c.model.build import build_module
        from k31c.parallel.groups import build_groups
        from k31c.parallel.serving import use_local_cache_rows
        from k31c.parallel.weights import shard_weights
        from k31c.plan import plan_options
        from k31c.runtime.cuda_graphs import GraphedRuntime
        from k31c.runtime.executor import Executor
        from k31c.runtime.reference import ReferenceRuntime

        ep = tp if ep is None else ep
        lay = ParallelLayout(tp=tp, dcp=dcp, ep=ep, rank=self.rank if tp > 1 else 0, dcp_interleave=interleave)
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg.to_hf(), f)
        target = "h200" if self.cuda else "cpu"
        plan = plan_options(d, target=target, tp=tp, dcp=dcp, ep=ep, dcp_interleave=interleave)
        if tp > 1:
            build_groups(tp, dcp, ep)
        w = self.weights(cfg)
        dtype = dtype or self.dtype
        if engine == "compiled":
            art, _ = compile_model(cfg, None, os.path.join(d, "art"), CompileOptions(plan=plan), model_source="bench")
            m = art.module
            w = shard_weights(m, w, tp_rank=lay.rank, ep_rank=lay.ep_rank) if tp > 1 else w
            eng = Executor(m, w, art.choices, target=target, configs=art.configs, compute_dtype=dtype,
                           device=self.device, cuda_graphs=self.cuda)
            # decode steps replay CUDA graphs (collectives inside) while rt.use_graphs is set
            rt = GraphedRuntime(m, w, max_rows=rows, max_requests=requests, engine=eng)
            rt.use_graphs = False  # eager unless a section asks for graphs
        else:
            if tp > 1:
                raise ValueError("the reference engine runs the unsharded model only here")
            rt = ReferenceRuntime(build_module(cfg, build_options(plan)), w, max_rows=rows, max_requests=requests,
                                  compute_dtype=dtype, device=self.device)
        use_local_cache_rows(rt, lay)
        rt.plan = plan
        return rt

    def timed(self, fn) -> float:
        """Seconds of one call of fn on every rank (barrier before, device sync after; rank 0's clock)."""
        self.sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t

    def free(self):
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


# ---- sections -------------------------------------------------------------------------------------
def check(b: Bench):
    """fp32: the sparse model (top-k 16 of up to 96 positions: the exact merge decides the selection),
    tolerance 2x the one-GPU error + 1e-5. bf16: top-k 128 (every position selected, so a near-tie that
    bf16 rounding flips cannot change the selection; the merge still runs), tolerance 2x + 1e-3."""
    for name in b.args.check_dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        check_dtype(b, dtype, check_config(16 if dtype == torch.float32 else 128))


def check_dtype(b: Bench, dtype, cfg):
    g = torch.Generator().manual_seed(5)
    pa = torch.randint(0, cfg.vocab_size, (72,), generator=g).tolist()
    pb = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()
    # chunk lengths are multiples of 2·W so that token-sharded prefill applies (token_multiple)
    steps = [("prefill", {"a": pa[:48], "b": pb}), ("prefill", {"a": pa[48:]}),
             ("decode", {"a": [3], "b": [11]}), ("decode", {"a": [17], "b": [29]})]

    def serve(rt, prefill_fn="prefill"):
        for rid in "ab":
            rt.add_request(rid, 96)
        return [rt.step(prefill_fn if fn == "prefill" else fn, ch).float().cpu() for fn, ch in steps]

    fp32 = serve(b.runtime(cfg, engine="reference", dtype=torch.float32))
    one = serve(b.runtime(cfg, dtype=dtype))
    noise = max(rel(x, y) for x, y in zip(one, fp32))
    tol = 2 * noise + (1e-5 if dtype == torch.float32 else 1e-3)
    dn = str(dtype).replace("torch.", "")
    b.record({"name": "check_one_gpu", "dtype": dn, "model": cfg.name, "engine": "compiled",
              "max_rel_err_vs_fp32_reference": noise, "tolerance": tol})
    W = b.world
    layouts = {f"tp{W}": dict(tp=W), f"tp{W} token-sharded prefill": dict(tp=W, tokens=True),
               f"tp{W} ep1": dict(tp=W, ep=1), f"tp{W} dcp{W}": dict(tp=W, dcp=W),
               f"tp{W} dcp{W} merge-free prefill": dict(tp=W, dcp=W, tokens=True),
               f"tp{W} dcp{W} interleave 2": dict(tp=W, dcp=W, interleave=2)}
    got = {}
    for name, lay in layouts.items():
        tokens = lay.pop("tokens", False)
        rt = b.runtime(cfg, dtype=dtype, **lay)
        fn = "prefill_token_sharded" if tokens else "prefill"
        if fn not in rt.module.functions:
            raise RuntimeError(f"{name}: the compiled module has no @{fn}")
        got[name] = out = serve(rt, fn)
        errs = [rel(x, y) for x, y in zip(out, one)]
        b.record({"name": "check_layout", "dtype": dn, "model": cfg.name, "layout": name, "world": W, "prefill_fn": fn, "rel_err_per_step": errs,
                  "max_rel_err": max(errs), "within_tolerance": max(errs) <= tol, "tolerance": tol,
                  "kernel_launches": sum(rt.interp.stats()["kernel_launches"].values())})
        del rt
        b.free()
    a, m = got[f"tp{W} token-sharded prefill"], got[f"tp{W} dcp{W} merge-free prefill"]
    pre = [i for i, (fn, _) in enumerate(steps) if fn == "prefill"]  # decode under DCP is another computation
    b.record({"name": "check_merge_free_vs_token_sharded", "dtype": dn, "world": W, "prefill_steps": pre,
              "bitwise_equal_per_prefill_step": [bool(torch.equal(m[i], a[i])) for i in pre],
              "max_abs_diff_per_prefill_step": [float((m[i] - a[i]).abs().max()) for i in pre]})


def prefill(b: Bench):
    from k31c.parallel.prefill_choice import choose_prefill_function

    cfg = pair_config() if b.args.preset == "pair" else check_config()
    W = b.world
    for n in [int(x) for x in b.args.prefill_tokens.split(",")]:
        if b.over():
            b.doc["notes"].append(f"prefill of {n} tokens skipped: over the time budget")
            continue
        toks = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        times = {}
        for name, tp, fn in (("one GPU", 1, "prefill"), (f"tp{W} head-sharded", W, "prefill"),
                             (f"tp{W} token-sharded", W, "prefill_token_sharded")):
            rt = b.runtime(cfg, tp=tp, rows=2 * n + 128)
            for rid in ("warm", "timed"):
                rt.add_request(rid, n + 8)
            b.timed(lambda: rt.step(fn, {"warm": toks}))  # kernel compilation and config buckets at this shape
            s = b.timed(lambda: rt.step(fn, {"timed": toks}))
            times[name] = s
            m = {"name": "prefill", "layout": name, "tokens": n, "seconds": s, "tokens_per_s": n / s}
            if tp > 1:
                m["cost_model_choice"] = choose_prefill_function(rt.module, [n])
                m["planned_crossover_tokens"] = int(rt.module.functions["prefill_token_sharded"].attrs.get(
                    "token_shard_min_tokens", 0))
            b.record(m)
            del rt
            b.free()
        head, tok = times[f"tp{W} head-sharded"], times[f"tp{W} token-sharded"]
        b.record({"name": "prefill_choice", "tokens": n, "measured_faster": "token" if tok < head else "head",
                  "token_over_head": tok / head, "one_gpu_over_tp": times["one GPU"] / min(head, tok),
                  "cost_model_choice": m["cost_model_choice"]})


def decode(b: Bench):
    cfg = pair_config() if b.args.preset == "pair" else check_config()
    W, steps = b.world, b.args.decode_steps
    batches = [int(x) for x in b.args.batches.split(",")]
    for ctx in [int(x) for x in b.args.decode_contexts.split(",")]:
        for name, tp, dcp in (("one GPU", 1, 1), (f"tp{W}", W, 1), (f"tp{W} dcp{W}", W, W)):
            if b.over():
                b.doc["notes"].append(f"decode {name} at context {ctx} skipped: over the time budget")
                continue
            nb = max(batches)
            rt = b.runtime(cfg, tp=tp, dcp=dcp, rows=nb * (ctx + 64), requests=nb)
            start = ctx - steps - 4
            fill_random(rt, {f"r{i}": (start, ctx) for i in range(nb)}, seed=1)
            for bs in batches:
                toks = {f"r{i}": (7 * i + 3) % cfg.vocab_size for i in range(bs)}
                for graphs in (False, True) if b.cuda else (False,):
                    rt.use_graphs = graphs
                    b.timed(lambda: rt.decode(toks))  # warm-up (graph capture)
                    ts = sorted(b.timed(lambda: rt.decode(toks)) * 1e3 for _ in range(steps))
                    for r in rt.requests.values():
                        r.length = start
                    m = {"name": "decode", "layout": name, "context": ctx, "batch": bs, "median_ms": ts[len(ts) // 2],
                         "min_ms": ts[0], "graphs": graphs, "cache_blocks_per_request": len(rt.blocks_of("r0"))}
                    if graphs:
                        m["graph_stats"] = rt.stats()
                        m["graph_vs_eager_rel_err"] = rel(*graph_and_eager(rt, toks))
                        for r in rt.requests.values():
                            r.length = start
                    if b.args.profile:
                        m["profile"] = profile_step(lambda: rt.decode(toks), b.cuda)
                        for r in rt.requests.values():
                            r.length = start
                    b.record(m)
            del rt
            b.free()


def merge(b: Bench):
    from k31c.parallel.dcp_topk import candidates_per_rank, dcp_topk

    W, k = b.world, b.args.merge_topk
    for ctx in [int(x) for x in b.args.decode_contexts.split(",")]:
        for rows in (1, 8, 64):
            if b.over():
                return
            g = torch.Generator(b.device).manual_seed(100 * rows + b.rank)
            s = torch.randn((rows, ctx // W), generator=g, device=b.device)
            res = {}
            for name, fn in (("exact one-round", lambda: dcp_topk(s, k)),
                             ("generic all-gather", lambda: generic_merge(s, k, W, b.rank))):
                fn()
                res[name] = statistics.median(b.timed(fn) * 1e3 for _ in range(b.args.merge_reps))
            r = dcp_topk(s, k)
            parts = [torch.empty_like(r.own_positions) for _ in range(W)]
            dist.all_gather(parts, r.own_positions)  # the exact selection, every rank's share
            exact = torch.sort(torch.where(torch.cat(parts, 1) >= 0, torch.cat(parts, 1), 1 << 62), 1).values[:, :k]
            same = bool(torch.equal(exact, torch.sort(generic_merge(s, k, W, b.rank).long(), 1).values))
            b.record({"name": "merge", "world": W, "context": ctx, "rows": rows, "k": k, "same_selection": same,
                      "exact_ms": res["exact one-round"], "generic_ms": res["generic all-gather"],
                      "exact_first_round_B_per_row": W * candidates_per_rank(k, W) * 4,
                      "exact_resend_rows": r.resend_rows, "exact_resend_B_per_row": r.resend_bytes / rows,
                      "generic_B_per_row": W * k * 8})


def capacity(b: Bench):
    """Per DCP size: this rank's runtime (sharded weights only: the full ones it was cut from are dropped),
    one max-batch prefill (head- or token-sharded as the cost model picks, as serving does) for its peak
    transient memory, then the largest pool that fits what is left minus MARGIN_BYTES is allocated over
    the same engine and a max-context request decodes in it. The plan's memory model is recorded beside."""
    from k31c.parallel.prefill_choice import choose_prefill_function
    from k31c.parallel.serving import use_local_cache_rows
    from k31c.plan.memory import capacity as plan_capacity, memory_plan
    from k31c.plan.options import DEFAULTS as PLAN_DEFAULTS
    from k31c.runtime.reference import ReferenceRuntime

    cfg = pair_config() if b.args.preset == "pair" else check_config()
    W = b.world
    for dcp in (1, W):
        if b.over():
            return
        mb = min(b.args.capacity_prefill or PLAN_DEFAULTS["max_batched_tokens"], cfg.max_position_embeddings - 8)
        probe = b.runtime(cfg, tp=W, dcp=dcp, rows=mb + 1024, requests=4)
        b._weights.clear()  # keep this rank's shard only, as a deployment does
        b.free()
        eng, plan_opts = probe.interp, probe.plan
        pool_bytes = sum(t.numel() * t.element_size() for n, t in probe.pools.items() if n not in probe.state_pools)
        per_row = pool_bytes / (probe.blocks.num_blocks * probe.block_size)  # bytes per local cache row
        state = sum(t[0].numel() * t.element_size() for n, t in probe.pools.items() if n in probe.state_pools)
        plan, mem = plan_capacity(plan_opts), memory_plan(plan_opts)
        probe.add_request("p", mb + 8)
        toks = torch.randint(0, cfg.vocab_size, (mb,)).tolist()
        fn = choose_prefill_function(probe.module, [mb])
        if b.cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        b.timed(lambda: probe.step(fn, {"p": toks}))
        del probe
        b.free()
        if b.cuda:
            transient = torch.cuda.max_memory_allocated() - base  # the prefill's peak over what it started with
            weights_bytes = torch.cuda.memory_allocated()            # the engine: weights and kernel state
            free, total = torch.cuda.mem_get_info()
            avail = free - transient - MARGIN_BYTES
        else:
            transient, weights_bytes, total, avail = 0, 0, 0, 64 * 1024**2
        slots = plan["state_slots_reserved"]
        rows = torch.tensor([int(max(0, avail - slots * state) // per_row)], device=b.device)
        dist.all_reduce(rows, op=dist.ReduceOp.MIN)  # every rank allocates the pool the tightest rank fits
        rows = int(rows)
        rt = ReferenceRuntime(eng.module, eng.weights, max_rows=max(1, rows - slots * 64), max_requests=slots,
                              engine=eng)
        use_local_cache_rows(rt, ParallelLayout(tp=W, dcp=dcp, ep=W, rank=b.rank))
        real_tokens = rt.blocks.num_blocks * rt.block_size * dcp
        cap = min(real_tokens - rt.block_size * dcp, cfg.max_position_embeddings)
        rt.add_request("long", cap)
        rt.requests["long"].length = cap - 2
        b.timed(lambda: rt.decode({"long": 5}))  # a max-context request is admitted and decodes
        b.record({"name": "capacity", "world": W, "tp": W, "dcp": dcp, "real_tokens": real_tokens,
                  "plan_tokens": plan["tokens"], "real_over_plan": real_tokens / max(1, plan["tokens"]),
                  "real_bytes_per_local_row": per_row, "real_bytes_per_token_per_rank": per_row / dcp,
                  "plan_bytes_per_token_per_rank": plan["cache_bytes_per_token_per_rank"],
                  "real": {"device_bytes": total, "engine_bytes": weights_bytes, "prefill_transient_bytes": transient,
                           "prefill_tokens": mb, "prefill_fn": fn, "margin_bytes": MARGIN_BYTES,
                           "cache_bytes": rt.blocks.num_blocks * rt.block_size * per_row},
                  "plan": {k: mem[k] for k in ("capacity_bytes", "weights_bytes", "activations_bytes",
                                               "workspace_bytes", "reserve_bytes", "free_for_cache_bytes")},
                  "one_request_of_tokens": cap, "state_slots": slots, "state_bytes_per_slot": state})
        del rt, eng
        b.free()


def rank_main(args) -> int:
    b = Bench(args)
    doc = b.doc
    doc["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "world": b.world,
                      "backend": dist.get_backend(),
                      "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if b.cuda else None,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())) if b.cuda else None,
                      "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                             "NVSHMEM_DISABLE_NVLS")}}
    doc["command"] = args.command
    doc["preset"] = args.preset
    if b.world < 4:
        doc["notes"].append(f"world {b.world}: only the layouts a {b.world}-GPU machine allows (DCP / EP groups "
                            f"inside TP need W >= 4; the gloo tests cover them)")
    fns = {"check": check, "prefill": prefill, "decode": decode, "merge": merge, "capacity": capacity}
    for s in args.sections.split(","):
        if b.rank == 0:
            b.rep.section(fns[s])(b)  # records a failing section and goes on
        else:
            try:
                fns[s](b)
            except Exception:  # rank 0 reports it (the same failure); a lone failure ends in the collective timeout
                pass
        dist.barrier()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="pair", choices=("pair", "tiny"))
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--check-dtypes", default="fp32,bf16")
    p.add_argument("--prefill-tokens", default="8192,32768,131072")
    p.add_argument("--decode-contexts", default="32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--decode-steps", type=int, default=5)
    p.add_argument("--profile", action="store_true",
                   help="decode: also record one step under torch.profiler per layout and batch (top ops)")
    p.add_argument("--merge-topk", type=int, default=2048)
    p.add_argument("--merge-reps", type=int, default=20)
    p.add_argument("--capacity-prefill", type=int, default=0,
                   help="prompt tokens of the prefill whose peak memory the capacity leaves free (default: the "
                        "plan's max_batched_tokens)")
    p.add_argument("--budget-s", type=float, default=480, help="sections skip what is left past this")
    a = p.parse_args()
    lp = argparse.ArgumentParser()
    add_launch_args(lp)
    args = lp.parse_args(["--tp", str(a.world), "--collective-timeout", "90"])
    for k, v in vars(a).items():
        setattr(args, k, v)
    args.command = " ".join([sys.executable] + sys.argv)
    code = launch_main(args, rank_main)
    if code:
        print(f"bench_parallel_gpu: the ranks returned {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
