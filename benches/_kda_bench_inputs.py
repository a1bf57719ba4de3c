"""Inputs, peers and warm-ups of benches/bench_kda.py: the bench's shapes (full, or toy ones with
KDA_BENCH_TINY=1 in the interpreter), random prefill / fused-decode operands, closures that run our kernels and
fla-core 0.6.0's (`chunk_kda`, `fused_recurrent_kda`) on them, and the warm-up subprocess body that fills the
compile cache (fla's autotuned kernels compiled for every config without timing them: `_fla_compile_only`).

Importing this module before triton selects the interpreter when no GPU is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
# fla's autotune results stay in memory: the process that times fla tunes it on a quiet GPU (warm-ups compile)
os.environ["TRITON_CACHE_AUTOTUNING"] = os.environ["FLA_CACHE_RESULTS"] = "0"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codegen.triton import _pdl  # noqa: E402
from codegen.triton.kda_decode import kda_decode  # noqa: E402
from codegen.triton.kda_prefill import kda_prefill  # noqa: E402
from ir.ref.basic import l2_norm  # noqa: E402

TINY = os.environ.get("KDA_BENCH_TINY") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D, H_RANK, T_PRE, B_DEC = (2, 32, 2, 128, 4) if TINY else (32, 128, 12, 8192, 64)  # H_RANK: the rank preset
ACT = torch.float32 if TINY else torch.bfloat16   # the interpreter computes bf16 wrongly (TOOLCHAIN.md)
FLA = DEV == "cuda" and os.environ.get("KDA_BENCH_FLA", "1") == "1"
FLA_PREFILL = FLA and os.environ.get("KDA_BENCH_FLA_PREFILL", "1") == "1"


def rel(a, b) -> float:  # ||a - b|| / ||b||, NaN unless a is finite
    return ((a.double() - b.double()).norm() / b.double().norm()).item() if torch.isfinite(a).all() else float("nan")


def resources(skip=(), **fns) -> list:
    """ptxas registers / spills / shared KiB / warps of every compiled variant of the named kernels (but those whose
    cache keys are in skip: `compiled_keys`)."""
    cks = [(n, c) for n, fn in fns.items() for cache in getattr(fn, "device_caches", {}).values()
           for key, c in cache[0].items() if key not in skip]
    for _, ck in cks:
        ck._init_handles()
    return [f"{n}:{c.n_regs}r/{c.n_spills}s/{c.metadata.shared // 1024}K/w{c.metadata.num_warps}" for n, c in cks]


def compiled_keys(fn) -> set:
    """The cache keys of fn's variants compiled (or loaded) in this process so far."""
    return {key for cache in getattr(fn, "device_caches", {}).values() for key in cache[0]}


def attempt(res, key, fn):
    """res[key] = fn(), or res[key + "_error"] = what it raised (one shot on the GPU: report and go on)."""
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001
        res[key + "_error"] = f"{type(e).__name__}: {e}"[:300]


def fla():
    """fla-core's (chunk_kda, fused_recurrent_kda), imported on first use (absent on CPU-only runs)."""
    return __import__("fla.ops.kda").ops.kda.chunk_kda, __import__("fla.ops.kda").ops.kda.fused_recurrent_kda


# ------------------------------------------------------------------------------------------ prefill
def prefill_inputs(lengths, seed=0):
    """q, k L2-normalised, v, log decay g in the K3 gate's range (fp32), beta; pool [R+1, H, D, D] (fp32, rows
    1..R used), slots, cu_seqlens; `<name>_act`: q, k, v, beta in the activation dtype."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, R = sum(lengths), len(lengths)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q, k = l2_norm(r(T, H, D), 1e-6), l2_norm(r(T, H, D), 1e-6)
    g = -5.0 * torch.sigmoid(r(T, H, D) * 2.0 - 4.0)            # the K3 gate's range, mostly mild
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    x = dict(q=q, k=k, v=r(T, H, D), g=g, beta=torch.sigmoid(r(T, H)), pool=r(R + 1, H, D, D) * 0.3,
             slots=torch.arange(1, R + 1, device=DEV), cu=cu)
    x.update({f"{n}_act": x[n].to(ACT) for n in ("q", "k", "v", "beta")})
    return x


def prefill_bytes(T, R):  # q, k, v, beta, o in the activation dtype, g fp32, the state read and written
    return (4 * T * H * D + T * H) * ACT.itemsize + T * H * D * 4 + 2 * R * H * D * D * 4


def ours_prefill(x, pool, cfg):
    return lambda: kda_prefill(x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"], pool,  # noqa: E731
                               x["slots"], x["cu"], D ** -0.5, config=cfg)


def fla_prefill(x, lengths):
    R = len(lengths)
    args = [t.view(R, lengths[0], *t.shape[1:]) for t in (x["q_act"], x["k_act"], x["v_act"], x["g"], x["beta_act"])]
    init = x["pool"][1:].clone()
    return lambda: fla()[0](*args, scale=D ** -0.5, initial_state=init, output_final_state=True)  # noqa: E731


def kernel_split_ms(fn, calls=3) -> dict:
    """ms per call of each GPU kernel fn launches (torch.profiler, after one warm-up call): where the time goes."""
    fn(), torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            out[ev.key[:60]] = round(out.get(ev.key[:60], 0) + t / calls / 1e3, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------------------ decode
def decode_operands(lengths, heads, seed=1):
    """The fused node's 17 operands (fp32; `low` casts them), K3 gate with dt_bias, conv width 4, rank D."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    T, P, K, R = sum(lengths), heads * D, 4, len(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    return [r(T, P), r(T, P), r(T, P), r(P, K) * 0.5, r(P, K) * 0.5, r(P, K) * 0.5, r(R + 1, K - 1, 3 * P),
            r(T, D), r(P, D) / D ** 0.5, r(heads) * 0.5, r(P), r(T, heads), r(R + 1, heads, D, D) * 0.3, r(T, P),
            r(D), torch.arange(1, R + 1, device=DEV), cu]


def dec(split, bv, rb=128, gemv=0, early=1, warps=4, gate_mm=0, maxnreg=0, prefetch=1, gluon=0):
    """A fused-decode config (kda_decode's template keys; GLUON only where set)."""
    return {"SPLIT": split, "BV": bv, "WARPS": warps, "PREFETCH": prefetch, "GATE_MM": gate_mm, "RB": rb,
            "MAXNREG": maxnreg, "GEMV": gemv, "EARLY": early} | ({"GLUON": gluon} if gluon else {})


def low(ops):
    """Activations and weights in the compute dtype; pools (conv tails, states) stay fp32."""
    return [None if x is None else x.to(ACT) if i not in (6, 9, 10, 12, 15, 16) else x.clone()
            for i, x in enumerate(ops)]


def decode_run(mine, cfg, keep=False):
    return lambda: kda_decode(*mine, scale=D ** -0.5, lower_bound=-5.0, norm_eps=1e-5, keep_states=keep,  # noqa: E731
                              block_v=cfg["BV"], num_warps=cfg["WARPS"], split=cfg["SPLIT"],
                              prefetch=bool(cfg["PREFETCH"]), gate_mm=bool(cfg["GATE_MM"]), rank_block=cfg["RB"],
                              max_regs=cfg.get("MAXNREG", 0), gemv=bool(cfg.get("GEMV", 0)),
                              early=bool(cfg.get("EARLY", 0)), gluon=int(cfg.get("GLUON", 0)))


def fla_decode(ops, heads, with_gemm=False):
    """fla's fused_recurrent_kda on the same step (recurrence only: no conv, no norm) as a closure: f = f_a f_b^T
    precomputed and not timed, or (with_gemm) computed by torch before it, as our kernel does in-kernel."""
    mine, B = low(ops), ops[15].numel()
    q, k, v, b = (mine[i].view(1, B, heads, -1) for i in (0, 1, 2, 11))
    f = lambda: (mine[7] @ mine[8].T).view(1, B, heads, D)  # noqa: E731
    f0 = f()
    kw = dict(A_log=ops[9], dt_bias=ops[10], scale=D ** -0.5, initial_state=ops[12][1:].clone(),
              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    return lambda: fla()[1](q, k, v, f() if with_gemm else f0, b[..., 0], cu_seqlens=ops[16], **kw)  # noqa: E731


def f_given(ops):
    """Our operands with the gate input f = f_a f_b^T computed beforehand (f_b None), as fla is given it."""
    return ops[:7] + [(ops[7].float() @ ops[8].float().T).to(ops[7].dtype), None] + ops[9:]


def n_chain(B, heads):  # launches per timed graph: distinct state pools (~200 MB) that L2 (50 MB) cannot hold
    return max(3, min(48, -(-200 * 2 ** 20 // (B * heads * D * D * 4))))


# ------------------------------------------------------------------------------------------ warm-ups
def _fla_compile_only(part, parts):
    """In a warm-up process: fla's autotuners compile their configs (every parts-th from `part`) without running
    them, then run the first; the timing process autotunes from the compile cache on a quiet GPU."""
    from triton.runtime.autotuner import Autotuner

    def bench(self, *args, config, **meta):
        if next((j for j, c in enumerate(self.configs) if c is config), hash(str(config))) % parts == part:
            try:
                self.fn.run(*args, **{**meta, **config.all_kwargs(), "warmup": True})
            except Exception:  # noqa: BLE001  (configs that do not fit: the timing process skips them too)
                pass
        return [1.0, 1.0, 1.0]
    Autotuner._bench = bench


def poison_key(*parts) -> str:
    return json.dumps(parts, sort_keys=True, default=str)


def poisoned(suffix="") -> set:
    """Keys (`poison_key`) of the candidates that killed a warm-up's CUDA context (an illegal address: every later
    call of that process fails, so the main process must not run them): one per line of $KDA_BENCH_POISON; with
    suffix ".ok", those a warm-up ran without error."""
    path = os.environ.get("KDA_BENCH_POISON", "") + suffix
    return set(open(path).read().split("\n")) - {""} if len(path) > len(suffix) and os.path.exists(path) else set()


def _warm_one(key, fn):
    """Run fn once (synchronised, so an asynchronous fault is its own); a CUDA error is noted and ends the process."""
    res: dict = {}
    attempt(res, "warm", lambda: (fn(), torch.cuda.synchronize()))
    bad = "CUDA error" in res.get("warm_error", "")
    if os.environ.get("KDA_BENCH_POISON"):
        with open(os.environ["KDA_BENCH_POISON"] + ("" if bad else ".ok"), "a") as f:
            f.write(key + "\n")
    if bad:
        os._exit(3)


def warm_up(what, prefill_configs, decode_jobs, decode_cases):
    """Subprocess: compile into the disk cache (a failing candidate is skipped: the check phase records it) part
    i of n ("prefill:i:n", "decode:i:n") of our prefill configs / decode jobs (B, heads, qlen, config, pdl), or
    fla's kernels at the bench's shapes ("fla:i:n"; decode_cases: (B, heads, qlen, ...) of the decode timings)."""
    kind, i, n = (what.split(":") + ["0", "1"])[:3]
    i, n = int(i), int(n)
    if kind == "prefill":
        x = prefill_inputs([T_PRE])
        for cfg in prefill_configs[i::n]:
            _warm_one(poison_key("prefill", cfg), ours_prefill(x, x["pool"].clone(), cfg))
    if kind == "decode":
        for B, heads, qlen, cfg, pdl in decode_jobs[i::n]:
            _pdl.set_enabled(pdl)
            _warm_one(poison_key("decode", B, heads, qlen, cfg),
                      decode_run(low(decode_operands([qlen] * B, heads)), cfg, keep=qlen > 1))
    if kind == "fla":
        _fla_compile_only(i, n)
        for B, heads, qlen, *_ in decode_cases if i == 0 else []:
            fla_decode(decode_operands([1] * B, heads), heads)() if qlen == 1 else None
        for lengths in ([T_PRE] * 4, [T_PRE], [4 * T_PRE]) if FLA_PREFILL else []:
            attempt({}, "warm", fla_prefill(prefill_inputs(lengths), lengths))
    torch.cuda.synchronize()


def wait_all(procs, what, timeout, doc, t0):
    """Wait for warm-up subprocesses, killed after timeout s (the main process compiles the rest); notes in doc."""
    t = time.time()
    for proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t)))
        except subprocess.TimeoutExpired:
            rc = proc.kill()
        doc["notes"].append(f"{what} warm-up subprocess: rc {rc}, at {time.time() - t0:.1f} s")
