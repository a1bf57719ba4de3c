"""One-GPU runtime bench (issue 7): one TP=8 rank's share of k31-pro at full width, random weights.

Preset `rank` = k31-pro with, per rank: KDA and MLA heads / 8 (12 each), experts / 8 (112) with the
expected per-rank top-k 16 * 112/896 = 2, the dense MLP and the vocabulary / 8; hidden, latent, kv-lora
and indexer widths full (the indexer is replicated under TP). Layers: 4 = one dense KDA layer (layer 0 is
dense in k31-pro), two MoE KDA layers and one MoE MLA layer (k31-pro has 3 KDA : 1 MLA). The shared
expert keeps one full 3072 expert (a rank's TP share of 2 x 3072 would be 768; the preset cannot express
it), so the rank preset reads a little more than a real rank does.

Measured (one JSON document, stdout and $OUT/runtime_gpu.json, saved after every section):
- bandwidth: a device-to-device copy (read + write bytes / time), the ceiling of the byte floor, and the read
  bandwidth (`_read_ceiling.py`: a kernel that only reads; session 23), the ceiling of the read floor: the step reads
  ~100x what it writes, so `x_floor_read` (time / (bytes / read bandwidth)) is the stricter ratio, ~5-7% above
  `x_floor` on the H200 (read 4.35-4.51 TB/s vs copy 4.13-4.29);
- decode step time (runtime.decode, host work included) at batch 1, 8, 64 and context 8K / 32K, with
  and without CUDA graphs, against the step's byte floor = (weights read: every non-expert weight, one
  embedding row per token, the expected share 1 - (1 - k/E)^batch of routed experts; cache read: every
  index key of the context and min(context, topk) latent rows per MLA layer; KDA state and conv tail read
  and written per KDA layer) / measured bandwidth;
- graph replay vs eager logits on the same state (the capture check: pad rows, scratch, side stream), the
  graph replayed --check-replays times against the eager step run with programmatic dependent launch off;
- pdl: the decode graph's device time with programmatic dependent launch on and off (alternated twice);
- graph_configs: kernel configs chosen inside the decode graph (GRAPH_CONFIGS: per label, overrides of the configs
  the tuning store resolves for batch-1 buckets; each setting's graph captured and its replay timed behind a sleep,
  --graph-rounds rounds alternated): what a kernel costs in the step depends on what runs beside it, which a
  kernel timed alone does not see (session 18 chose the batch-1 defaults of four families this way);
- graph_tune: `k31c tune --in-graph`'s coordinate descent (autotune_cache/graph_tune.py) over the batch-1 step's
  tunable sites, records of what it accepts to --graph-tune-store;
- replay_stream: the decode graph replayed back to back (no host synchronisation between replays) vs one replay behind
  a sleep, every batch;
- pdl_plain_sweep: each launch of the batch-1 step captured without its programmatic edge, one at a time;
- trace: the decode graph of batch 1 and 8 kernel by kernel under the profiler (benches/_graph_trace.py:
  durations, idle gaps, two-stream time), and batch 1's graph as a DOT dump ($OUT/graph_b1.dot);
- where the decode graph's start stall comes from (cuda_graphs.py, "Metadata"): `ahead` (replays timed behind a ~1 ms
  sleep, device time only), `carveout` (every kernel's shared-memory carveout at 100%), `pdl_window` (PDL kept for
  every launch but chosen ones, `PdlWindow`), `head_sleep` (a spin kernel captured before / after the metadata
  kernel), each with traces;
- prefill throughput at 8K and 32K tokens (one request; median of --prefill-repeats);
- peers on the same weights: the reference interpreter (torch eager) and torch.compile of it (strict
  compilation fails on the reference, DynamicOutputShapeException from the KDA reference's nonzero, so the
  default compiles with suppress_errors: frames that fail run eagerly; the JSON names the mode).
Contexts are cache contents written at random (a decode step's cost does not depend on the values).

    PYTHONPATH=. python benches/bench_runtime_gpu.py        # H200; --preset tiny --device cpu: logic check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():  # before triton's first import: its own @jit helpers must be interpreted too
    os.environ.setdefault("TRITON_INTERPRET", "1")

from autotune_cache.graph_tune import SLEEP_CYCLES, fill_random  # noqa: E402,F401  (bench_parallel_gpu imports it here)
from autotune_cache.graph_tune import fill_pools  # noqa: E402
from autotune_cache.graph_tune import replay_us as graph_replay_us  # noqa: E402
from benches._report import BenchReport, copy_bandwidth_GBps  # noqa: E402


def rank_config():
    from k31c.model.presets import get_preset

    pro = get_preset("k31-pro")
    tp = 8
    return pro.replace(name="k31-pro-rank", num_hidden_layers=4, full_attn_layers=(3,),
                       kda_num_heads=pro.kda_num_heads // tp, num_attention_heads=pro.num_attention_heads // tp,
                       num_experts=pro.num_experts // tp,
                       num_experts_per_token=pro.num_experts_per_token * (pro.num_experts // tp) // pro.num_experts,
                       num_shared_experts=1, intermediate_size=pro.intermediate_size // tp,
                       vocab_size=pro.vocab_size // tp, attn_res_block_size=2).validate("rank preset")


def device_weights(cfg, device, seed: int = 0) -> dict:
    """Random weights drawn on the device (per ParamSpec.init, as init_weights draws them; MXFP4 experts as
    random E2M1 bytes with E8M0 scales near the linear init's scale)."""
    from ir.packed import PackedMXFP4
    from k31c.model.params import param_specs

    g = torch.Generator(device).manual_seed(seed)
    out = {}
    for s in param_specs(cfg):
        shape = s.shape
        if s.format == "mxfp4":
            k = shape[-1]
            e = 127 + round(math.log2(0.7 / math.sqrt(k) / 3))
            out[s.name] = PackedMXFP4(torch.randint(0, 256, (*shape[:-1], k // 2), generator=g, device=device,
                                                    dtype=torch.uint8),
                                      torch.randint(e - 1, e + 2, (*shape[:-1], k // 32), generator=g,
                                                    device=device, dtype=torch.uint8))
            continue
        r = lambda: torch.randn(shape, generator=g, device=device)  # noqa: E731
        u = lambda: torch.rand(shape, generator=g, device=device)  # noqa: E731
        v = {"linear": lambda: r() * (0.7 / math.sqrt(shape[-1])), "embed": r, "norm": lambda: 1 + 0.1 * r(),
             "zeros": lambda: torch.zeros(shape, device=device), "small": lambda: 0.1 * r(),
             "a_log": lambda: torch.log(1 + 15 * u()), "dt_bias": lambda: torch.log(torch.expm1(1e-3 + 0.099 * u())),
             "conv": lambda: r() * (0.5 / math.sqrt(shape[-1]))}[s.init]()
        out[s.name] = v.to(torch.bfloat16 if s.format == "bf16" else torch.float32)
    return out


def step_bytes(rt, cfg, weights, batch: int, ctx: int) -> dict:
    """The bytes a decode step must move at least (see module doc)."""
    from ir.packed import PackedMXFP4

    E, k = cfg.num_experts, cfg.num_experts_per_token
    frac = 1 - (1 - k / E) ** batch
    w = 0.0
    for name, t in weights.items():
        nb = t.nbytes if isinstance(t, PackedMXFP4) else t.numel() * t.element_size()
        if name == "model.embed_tokens.weight":
            nb = batch * t.shape[1] * t.element_size()
        elif ".experts." in name and name.endswith(("w1.weight", "w2.weight", "w3.weight")):
            nb *= frac
        w += nb
    cache = 0
    fn = rt.module.function("decode")
    for name, t in rt.pools.items():
        per = t.shape[1] if str(fn.input(name).type.shape[0]) == "NB" else 1  # rows in t[0]: a block or a row
        row = t[0].numel() * t.element_size() // per
        if name in rt.state_pools:
            cache += 2 * row * batch
        elif name.startswith("latent."):
            cache += min(ctx, cfg.index_topk or ctx) * row * batch
        else:  # index keys and their scales: the whole context
            cache += ctx * row * batch
    return {"weight_bytes": int(w), "cache_bytes": int(cache), "total_bytes": int(w + cache)}


# graph_configs: bucket filters on a family's kernel key (batch-1 decode buckets), then groups of settings timed
# against each other: group -> {label: {family: config overrides}}
_T1 = lambda k: k.get("T", k.get("M", k.get("R", 0))) == 1  # noqa: E731
GRAPH_MATCH = {"kda_decode": lambda k: k["R"] == 1 and k.get("T", 1) == 1}   # else _T1


def _overrides(o) -> list:
    """A family's entry of a GRAPH_CONFIGS setting as a list of overrides (one dict, or a list of them)."""
    return [] if o is None else [o] if isinstance(o, dict) else list(o)


# session 18's batch-1 choices are the defaults now; "before" restores the configs they replaced
_BEFORE = {"moe_latent_tail": {"G_warps": 4}, "moe_grouped_gemm": {"GN2": 8, "GK2": 1024, "GKS": 8, "GNW": 2},
           "attn_res_mix_norm": {"num_warps": 8}, "kda_decode": {"WARPS": 4}}
# session 19's graph_tune records (the rank step's router, dense gate/up, MLA and KDA packed projections, shared-expert
# down, KDA decode):
# "before_s19" restores the kernel-alone records they replaced
_BEFORE_S19 = {"routed_gemm": {"_key": {"N": 112}, "num_stages": 1},
               "packed_glu_gemm": {"_key": {"N": 8448}, "BLOCK_K": 512},
               "gemm": {"_key": {"K": 3072, "N": 7168}, "BLOCK_K": 256},
               "kda_decode": {"GLUON": 0},
               "packed_gemm": [{"_key": {"N": 3808}, "BLOCK_N": 32}, {"_key": {"N": 6284}, "num_warps": 4}]}
GRAPH_CONFIGS = {  # group -> {label: {family: overrides (or a list of them, "_key": the bucket)}}, batch-1 buckets;
    # session 18's searches (benches/results/h200-2026-12-01-s18/README.md) ran groups of ~10 labels each like these
    "b1": {"before_s19": _BEFORE_S19, "before_s18_s19": {**_BEFORE, **_BEFORE_S19}},
    # session 20: the indexer's boundary-bucket scan as before SELECT_SCAN / SELECT_PICK (1024-key steps, radix)
    "select": {"before_s20": {"indexer_select_rows": {"SELECT_SCAN": 1024, "SELECT_PICK": 0}}},
    # session 21: sparse MLA at batch 1 as before (ORIENT 1, 64 pieces of 32 rows) instead of ORIENT 3 (Gluon)
    "mla": {"before_s21": {"mla_sparse": {"ORIENT": 1, "BLOCK_N": 32, "num_stages": 1, "F16": 1, "CHUNK": 32,
                                          "FOLD": 0}}},
}


# graph_tune: family -> config overrides tried at each of its sites besides the neighbours (knobs of the batch-1 Gluon
# experts and the MLA packed projection's 8-row tile, which the declared tunables do not reach)
GRAPH_TUNE_TRIES = {
    "moe_grouped_gemm": [{"GKS": 2}, {"GKS": 8}, {"GNW": 2}, {"GNW": 8}, {"GN2": 2}, {"GN2": 8}, {"GK2": 256},
                         {"GK2": 1024}, {"GLUON": 2, "GKS2": 4, "GNW2": 2}],
    "packed_gemm": [{"BLOCK_N": 8}]}

AHEAD_CYCLES = SLEEP_CYCLES  # `torch.cuda._sleep` cycles before a replay timed as device time only: ~1 ms on the H200

class PdlWindow:
    """Stands in for `_pdl._enabled` (read once per `launch_kwargs` call): true for the calls whose index within a
    step of `per` calls lies in [lo, hi) and not in `plain`; counts the calls (`n`) and the programmatic ones (`on`)."""

    def __init__(self, lo: int, hi: int, per: int = 10 ** 9, plain=()):
        self.window(lo, hi, per, plain)

    def window(self, lo: int, hi: int, per: int, plain=()):
        self.lo, self.hi, self.per, self.plain, self.n, self.on = lo, hi, max(1, per), set(plain), 0, 0

    def __bool__(self) -> bool:
        i = self.n % self.per
        self.n += 1
        hit = self.lo <= i < self.hi and i not in self.plain
        self.on += hit
        return hit


def set_carveout(pct, originals: dict) -> int:
    """Set CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT of every Triton kernel loaded in this process to pct
    (percent of the SM's unified memory as shared memory), or (pct None) back to the values read before the first
    change (kept in `originals`, by CUfunction); returns how many kernels were set."""
    import ctypes
    import gc

    from triton.compiler.compiler import CompiledKernel

    lib = ctypes.CDLL("libcuda.so.1")
    attr, n = 9, 0  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    for k in [o for o in gc.get_objects() if isinstance(o, CompiledKernel) and getattr(o, "function", None)]:
        f = ctypes.c_void_p(k.function)
        if k.function not in originals:
            v = ctypes.c_int()
            if lib.cuFuncGetAttribute(ctypes.byref(v), attr, f) != 0:
                continue
            originals[k.function] = v.value
        want = originals[k.function] if pct is None else pct
        n += lib.cuFuncSetAttribute(f, attr, ctypes.c_int(want)) == 0
    return n


# decode section variants: name -> (CUDA graphs, metadata kernel inside the graph, programmatic dependent launch)
DECODE_VARIANTS = {"graphs": (True, True, True), "graphs_no_pdl": (True, True, False),
                   "graphs_metadata_outside": (True, False, True), "eager": (False, True, True)}


def time_ms(fn, n: int, device) -> list[float]:
    """Wall times (ms, host work included) of n calls of fn, each between device synchronisations."""
    out = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def graph_and_eager(rt, toks, graphs: bool = True, repeats: int = 1):
    """(graph logits, eager logits) of one decode step: eagerly first, with programmatic dependent launch
    off (`codegen/triton/_pdl.py`: plain stream order, the safe reference), then the same step (KDA states
    restored, lengths back) replayed from its CUDA graph (`graphs`; off the GPU both are eager) `repeats`
    times; with repeats > 1 the graph result is the list of every replay's logits (a race shows as a
    replay that differs)."""
    from codegen.triton import _pdl

    snap = {rid: rt.snapshot_state(rid) for rid in toks}
    rt.use_graphs = False
    was = _pdl.set_enabled(False)
    try:
        eager = rt.decode(toks)
    finally:
        _pdl.set_enabled(was)
    outs = []
    for _ in range(repeats):
        for rid, st in snap.items():
            rt.restore_state(rid, st)
            rt.requests[rid].length -= 1
        rt.use_graphs = graphs
        outs.append(rt.decode(toks).clone())
    return (outs[0] if repeats == 1 else outs), eager


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="rank", choices=("rank", "tiny"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--engine-steps", type=int, default=24, help="timed steps of the engine_decode section")
    ap.add_argument("--budget-s", type=float, default=400, help="skip the remaining sections past this")
    ap.add_argument("--compile-timeout-s", type=int, default=90)
    ap.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills of each length (median)")
    ap.add_argument("--compile-modes", default="suppress",
                    help="torch.compile attempts in order: strict (fails on the reference: the KDA reference's "
                         "nonzero has a data-dependent shape), suppress (failing frames run eagerly)")
    ap.add_argument("--sections", default="graph_check,decode,reference_peer,prefill,torch_compile_peer")
    ap.add_argument("--graph-rounds", type=int, default=2,
                    help="graph_configs: rounds of its alternation; graph_tune: confirming pairs")
    ap.add_argument("--graph-groups", default="",
                    help=f"graph_configs: only these GRAPH_CONFIGS groups, of {','.join(GRAPH_CONFIGS)} (default all)")
    ap.add_argument("--refill-rounds", type=int, default=0,
                    help="graph_configs: 1 = new random cache and state contents before each round (seed 100 + round), "
                         "so the rounds compare the settings on different data")
    ap.add_argument("--stream-replays", type=int, default=50, help="replay_stream: back-to-back replays timed together")
    ap.add_argument("--graph-tune-budget-s", type=float, default=300, help="graph_tune: no new candidate after this")
    ap.add_argument("--graph-tune-min-gain-us", type=float, default=1.0, help="graph_tune: step time a change must save")
    ap.add_argument("--graph-tune-plain", type=int, default=1, help="graph_tune: try each site launched without PDL")
    ap.add_argument("--graph-tune-span", type=int, default=1, help="graph_tune: steps along a tunable (0: all values)")
    ap.add_argument("--graph-tune-kernels", default="", help="graph_tune: only these families (comma-separated)")
    ap.add_argument("--graph-tune-store", default="", help="graph_tune: write the accepted configs' records here")
    ap.add_argument("--pdl-plain-sets", default="",
                    help="pdl_plain_sweep: sets of launch indices captured plain together, e.g. '10,12;15,16' "
                         "(default: each launch alone)")
    ap.add_argument("--decode-variants", default="graphs,graphs_no_pdl,eager",
                    help=f"decode section variants, of {','.join(DECODE_VARIANTS)}")
    ap.add_argument("--check-batch", type=int, default=8,
                    help="graph_check's batch (capped at the largest of --batches)")
    ap.add_argument("--check-replays", type=int, default=20,
                    help="graph_check: replays of the same step compared bitwise with the eager (PDL off) step")
    ap.add_argument("--records", default="device",
                    help="tuning store the compiled runs consult for buckets the artifact has no config for "
                         "('device': this machine's default store; 'none': the declared heuristics only)")
    args = ap.parse_args()
    import triton

    from codegen.triton import _pdl
    from k31c.compiler import CompileOptions, build_options, compile_model
    from k31c.model.build import build_module
    from k31c.plan import plan_options
    from k31c.runtime.cuda_graphs import GraphedRuntime
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import ReferenceRuntime

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    rep = BenchReport("runtime_gpu")
    doc = rep.doc
    doc["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name(0) if cuda else None}
    contexts = [int(c) for c in args.contexts.split(",")]
    variants = [v for v in args.decode_variants.split(",") if v]
    if set(variants) - set(DECODE_VARIANTS):
        raise SystemExit(f"--decode-variants: unknown {sorted(set(variants) - set(DECODE_VARIANTS))}; "
                         f"known: {', '.join(DECODE_VARIANTS)}")
    batches = [int(b) for b in args.batches.split(",")]
    groups = [g_ for g_ in args.graph_groups.split(",") if g_] or list(GRAPH_CONFIGS)
    if set(groups) - set(GRAPH_CONFIGS):
        raise SystemExit(f"--graph-groups: unknown {sorted(set(groups) - set(GRAPH_CONFIGS))}; "
                         f"known: {', '.join(GRAPH_CONFIGS)}")
    if args.preset == "rank":
        cfg = rank_config()
    else:
        from k31c.model.presets import get_preset
        cfg = get_preset("k31-tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    doc["preset"] = {"name": cfg.name, **{k: getattr(cfg, k) for k in (
        "hidden_size", "num_hidden_layers", "full_attn_layers", "kda_num_heads", "num_attention_heads",
        "num_experts", "num_experts_per_token", "vocab_size", "index_topk", "experts_format")}}
    over = lambda: time.time() - rep.t0 > args.budget_s  # noqa: E731
    st = {}
    if args.records != "none":
        from autotune_cache.policy import MissPolicy
        from autotune_cache.records import CacheStore

        store = CacheStore() if args.records == "device" else CacheStore(args.records)
        st["tuning"] = MissPolicy("fallback", store, target="h200")
        doc["tuning_store"] = {"path": store.path, "records": len(store.records())}

    @rep.section
    def bandwidth():
        if not cuda:
            return doc["ceilings"].update(bandwidth_GBps=10.0, read_GBps=10.0)  # CPU logic check: nominal ceilings
        from benches._read_ceiling import read_bandwidth_GBps
        doc["ceilings"]["bandwidth_GBps"] = copy_bandwidth_GBps(dev)
        doc["ceilings"]["read_GBps"] = read_bandwidth_GBps(dev)

    @rep.section
    def build():
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg.to_hf(), f)
        plan = plan_options(d, target="h200")
        t = time.time()
        art, _ = compile_model(cfg, None, os.path.join(d, "art"), CompileOptions(plan=plan), model_source="bench")
        st["art"], st["plan"] = art, plan
        st["weights"] = device_weights(cfg, dev) if cuda else __import__(
            "k31c.model.init_weights", fromlist=["random_weights"]).random_weights(cfg, 0)
        doc["build_s"] = time.time() - t
        doc["kernel_families"] = sorted({c.template.family for c in art.choices if c.template})

    def compile_variant(disable: tuple[str, ...]):
        """The rank preset compiled again with the passes `disable` off (same plan)."""
        d = tempfile.mkdtemp()
        return compile_model(cfg, None, os.path.join(d, "art"), CompileOptions(plan=st["plan"], disable=disable),
                             model_source="bench")[0]

    def runtime(ctx, n_req, graphs=True, engine="compiled", ref_dtype=None):
        art, w = st["art"], st["weights"]
        if engine == "compiled":
            # with a tuning store, every bucket resolves through it (record, else the heuristic, counted):
            # the fresh artifact's configs are compile-time heuristics that would shadow the records
            eng = Executor(art.module, w, art.choices, target="h200", compute_dtype=dtype, device=args.device,
                           configs=art.configs if "tuning" not in st else {}, cuda_graphs=graphs,
                           tuning=st.get("tuning"))
            rt = GraphedRuntime(art.module, w, max_rows=n_req * ctx, max_requests=n_req, engine=eng)
        else:
            rt = ReferenceRuntime(build_module(cfg, build_options(st["plan"])), w, max_rows=n_req * ctx,
                                  max_requests=n_req, compute_dtype=ref_dtype or dtype, device=args.device)
        fill_random(rt, {f"r{i}": (ctx - 4 * args.steps - 8, ctx) for i in range(n_req)})
        return rt

    def refill(rt, rnd):
        """New random cache and state contents (seed 100 + rnd) for the requests the runtime holds."""
        fill_pools(rt, 100 + rnd)

    def reset(rt, ctx):
        for r in rt.requests.values():
            r.length = ctx - 4 * args.steps - 8

    def floors(nbytes, ms):
        """The step's byte floors (ms) under the copy and the read bandwidth, and `ms` over each."""
        f, fr = (nbytes / (doc["ceilings"][k] * 1e9) * 1e3 for k in ("bandwidth_GBps", "read_GBps"))
        return {"floor_ms": f, "x_floor": ms / f, "floor_read_ms": fr, "x_floor_read": ms / fr}

    def measure(name, rt, ctx, b, extra, steps=None):
        toks = {f"r{i}": (7 * i + 3) % cfg.vocab_size for i in range(b)}
        time_ms(lambda: rt.decode(toks), 2, dev)  # warm-up (kernel compilation, graph capture)
        ts = sorted(time_ms(lambda: rt.decode(toks), steps or args.steps, dev))
        reset(rt, ctx)
        by = step_bytes(rt, cfg, st["weights"], b, ctx)
        m = {"name": name, "context": ctx, "batch": b, "median_ms": ts[len(ts) // 2], "min_ms": ts[0], **by,
             **floors(by["total_bytes"], ts[len(ts) // 2]), **extra}
        doc["measurements"].append(m)
        print(json.dumps(m), flush=True)
        return m

    @rep.section
    def graph_check():
        ctx, b = contexts[0], min(args.check_batch, max(batches))
        rt = runtime(ctx, b)
        toks = {f"r{i}": (5 * i + 1) % cfg.vocab_size for i in range(b)}
        graphs, eager = graph_and_eager(rt, toks, graphs=cuda, repeats=args.check_replays)
        graph = graphs[-1]
        doc["graph_check"] = {"context": ctx, "batch": b, "rel_err_graph_vs_eager": rel(graph, eager),
                              "bitwise_equal": bool(torch.equal(graph, eager)), "replays": len(graphs),
                              "replays_bitwise_equal": sum(bool(torch.equal(g_, eager)) for g_ in graphs),
                              "pdl": _pdl.enabled(), "runtime_stats": rt.stats(),
                              "overlapped_nodes": rt.interp.stats()["overlapped_nodes"]}
        print(json.dumps(doc["graph_check"], default=str), flush=True)

    @rep.section
    def decode():
        for ctx in contexts:
            if over():
                doc["notes"].append(f"decode at context {ctx} skipped: over the time budget")
                continue
            rt = runtime(ctx, max(batches))
            for b in batches:
                for name in variants:
                    g, in_graph, pdl = DECODE_VARIANTS[name]
                    if not cuda and name != "eager":
                        continue
                    if rt.metadata_in_graph != in_graph or _pdl.enabled() != pdl:  # another prologue / launch kind
                        rt.metadata_in_graph = in_graph
                        _pdl.set_enabled(pdl)
                        rt.drop_graphs()
                    rt.use_graphs = g and cuda
                    measure(f"decode_compiled_{name}", rt, ctx, b,
                            {"graphs": g and cuda, "metadata_in_graph": in_graph, "pdl": pdl})
                _pdl.set_enabled(True)
            doc.setdefault("graph_stats", {})[str(ctx)] = rt.stats()
            doc.setdefault("kernel_stats", {})[str(ctx)] = rt.interp.stats()
            del rt
            if cuda:
                torch.cuda.empty_cache()

    def replay_us(rt, b, n=30, ahead_cycles=0):
        """(median device time (µs, CUDA events) of n replays of the captured decode graph of batch b, that
        graph, its block-table width bucket). ahead_cycles > 0: each replay behind a `torch.cuda._sleep` of that
        many cycles, so the host has submitted the graph before the device reaches the first event (device time
        only; without it the events also see the graph launch's submission)."""
        toks = {f"r{i}": (7 * i + 3) % cfg.vocab_size for i in range(b)}
        rt.replays.clear()
        rt.decode(toks)  # captures the bucket's graph and fills its static inputs
        (B, W), = rt.replays
        g = rt.graphs[(B, W)]
        out = graph_replay_us(g.graph, n, ahead_cycles)
        return sorted(out)[n // 2], g, W

    def record_replay(rt, ctx, b, name, rnd, ahead_cycles=0):
        """One measurement: the median device time of batch b's graph replay (replay_us), recorded and printed."""
        m = {"name": name, "context": ctx, "batch": b, "round": rnd,
             "replay_us": replay_us(rt, b, ahead_cycles=ahead_cycles)[0], "ahead_cycles": ahead_cycles}
        reset(rt, ctx)
        doc["measurements"].append(m)
        print(json.dumps(m), flush=True)

    def set_heuristic(family: str, h=None):
        """Replace kernel family `family`'s declared heuristic by h (None: leave it) and make the tuning policy resolve
        every bucket again; returns the heuristic it had."""
        from codegen.registry import all_templates
        t = next(t for t in all_templates() if t.family == family)
        before = t.heuristic
        if h is not None:
            object.__setattr__(t, "heuristic", h)
            if "tuning" in st:
                st["tuning"].forget()
        return before

    def alternate(name: str, switch, settings=(("on", True), ("off", False)), at=lambda b: b <= 8, rounds=2,
                  ahead_cycles=0, before_round=None):
        """The device time of the same decode graph captured under each of `settings` (label, value: `switch(rt,
        value)` before the capture; default on / off), alternated `rounds` times (default 2) per batch of `at`
        (default <= 8) at the first context (drift shows as a difference between the rounds); the first setting is
        restored after. ahead_cycles:
        each replay behind a sleep (`replay_us`: device time only, whatever the host's speed). before_round(rt, round):
        called before each round's settings."""
        ctx = contexts[0]
        rt = runtime(ctx, max(b for b in batches if at(b)))
        try:
            for b in [x for x in batches if at(x)]:
                for rnd in range(rounds):
                    if before_round is not None:
                        before_round(rt, rnd)
                    for label, value in settings:
                        switch(rt, value)
                        rt.drop_graphs()
                        record_replay(rt, ctx, b, f"graph_replay_{name}_{label}", rnd, ahead_cycles)
        finally:
            switch(rt, settings[0][1])
        del rt
        torch.cuda.empty_cache()

    @rep.section
    def pdl():
        """Programmatic dependent launch on vs off (`codegen/triton/_pdl.py`)."""
        if not cuda:
            return doc["notes"].append("pdl: needs a cuda device (CUDA events, sm_90+)")
        alternate("pdl", lambda rt, on: _pdl.set_enabled(on))

    @rep.section
    def late():
        """The routed experts' gate-up kernel (decode GEMV path) launched with its programmatic edge (resident
        early, waiting for z) vs without (LATE=1, `codegen/triton/_moe_gemv_words.py`)."""
        if not cuda:
            return doc["notes"].append("late: needs a cuda device (PDL)")
        from codegen.triton import _moe_gemv_words
        alternate("late", lambda rt, v: _moe_gemv_words.set_late_override(v), (("config", None), ("early", 0),
                                                                                ("late", 1)))

    @rep.section
    def attn_early():
        """The attention-residual kernels reading their bank rows and running prefix before the PDL wait (EARLY,
        `codegen/triton/attn_res.py`) vs after it."""
        if not cuda:
            return doc["notes"].append("attn_early: needs a cuda device (PDL)")
        from codegen.triton import attn_res
        alternate("attn_early", lambda rt, on: attn_res.set_early(on))

    @rep.section
    def overlap():
        """Side stream on vs off: the nodes annotated `overlap` (MLA query beside the indexer, MoE router and
        shared expert beside the routed experts' chain) on the executor's second stream, or in order."""
        if not cuda:
            return doc["notes"].append("overlap: needs a cuda device (streams)")
        alternate("overlap", lambda rt, on: rt.interp.set_overlap(on))

    @rep.section
    def priority():
        """The graph's main stream captured at the highest priority vs at the side stream's (cuda_graphs.py,
        "Priorities")."""
        if not cuda:
            return doc["notes"].append("priority: needs a cuda device (streams)")
        alternate("priority", lambda rt, on: rt.set_main_priority(on))

    @rep.section
    def trace_start():
        """Where the ~7 µs before the step's second kernel comes from: `trace` with PDL off, and with the step
        metadata expanded before the replay instead of by the graph's first node."""
        from codegen.triton import _pdl
        was = _pdl.set_enabled(False)
        try:
            trace("_nopdl")
        finally:
            _pdl.set_enabled(was)

        def outside(rt):
            rt.metadata_in_graph = False
            rt.drop_graphs()
        trace("_meta_outside", setup=outside)

    @rep.section
    def ahead():
        """The decode graph's replay timed alone (event, replay, event: the device idles while the host submits the
        graph) vs behind a ~1 ms sleep kernel (the host has submitted it before the device gets there: device time
        only), batch 1 and 8, two rounds; then `trace` behind the sleep (suffix `_ahead`)."""
        if not cuda:
            return doc["notes"].append("ahead: needs a cuda device")
        ctx = contexts[0]
        rt = runtime(ctx, 8)
        for rnd in range(2):
            for label, cyc in (("isolated", 0), ("ahead", AHEAD_CYCLES)):
                for b in [x for x in batches if x <= 8]:
                    m = {"name": f"graph_replay_{label}", "context": ctx, "batch": b, "round": rnd,
                         "replay_us": replay_us(rt, b, ahead_cycles=cyc)[0]}
                    reset(rt, ctx)
                    doc["measurements"].append(m)
                    print(json.dumps(m), flush=True)
        del rt
        torch.cuda.empty_cache()
        trace("_ahead", ahead_cycles=AHEAD_CYCLES)

    @rep.section
    def gluon():
        """The routed experts' decode GEMVs on the tensor cores (GLUON, `codegen/triton/_moe_gemv_gluon.py`: the
        heuristic's on sm_90+) vs the FFMA GV=2 kernels (GLUON removed from the heuristic's config), alternated."""
        if not cuda:
            return doc["notes"].append("gluon: needs a cuda device")
        base = set_heuristic("moe_grouped_gemm")

        def ffma(key, target):
            return {k: v for k, v in base(key, target).items() if k not in ("GLUON", "GKS", "GNW", "GKS2", "GNW2")}
        try:
            alternate("gluon", lambda rt, h: set_heuristic("moe_grouped_gemm", h),
                      settings=(("on", base), ("off", ffma)))
        finally:
            set_heuristic("moe_grouped_gemm", base)

    @contextlib.contextmanager
    def pdl_counted():
        """`_pdl._enabled` replaced by a PdlWindow (every launch programmatic until its window is set), restored
        after."""
        calls = PdlWindow(0, 10 ** 9)
        before = _pdl._enabled
        _pdl._enabled = calls
        try:
            yield calls
        finally:
            _pdl._enabled = before

    def launches_per_step(calls, rt, ctx, b) -> int:
        """The decode step's `launch_kwargs` calls at batch b, counted over a fresh capture (warm-up x2 + capture)."""
        calls.window(0, 10 ** 9, 10 ** 9)
        rt.drop_graphs()
        rt.replays.clear()
        rt.decode({f"r{i}": 3 for i in range(b)})
        reset(rt, ctx)
        return calls.n // 3

    @rep.section
    def pdl_window():
        """Which programmatic launches make the decode graph's second kernel start ~7 µs late: the graph captured
        with PDL for every launch but those whose index in the step (counted over `_pdl.launch_kwargs` calls; the
        metadata kernel makes none) is listed, then `trace`d (suffix `_plain_<indices>`), batch 1 in two rounds,
        then batch 8 for none and (1,)."""
        if not cuda:
            return doc["notes"].append("pdl_window: needs a cuda device (PDL)")
        ctx = contexts[0]
        with pdl_counted() as calls:
            for b, rounds, plains in ((1, 2, ((), (1,), (0, 1), (1, 2), (0,), (2,))), (8, 1, ((), (1,)))):
                rt = runtime(ctx, b)
                per = launches_per_step(calls, rt, ctx, b)
                doc["notes"].append(f"pdl_window batch {b}: {per} launch_kwargs calls a step")
                for rnd in range(rounds):
                    for plain in plains:
                        calls.window(0, per, per, plain)
                        label = "_".join(map(str, plain)) or "none"
                        trace(f"_plain_{label}_r{rnd}", setup=lambda r: r.drop_graphs(), batches_=(b,), rt_=rt)
                        doc["notes"].append(f"pdl_window batch {b} plain {plain}: {calls.on} of {calls.n} on")
                del rt
                torch.cuda.empty_cache()

    @rep.section
    def pdl_plain_sweep():
        """Each launch of the batch-1 decode step (its index among the step's `_pdl.launch_kwargs` calls) captured
        without its programmatic edge, one at a time (or the sets of --pdl-plain-sets), vs every launch
        programmatic: graph replay device time (behind
        a sleep), --graph-rounds rounds alternated. A launch that gains when plain holds SM slots while it waits that
        the kernel before it could use (the routed experts' LATE, _moe_gemv_words.py)."""
        if not cuda:
            return doc["notes"].append("pdl_plain_sweep: needs a cuda device (PDL)")
        ctx = contexts[0]
        with pdl_counted() as calls:
            rt = runtime(ctx, 1)
            per = launches_per_step(calls, rt, ctx, 1)
            doc["notes"].append(f"pdl_plain_sweep: {per} launch_kwargs calls a step")
            sets = [tuple(int(i) for i in x.split(",")) for x in args.pdl_plain_sets.split(";") if x] or \
                [(i,) for i in range(per)]
            for rnd in range(args.graph_rounds):
                for plain in ((), *sets):
                    calls.window(0, per, per, plain)
                    rt.drop_graphs()
                    record_replay(rt, ctx, 1, f"graph_replay_plain_{'_'.join(map(str, plain)) or 'none'}", rnd,
                                  AHEAD_CYCLES)
            del rt
            torch.cuda.empty_cache()

    @rep.section
    def head_sleep():
        """Where the ~7 µs stall at the decode graph's start comes from: a spin kernel (benches/bench_pdl_chain.py's
        `_tick_kernel`, one program; `pdl`: compiled with the PDL instructions and launched programmatically, else
        neither) captured into the batch-1 graph before or after the metadata kernel, for various lengths, each
        traced (suffix `_sleep_<where>_<us>[_pdl]`). A fixed setup time from the graph's launch would hide behind a
        long first node; a stall tied to a launch would not."""
        if not cuda:
            return doc["notes"].append("head_sleep: needs a cuda device")
        from benches.bench_pdl_chain import _tick_kernel
        from k31c.runtime.step_metadata import GraphMetadata

        expand = GraphMetadata.expand
        stamps = torch.zeros(3, dtype=torch.int64, device=dev)

        def tick(us, pdl):
            _tick_kernel[(1,)](stamps, 0, int(us * 1e3), PDL=pdl, launch_pdl=pdl)

        def variant(where, us, pdl):
            def fn(self, out):
                if where == "before":
                    tick(us, pdl)
                r = expand(self, out)
                if where == "after":
                    tick(us, pdl)
                return r
            return fn
        ctx = contexts[0]
        rt = runtime(ctx, 1)
        try:
            for where, us, pdl in (("none", 0, False), ("before", 20, False), ("before", 10, False),
                                   ("before", 5, False), ("after", 20, False), ("after", 2, False),
                                   ("after", 2, True), ("before", 2, True)):
                GraphMetadata.expand = variant(where, us, pdl) if where != "none" else expand
                trace(f"_sleep_{where}_{us}{'_pdl' if pdl else ''}", setup=lambda r: r.drop_graphs(), batches_=(1,),
                      rt_=rt)
        finally:
            GraphMetadata.expand = expand
        del rt
        torch.cuda.empty_cache()

    @rep.section
    def carveout():
        """Every loaded Triton kernel's preferred shared-memory carveout (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_
        CARVEOUT) left as Triton set it (default: the driver's choice, max-shared for kernels above 48 KB) vs all at
        100% shared, so consecutive kernels never need the SM's L1 / shared split changed; alternated, then `trace`
        at 100% (suffix `_carveout`)."""
        if not cuda:
            return doc["notes"].append("carveout: needs a cuda device")
        originals: dict = {}

        def switch(rt, pct):
            n = set_carveout(pct, originals)
            doc["notes"].append(f"carveout {pct}: {n} kernels")
        alternate("carveout", switch, settings=(("default", None), ("max_shared", 100)))
        trace("_carveout", setup=lambda rt: switch(rt, 100))
        switch(None, None)

    @rep.section
    def l2fetch():
        """The context's L2 fetch granularity (`k31c/runtime/l2_fetch.py`, context-wide; the runtime sets 128 bytes)
        at 128 with the routed experts' grouped gate-up in Gluon (`_moe_configs.GLUON_T64`, the heuristic's at T=64),
        at the driver's 64 and at 128 bytes with it in Triton (TMA, DECODE_T64): graph replay device time at every
        batch, two rounds."""
        if not cuda:
            return doc["notes"].append("l2fetch: needs a cuda device")
        from codegen.triton._moe_configs import GLUON_T64
        from k31c.runtime.l2_fetch import RUNTIME_BYTES, l2_fetch_granularity
        base = set_heuristic("moe_grouped_gemm")

        def triton_t64(key, target):
            return {k: v for k, v in base(key, target).items() if k not in GLUON_T64}

        def switch(rt, setting):
            l2_fetch_granularity(setting[0])
            set_heuristic("moe_grouped_gemm", setting[1])
        alternate("l2fetch", switch, (("128_gg", (RUNTIME_BYTES, base)), ("64", (64, triton_t64)),
                                      ("128", (128, triton_t64))), at=lambda b: True)

    @rep.section
    def mla_orient():
        """Batch 64 (and 8) at the first context: the sparse MLA's default (session 15: ORIENT 3, the Gluon kernel
        `_mla_gluon.py`, where it applies) vs session 13-14's ORIENT 2 config (`_mla_rowsm.py`) for the same shapes,
        graph replay device time, two rounds."""
        if not cuda:
            return doc["notes"].append("mla_orient: needs a cuda device")
        base = set_heuristic("mla_sparse")

        def orient2(key, target):
            cfg = base(key, target)
            if cfg.get("ORIENT") == 3:   # session 14's rule: two pieces per SM over the tokens' head blocks
                pieces = max(1, (2 * 132) // (key["T"] * -(-max(1, key.get("H", 16)) // 16)))
                chunk = min(16384, max(64, 1 << max(0, (-(-key["L"] // pieces) - 1).bit_length())))
                cfg = dict(ORIENT=2, BLOCK_H=16, BLOCK_N=64, KB=128, num_warps=4, num_stages=3, PREFETCH=1, CHUNK=chunk)
            return cfg
        alternate("mla", lambda rt, h: set_heuristic("mla_sparse", h), (("default", base), ("orient2", orient2)),
                  at=lambda b: b >= 8)

    @rep.section
    def graph_configs():
        """Kernel configs chosen inside the decode graph: per group of GRAPH_CONFIGS, batch 1 at the first context, the
        graph captured under each setting (family -> overrides of the config the tuning store resolves, record or
        heuristic, where GRAPH_MATCH holds for the bucket's key) and its replay timed (device time: behind a sleep),
        alternated --graph-rounds times with the unchanged configs (`alternate`). Session 18 chose the batch-1
        defaults of moe_grouped_gemm, moe_latent_tail, attn_res_mix_norm and kda_decode this way."""
        if not cuda or "tuning" not in st:
            return doc["notes"].append("graph_configs: needs a cuda device and a tuning store (--records)")
        pol = st["tuning"]
        resolve = pol.config
        current: dict = {}

        def config(t, key):
            c = resolve(t, key)
            if not GRAPH_MATCH.get(t.family, _T1)(key):
                return c
            for over in _overrides(current.get(t.family)):  # each a config override, "_key": the bucket it is for
                if all(key.get(k) == v for k, v in over.get("_key", {}).items()):
                    c = {**c, **{k: v for k, v in over.items() if k != "_key"}}
            return c

        def switch(rt, setting):
            current.clear()
            current.update(setting)
        pol.config = config
        try:
            for group in groups:
                alternate(f"cfg_{group}", switch, (("resolved", {}), *GRAPH_CONFIGS[group].items()),
                          at=lambda b: b == 1, rounds=args.graph_rounds, ahead_cycles=AHEAD_CYCLES,
                          before_round=refill if args.refill_rounds else None)
        finally:
            del pol.config

    @rep.section
    def graph_tune():
        """`k31c tune --in-graph`'s search (autotune_cache/graph_tune.py) on the rank preset: batch 1 at the first
        context, every tunable site of the step (--graph-tune-kernels: only these families; GRAPH_TUNE_TRIES: more
        candidates), --graph-rounds confirming pairs, --graph-tune-budget-s; records to --graph-tune-store."""
        from autotune_cache import graph_tune as gt
        from autotune_cache.records import CacheStore, Environment

        if not cuda or "tuning" not in st:
            return doc["notes"].append("graph_tune: needs a cuda device and a tuning store (--records)")
        ctx = contexts[0]
        rt = runtime(ctx, 1)
        reset(rt, ctx)
        timer = gt.StepTimer(rt, 1, cfg.vocab_size)
        sites = gt.tunable_sites(timer, kernels=[f for f in args.graph_tune_kernels.split(",") if f],
                                 tries=GRAPH_TUNE_TRIES)
        t0 = time.perf_counter()
        measure = gt.timed_measure(timer)
        chosen, trials = gt.search(sites, measure, target="h200", tries=GRAPH_TUNE_TRIES,
                                   rounds=args.graph_rounds, min_gain_us=args.graph_tune_min_gain_us,
                                   span=args.graph_tune_span, launch_tries=gt.LAUNCH_TRIES if args.graph_tune_plain else (),
                                   deadline=t0 + args.graph_tune_budget_s, say=lambda m: print(m, flush=True))
        fin = gt.final(measure, chosen, max(args.graph_rounds, 4))
        recs = gt.records_for(sites, chosen, trials,
                              created_by="bench_runtime_gpu.py --sections graph_tune (k31c tune --in-graph's search)",
                              env=Environment.current())
        if args.graph_tune_store:
            CacheStore(args.graph_tune_store).put_many(recs)
        doc["graph_tune"] = {"context": ctx, "batch": 1, "seconds": time.perf_counter() - t0,
                             "sites": [{"bid": s_.bid, "config": s_.config, "launches": s_.launches} for s_ in sites],
                             "trials": [t.to_json() for t in trials], "accepted": chosen, "final": fin,
                             "store": args.graph_tune_store, "records": [r.key for r in recs]}
        print(json.dumps({"graph_tune_final": fin, "accepted": chosen}, default=str), flush=True)
        del rt
        torch.cuda.empty_cache()

    def compare_artifacts(name: str, disabled: dict):
        """The default artifact and one compiled per entry of `disabled` (label -> passes turned off), each
        captured in this run, every batch at the first context, two rounds (device time of the graph replay)."""
        ctx = contexts[0]
        default = st["art"]
        variants = {"default": default, **{label: compile_variant(off) for label, off in disabled.items()}}
        for rnd in range(2):
            for label, art in variants.items():
                st["art"] = art
                rt = runtime(ctx, max(batches))
                for b in batches:
                    record_replay(rt, ctx, b, f"graph_replay_{name}_{label}", rnd)
                del rt
                torch.cuda.empty_cache()
        st["art"] = default

    @rep.section
    def schedule():
        """The MoE layers' stream schedule: `default` (z alone on the main stream, router + shared expert on the
        side, passes/overlapped_moe_branches.py) and `packed` (moe_expert_input_split disabled: z packed with the
        shared expert's gate/up, router beside it, shared down beside the experts; the session-10 schedule).
        Session 11 also timed the router on the main stream just before z: batch 1 570.5-581.5 us vs split
        560.3-568.9, batch 8 no difference (reverted)."""
        if not cuda:
            return doc["notes"].append("schedule: needs a cuda device (streams)")
        compare_artifacts("schedule", {"packed": ("moe_expert_input_split",)})

    @rep.section
    def absorb():
        """The MLA query absorption beside the indexer (`default`, passes/query_absorption.py) vs inside the
        attention node after the indexer's top-k (`inside`: the pass disabled)."""
        if not cuda:
            return doc["notes"].append("absorb: needs a cuda device (streams)")
        compare_artifacts("absorb", {"inside": ("query_absorption",)})

    @rep.section
    def nodes():
        """Device time per node of the graphed decode step at the first context, batch 1 and 8: the step run
        as its graph was captured (static inputs, `static_context`) behind a head start so that events time
        the device only (benches/_node_profile.py), and the graph's own replay time for comparison."""
        if not cuda:
            return doc["notes"].append("nodes: needs a cuda device (CUDA events)")
        from benches._node_profile import node_times, summarize

        ctx = contexts[0]
        rt = runtime(ctx, 8)
        eng = rt.interp
        for b in (1, 8):
            replay, g, W = replay_us(rt, b)
            eng.static_context = W * rt.block_size
            try:
                rows, ahead = node_times(eng, lambda: eng.run("decode", {**g.inputs, **rt.pools}), head_start_ms=80)
            finally:
                eng.static_context = None
            reset(rt, ctx)
            doc.setdefault("nodes", {})[f"{ctx}_b{b}"] = {
                "graph_replay_us": replay, "host_ahead": ahead,
                **summarize(rows, doc["ceilings"]["bandwidth_GBps"])}
        del rt, eng
        torch.cuda.empty_cache()

    @rep.section
    def trace(suffix="", setup=None, ahead_cycles=0, batches_=(1, 8), rt_=None):
        """The decode graph of batch 1 and 8 at the first context, kernel by kernel under the profiler
        (benches/_graph_trace.py): durations, the device's idle gaps between kernels, two-stream overlap."""
        if not cuda:
            return doc["notes"].append("trace: needs a cuda device (CUPTI)")
        from benches._graph_trace import graph_node_kinds, graph_trace

        ctx = contexts[0]
        rt = rt_ if rt_ is not None else runtime(ctx, 8)
        if setup is not None:
            setup(rt)
        for b in batches_:
            replay, g, _ = replay_us(rt, b, ahead_cycles=ahead_cycles)
            t = graph_trace(g.graph, ahead_cycles=ahead_cycles)
            if b == 1 and os.environ.get("OUT") and not suffix:  # the graph's nodes (kernels, memcpy/memset, events)
                try:
                    t["graph_nodes"] = graph_node_kinds(rt, b, os.path.join(os.environ["OUT"], f"graph_b{b}.dot"))
                except Exception as e:  # the dump is a diagnostic: keep the trace
                    t["graph_nodes"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            reset(rt, ctx)
            doc.setdefault("trace", {})[f"{ctx}_b{b}{suffix}"] = {"graph_replay_us": replay, **t}
            print(json.dumps({k: v for k, v in t.items() if k not in ("kernels", "by_name")}), flush=True)
        if rt_ is None:
            del rt
            torch.cuda.empty_cache()

    @rep.section
    def trace_late():
        """`trace` with the routed experts' gate-up launched without its programmatic edge (LATE=1)."""
        from codegen.triton import _moe_gemv_words
        before = _moe_gemv_words.set_late_override(1)
        try:
            trace("_late")
        finally:
            _moe_gemv_words.set_late_override(before)

    @rep.section
    def host():
        """Where a graphed decode step's wall time goes at the first context, batch 1 and 8 (µs, medians of
        50): validating the step (`check_step`), writing the graph's pinned metadata buffer, the host cost of
        launching the replay and of the logits copy, the whole step between synchronisations, and the
        replay's device time; host overhead = step - device (the step: 30 decodes after a length reset)."""
        if not cuda:
            return doc["notes"].append("host: needs a cuda device")
        from k31c.runtime.cuda_graphs import bucket_for, width_bucket
        from k31c.runtime.step_metadata import check_step

        ctx = contexts[0]
        rt = runtime(ctx, 8)

        def med(fn, n=50, sync=False):
            ts = []
            for _ in range(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                if sync:
                    torch.cuda.synchronize()
                ts.append((time.perf_counter() - t) * 1e6)
            return sorted(ts)[n // 2]

        for b in (1, 8):
            toks = {f"r{i}": (7 * i + 3) % cfg.vocab_size for i in range(b)}
            chunks = {rid: [t] for rid, t in toks.items()}
            rt.decode(toks)
            rows = check_step(rt, "decode", chunks)
            g = rt.graphs[(bucket_for(len(rows), rt.buckets), width_bucket(max(len(r[2]) for r in rows)))]
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

            def device_us():
                ev[0].record()
                g.graph.replay()
                ev[1].record()
                ev[1].synchronize()
                return ev[0].elapsed_time(ev[1]) * 1e3

            row = {"context": ctx, "batch": b,
                   "check_step_us": med(lambda: check_step(rt, "decode", chunks)),
                   "metadata_write_us": med(lambda: g.metadata.write(rows)) if g.metadata else None,
                   "replay_launch_us": med(g.graph.replay), "logits_clone_us": med(lambda: g.logits[:b].clone()),
                   "step_us": (reset(rt, ctx), med(lambda: rt.decode(toks), n=30, sync=True))[1],
                   "device_us": sorted(device_us() for _ in range(50))[25]}
            row["host_overhead_us"] = row["step_us"] - row["device_us"]
            reset(rt, ctx)
            doc.setdefault("host", []).append(row)
            print(json.dumps(row), flush=True)
        del rt
        torch.cuda.empty_cache()

    @rep.section
    def engine_decode():
        """What a caller of the serving engine gets: real prompts of the first context length prefilled
        through the engine, then the wall time per decode step (ms; sampling on the device, ids read by the
        host, stop checks) over --engine-steps steps, synchronous vs asynchronous decode (step N+1 launched on step N's
        device-side ids before the host reads them); both must produce the same greedy tokens."""
        from k31c.runtime.engine import Engine
        from k31c.runtime.sampling import SamplingParams

        ctx, steps = contexts[0], args.engine_steps
        g = torch.Generator().manual_seed(3)
        for b in [x for x in (1, 8) if x in batches] or batches[:1]:
            if over():
                doc["notes"].append(f"engine_decode batch {b} skipped: over the time budget")
                continue
            art, w = st["art"], st["weights"]
            eng_x = Executor(art.module, w, art.choices, target="h200", compute_dtype=dtype, device=args.device,
                             configs=art.configs if "tuning" not in st else {}, cuda_graphs=cuda,
                             tuning=st.get("tuning"))
            rt = GraphedRuntime(art.module, w, max_rows=b * ctx, max_requests=b, engine=eng_x)
            prompts = [torch.randint(0, cfg.vocab_size, (ctx - 2 * steps - 8,), generator=g).tolist() for _ in range(b)]
            tokens = {}
            for mode in ("sync", "async", "sync_again"):
                eng = Engine(rt, max_batched_tokens=ctx, prefill_chunk=ctx, async_decode=mode == "async")
                for i, p_ in enumerate(prompts):
                    eng.add_request(f"q{i}", p_, SamplingParams(max_new_tokens=steps + 8))
                done = {}

                def step():
                    done.update({o.rid: o.tokens for o in eng.step() if o.finished})

                while any(not s.output for s in eng.seqs.values()) or eng.waiting:
                    step()  # prefill and the first token of every request
                for _ in range(2):
                    step()  # warm-up: graph capture of this bucket
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(steps):
                    step()
                ms = (time.perf_counter() - t) * 1e3 / steps
                while eng.has_unfinished():
                    step()
                tokens[mode] = done
                m = {"name": f"engine_decode_{mode}", "context": ctx, "batch": b, "ms_per_step": ms,
                     "tokens_per_s": b * 1e3 / ms, "counters": dict(eng.counters)}
                doc["measurements"].append(m)
                print(json.dumps(m), flush=True)
            doc.setdefault("engine_decode_same_tokens", {})[str(b)] = {
                "sync_vs_async": tokens["sync"] == tokens["async"], "sync_vs_sync_again": tokens["sync"] == tokens["sync_again"],
                "first_difference": {rid: next((i for i, (x, y) in enumerate(zip(t, tokens["async"].get(rid, []))) if x != y),
                                               None) for rid, t in tokens["sync"].items()}}
            del rt, eng_x
            if cuda:
                torch.cuda.empty_cache()

    @rep.section
    def replay_stream():
        """Device time per decode step when the batch's graph is replayed back to back (--stream-replays replays between
        two events, no host synchronisation between them: a serving loop that keeps the device fed) vs one replay
        behind a sleep (replay_us, the figure graph_configs compares), three rounds each, every batch at the first
        context."""
        if not cuda:
            return doc["notes"].append("replay_stream: needs a cuda device")
        ctx, k = contexts[0], args.stream_replays
        rt = runtime(ctx, max(batches))
        for b in batches:
            for rnd in range(3):
                iso, g, _ = replay_us(rt, b, ahead_cycles=AHEAD_CYCLES)
                s_, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(AHEAD_CYCLES)
                s_.record()
                for _ in range(k):
                    g.graph.replay()
                e_.record()
                e_.synchronize()
                reset(rt, ctx)
                m = {"name": "replay_stream", "context": ctx, "batch": b, "round": rnd, "isolated_us": iso,
                     "stream_us_per_step": s_.elapsed_time(e_) * 1e3 / k, "stream_replays": k}
                doc["measurements"].append(m)
                print(json.dumps(m), flush=True)
        del rt
        torch.cuda.empty_cache()

    @rep.section
    def reference_peer():
        """The reference interpreter in the bench dtype; if it cannot run in bf16 (at HEAD its `linear` does not
        promote the f32 router input against the bf16 gate weight) it is run in fp32, and the note says so."""
        ref_dtype = dtype
        for ctx in contexts:
            if over():
                doc["notes"].append(f"reference peer at context {ctx} skipped: over the time budget")
                continue
            for b in batches:
                rt = runtime(ctx, b, engine="reference", ref_dtype=ref_dtype)
                try:
                    measure("decode_reference_eager", rt, ctx, b, {"graphs": False, "dtype": str(ref_dtype)}, steps=3)
                except Exception as e:
                    if ref_dtype == torch.float32:
                        raise
                    doc["notes"].append(f"reference interpreter in {ref_dtype} failed ({type(e).__name__}: "
                                        f"{str(e)[:200]}); the reference peer runs in float32")
                    ref_dtype = torch.float32
                    del rt
                    rt = runtime(ctx, b, engine="reference", ref_dtype=ref_dtype)
                    measure("decode_reference_eager", rt, ctx, b, {"graphs": False, "dtype": str(ref_dtype)}, steps=3)
                del rt
                if cuda:
                    torch.cuda.empty_cache()

    @rep.section
    def prefill():
        for n in contexts:
            if over():
                doc["notes"].append(f"prefill of {n} skipped: over the time budget")
                continue
            rt = runtime(n + 64, 2)
            toks = torch.randint(0, cfg.vocab_size, (n,)).tolist()
            for r in rt.requests.values():
                r.length = 0
            rt.prefill({"r1": toks})  # warm-up at the same shapes: kernel compilation and config buckets
            times = []
            for _ in range(args.prefill_repeats):  # the same prompt prefilled again from position 0
                rt.requests["r0"].length = 0
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                rt.prefill({"r0": toks})
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            s = sorted(times)[len(times) // 2]
            m = {"name": "prefill_compiled", "tokens": n, "seconds": s, "tokens_per_s": n / s,
                 "seconds_each": times}
            doc["measurements"].append(m)
            print(json.dumps(m), flush=True)
            del rt
            if cuda:
                torch.cuda.empty_cache()

    @rep.section
    def torch_compile_peer():
        if over():
            doc["notes"].append("torch.compile peer skipped: over the time budget")
            return
        from ir.interpreter import Interpreter

        ctx, b = contexts[0], 1
        rt = runtime(ctx, b, engine="reference")
        interp = Interpreter(rt.module, st["weights"], dtype, args.device, check_shapes=False)
        meta = rt._metadata("decode", {"r0": [3]})

        def timeout(*_):
            raise TimeoutError(f"torch.compile did not finish in {args.compile_timeout_s} s")

        fn, mode = None, None
        for suppress in [m == "suppress" for m in args.compile_modes.split(",")]:  # strict; then failing frames eager
            torch._dynamo.reset()
            torch._dynamo.config.suppress_errors = suppress
            f = torch.compile(lambda m, p: interp.run("decode", {**m, **p})[0])
            old = signal.signal(signal.SIGALRM, timeout)
            signal.alarm(args.compile_timeout_s)
            try:
                t = time.time()
                f(meta, rt.pools)
                doc[f"torch_compile_s_suppress_{suppress}"] = time.time() - t
                fn, mode = f, "suppress_errors (failing frames eager)" if suppress else "strict"
                break
            except Exception as e:
                doc["notes"].append(f"torch.compile of the reference decode (suppress_errors={suppress}) failed: "
                                    f"{type(e).__name__}: {str(e)[:400]}")
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        if fn is None:
            return
        ts = sorted(time_ms(lambda: fn(meta, rt.pools), args.steps, dev))
        by = step_bytes(rt, cfg, st["weights"], b, ctx)
        doc["measurements"].append({"name": "decode_torch_compile", "context": ctx, "batch": b, "mode": mode,
                                    "median_ms": ts[len(ts) // 2], **by, **floors(by["total_bytes"], ts[len(ts) // 2])})

    bandwidth()
    build()
    if "art" in st:
        sections = {"graph_check": graph_check, "decode": decode, "pdl": pdl, "late": late, "absorb": absorb, "attn_early": attn_early, "trace_late": trace_late, "overlap": overlap,
                    "priority": priority, "schedule": schedule, "nodes": nodes, "trace_start": trace_start,
                    "ahead": ahead, "carveout": carveout, "pdl_window": pdl_window, "gluon": gluon, "head_sleep": head_sleep, "mla_orient": mla_orient, "l2fetch": l2fetch,
                    "graph_configs": graph_configs, "graph_tune": graph_tune, "replay_stream": replay_stream, "pdl_plain_sweep": pdl_plain_sweep,
                    "trace": trace, "host": host,
                    "engine_decode": engine_decode,
                    "reference_peer": reference_peer,
                    "prefill": prefill, "torch_compile_peer": torch_compile_peer}
        for name in args.sections.split(","):
            sections[name]()
    summary(doc)
    print(rep.save())


def summary(doc):
    """Per (context, batch): the graphed step's ratio to its byte floor and each peer's time over it."""
    by = {(m["name"], m.get("context"), m.get("batch")): m for m in doc["measurements"] if "median_ms" in m}
    doc["summary"] = [{"context": c, "batch": b, "graphs_ms": m["median_ms"], "graphs_x_floor": m["x_floor"],
                       "graphs_x_floor_read": m.get("x_floor_read"),
                       **{f"{p}_over_graphs": by[(p, c, b)]["median_ms"] / m["median_ms"] for p in
                          ("decode_compiled_eager", "decode_compiled_graphs_no_pdl", "decode_compiled_graphs_metadata_outside",
                           "decode_reference_eager", "decode_torch_compile") if (p, c, b) in by}}
                      for (name, c, b), m in by.items() if name == "decode_compiled_graphs"]
    doc["goal"] = "batch-1 decode <= 1.25x byte floor and >= 1.5x faster than torch.compile"


if __name__ == "__main__":
    main()
