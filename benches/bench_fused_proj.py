"""H200 bench of the Triton kernels of issue 3 (codegen/triton: gemm, norm_quant, attn_res, value_gate,
sampling): bf16 correctness at k31-pro shapes, batch invariance, then timings of the packed input
projection and the fused value projection + gate against their unfused kernel sequences, torch eager
and torch.compile of the reference op, at decode (M = 1, 8, 64) and prefill (M = 4096) sizes.

Each timing carries bytes (weights read once + activations) and FLOPs, and its ratio to the measured
byte floor (bytes / measured copy bandwidth) and FLOP ceiling (FLOPs / measured bf16 matmul rate).
One JSON document goes to stdout and to $OUT/fused_proj.json (rewritten after every section, so a
timeout still leaves data).  Usage: python benches/bench_fused_proj.py [--budget SECONDS]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from types import SimpleNamespace as NS

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from codegen.triton import attn_res, gemm, indexer_front, norm_quant, sampling, value_gate  # noqa: E402
from ir import formats  # noqa: E402
from ir.ref import basic as ref  # noqa: E402

DRY = os.environ.get("BENCH_DRY") == "1"  # CPU dry run of the script's logic at toy sizes (interpreter)
DEV = "cpu" if DRY else "cuda"
D = 64 if DRY else 7168
MODELS = {"mla_packed": [64, 32, 96, 16, 16], "kda_packed": [96, 96, 96, 16, 16, 96]} if DRY else \
    {"mla_packed": [1536, 576, 12288, 128, 32], "kda_packed": [12288, 12288, 12288, 128, 96, 12288]}
MS = [1, 8, 64]  # decode sizes; BIG is the prefill size
BIG = 64 if DRY else 4096  # prefill tokens
VOCAB = 512 if DRY else 163840
MLA = dict(H=4, KV=64, DN=32, DV=32, QL=96, HI=4, DI=32) if DRY else \
    dict(H=96, KV=512, DN=128, DV=128, QL=1536, HI=32, DI=128)
START = time.time()
BUDGET = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 270.0
OUT = {"bench": "fused_proj", "command": " ".join([sys.executable, *sys.argv]), "machine": {}, "ceilings": {},
       "correctness": [], "batch_invariance": [], "timings": [], "errors": [], "skipped": []}
LINEAR, PACKED = gemm.TEMPLATES
FRONT = indexer_front.TEMPLATES[0]
TARGET = "cpu" if DRY else "h200"


def emit():
    text = json.dumps(OUT, indent=1, default=str)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fused_proj.json"), "w") as f:
            f.write(text)
    return text


def section(fn):
    def run():
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # one shot on the GPU: report and go on
            OUT["errors"].append({"section": fn.__name__, "error": f"{type(e).__name__}: {e}",
                                  "trace": traceback.format_exc()[-3000:]})
        print(f"[{time.time() - START:6.1f}s] {fn.__name__} done in {time.time() - t0:.1f}s", flush=True)
        emit()
    return run


def rel(a, b) -> float:
    a, b = a.double(), b.double()  # NaN in the kernel's output never passes
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")


def check(what, err, tol, **kw):
    OUT["correctness"].append({"what": what, "rel_err": err, "tol": tol, "ok": bool(err < tol), **kw})


def invariant(what, outs):
    OUT["batch_invariance"].append({"what": what, "bitwise_equal": all(torch.equal(outs[0], o) for o in outs[1:])})


def rnd(*shape, dtype=None, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype or (torch.float32 if DRY else torch.bfloat16))


def cfg_of(t, a, attrs):
    return t.heuristic(t.key_dims(a, attrs), TARGET)


def compiled(fn):
    return fn if DRY else torch.compile(fn, dynamic=True)


def median_ms(fn, graph):
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def timeit(group, variant, shape, fn, nbytes, flops, graph=False):
    if time.time() - START > BUDGET:
        OUT["skipped"].append(f"{group}/{variant}/{shape}: time budget")
        return None
    try:
        ms = median_ms(fn, graph)
    except Exception as e:
        OUT["errors"].append({"section": f"{group}/{variant}/{shape}", "error": f"{type(e).__name__}: {e}"})
        return None
    bw, mm = OUT["ceilings"]["copy_bytes_per_s"], OUT["ceilings"]["bf16_flops_per_s"]
    floor_us, flop_us = nbytes / bw * 1e6, flops / mm * 1e6
    OUT["timings"].append({"group": group, "variant": variant, "shape": shape, "median_us": ms * 1e3,
                           "bytes": nbytes, "flops": flops, "byte_floor_us": floor_us, "flop_ceiling_us": flop_us,
                           "ratio_vs_byte_floor": floor_us / (ms * 1e3), "ratio_vs_flop_ceiling": flop_us / (ms * 1e3),
                           "cuda_graph": graph})
    return ms


@section
def machine():
    OUT["machine"] = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                      "cuda": torch.version.cuda, "dry_run_on_cpu": DRY}
    if DRY:
        OUT["ceilings"] = {"copy_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11, "how": "dry run: placeholders"}
        return
    p = torch.cuda.get_device_properties(0)
    OUT["machine"].update(gpu=p.name, sms=p.multi_processor_count, memory_gb=p.total_memory / 1e9)
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=30, return_mode="median")
    a, b = rnd(8192, 8192), rnd(8192, 8192)
    mm = triton.testing.do_bench(lambda: a @ b, warmup=5, rep=30, return_mode="median")
    OUT["ceilings"] = {"copy_bytes_per_s": 2 * src.numel() / (ms * 1e-3), "bf16_flops_per_s": 2 * 8192 ** 3 / (mm * 1e-3),
                       "how": "2 GiB device copy (read + write); torch bf16 matmul 8192^3 on random data"}


def packed_call(x, ws, bi=False):
    attrs = {"splits": [w.shape[0] for w in ws], "batch_invariant": bi}
    a = NS(operands=[x, *ws])
    c = cfg_of(PACKED, a, attrs)
    return (lambda: PACKED.launch(a, attrs, c)), c


@section
def gemm_correctness():
    for name, splits in MODELS.items():
        ws = [rnd(n, D, scale=0.02) for n in splits]
        wcat = torch.cat(ws).float()
        for m in MS + [BIG]:
            x = rnd(m, D)
            check(f"{name} packed M={m}", rel(torch.cat(packed_call(x, ws)[0](), 1), x.float() @ wcat.t()), 1e-2)
        big = rnd(BIG, D)  # batch invariance: a row alone, in a batch of 6, in a prefill batch
        invariant(f"{name} packed GEMM row 0 alone / in 6 / in {BIG} (batch-invariant config)",
                  [torch.cat(packed_call(big[:n].clone(), ws, bi=True)[0](), 1)[:1] for n in (1, 6, BIG)])
        del ws, wcat
    ws = [rnd(n, D, scale=0.02) for n in MODELS["mla_packed"]]
    for block in (None, (16, 32) if DRY else (128, 128)):
        f8 = [gemm.FP8Weight.quantize(w, block) for w in ws]
        deq = torch.cat([f.dequantize() for f in f8])
        for m in (8, BIG):
            x = rnd(m, D)
            check(f"mla_packed fp8 block={block} M={m}", rel(torch.cat(packed_call(x, f8)[0](), 1), x.float() @ deq.t()),
                  2e-2)
    lm = rnd(VOCAB, D, scale=0.02)
    x = rnd(8, D, dtype=torch.float32)
    y = gemm.gemm(x, lm, gemm.heuristic(dict(M=8, N=VOCAB, K=D, x="f32", w="bf16", gk=0, bi=0), TARGET))
    check("logits f32 x bf16 weight (3-term split) M=8", rel(y, x.double() @ lm.double().t()), 1e-5)


@section
def norm_correctness():
    x, w = rnd(BIG, D, scale=3.0), rnd(D)
    y = norm_quant.norm_rot_quant(x, norm_quant.row_heuristic(dict(R=BIG, D=D, rot=0, bi=0), TARGET), norm="rms",
                                  weight=w, eps=1e-5)[0]
    check(f"rms_norm {BIG}x{D}", rel(y, ref.rms_norm(x.float(), w.float(), 1e-5)), 1e-2)
    di, hi, ql = MLA["DI"], MLA["HI"], MLA["QL"]
    k, g, b = rnd(BIG, di, scale=2.0), rnd(di), rnd(di)
    y = norm_quant.norm_rot_quant(k, norm_quant.row_heuristic(dict(R=BIG, D=di, rot=0, bi=0), TARGET),
                                  norm="layer", weight=g, bias=b, eps=1e-6)[0]
    check(f"layer_norm {BIG}x{di}", rel(y, ref.layer_norm(k.float(), g.float(), b.float(), 1e-6)), 1e-2)
    q = torch.randn(BIG, hi, di, device=DEV) * torch.logspace(-6, 3, BIG, device=DEV)[:, None, None]
    qc = norm_quant.row_heuristic(dict(R=BIG * hi, D=di, rot=1, bi=0), TARGET)
    _, q8, qs = norm_quant.norm_rot_quant(q, qc, quant=True, store_y=False)
    r8, rs = formats.quantize_fp8_pow2(q)
    OUT["batch_invariance"].append({"what": "quantize_fp8_pow2 bytes and scales == ir.formats (fp32 input)",
                                    "bitwise_equal": bool(torch.equal(q8.view(torch.uint8), r8.view(torch.uint8))
                                                          and torch.equal(qs, rs))})
    check(f"hadamard fp32 {di}", rel(norm_quant.norm_rot_quant(q, qc, rotate=True)[0], ref.hadamard_rotate(q.double())),
          1e-5)
    T, N = 64, 8192  # fused indexer front at the model's shapes
    c_q, wq_b, ik, iw = rnd(T, ql), rnd(hi * di, ql, scale=0.03), rnd(T, di, scale=2.0), rnd(T, hi)
    pool, spool = torch.zeros(N, di, device=DEV).to(torch.float8_e4m3fn), torch.zeros(N, device=DEV)
    req, pos, base = torch.zeros(T, dtype=torch.long, device=DEV), torch.arange(T, device=DEV) + 100, \
        torch.tensor([1000], device=DEV)
    attrs = {"heads": hi, "head_dim": di, "eps": 1e-6, "weight_scale": (hi * di) ** -0.5, "quant": "fp8_pow2",
             "batch_invariant": False}
    a = NS(operands=[c_q, wq_b, ik, g, b, iw, pool, spool, req, pos, base])
    q8, qs, wo, pool, spool = FRONT.launch(a, attrs, cfg_of(FRONT, a, attrs))
    rq8, rqs = formats.quantize_fp8_pow2(ref.hadamard_rotate((c_q.float() @ wq_b.float().t()).reshape(T, hi, di)))
    rk8, rks = formats.quantize_fp8_pow2(ref.hadamard_rotate(ref.layer_norm(ik.float(), g.float(), b.float(), 1e-6)))
    rows = base + pos
    check("indexer_front query fp8 (deq)", rel(formats.dequantize_fp8(q8, qs), formats.dequantize_fp8(rq8, rqs)), 2e-2)
    check("indexer_front keys in pool (deq)", rel(formats.dequantize_fp8(pool[rows], spool[rows]),
                                                   formats.dequantize_fp8(rk8, rks)), 2e-2)
    check("indexer_front head weights", rel(wo, iw.float() * attrs["weight_scale"]), 1e-2)


def mix_inputs(T):
    return [rnd(T, D, scale=1 + i) for i in range(8)], rnd(T, D), rnd(T, D), rnd(1, D), rnd(D), rnd(D)


@section
def attn_res_correctness():
    bank, prev, part, proj, mnorm, g = mix_inputs(BIG)
    c = attn_res.heuristic(dict(T=BIG, d=D, n=9, bi=0), TARGET)
    prefix, _, h = attn_res.attn_res_mix(bank, prev, proj, mnorm, 1e-5, c, part=part, norm_weight=g, norm_eps=1e-5)
    rp = (prev.float() + part.float()).to(prev.dtype)
    rx = ref.attn_res_mix([s.float() for s in bank] + [rp.float()], proj.float().reshape(-1), mnorm.float(), 1e-5)
    check("attn_res prefix add", rel(prefix, rp.float()), 1e-2)
    check(f"attn_res_mix_norm bank 8 T={BIG}", rel(h, ref.rms_norm(rx, g.float(), 1e-5)), 1e-2)
    invariant(f"attn_res_mix_norm row 0 alone / in 6 / in {BIG}",
              [attn_res.attn_res_mix([s[:n] for s in bank], prev[:n], proj, mnorm, 1e-5, c, part=part[:n],
                                     norm_weight=g, norm_eps=1e-5)[2][:1] for n in (1, 6, BIG)])


def vg_inputs():
    return MLA["H"], MLA["KV"], MLA["DN"], MLA["DV"], rnd(MLA["H"] * (MLA["DN"] + MLA["DV"]), MLA["KV"], scale=0.04)


@section
def value_gate_correctness():
    from ir.ref.mla import mla_value_proj

    H, KV, DN, DV, kv_b = vg_inputs()
    for T in MS + [BIG]:
        o, gate = rnd(T, H, KV), rnd(T, H * DV)
        y = value_gate.value_gate(o, kv_b, DN, value_gate.heuristic(dict(T=T, H=H, KV=KV, DV=DV, bi=0), TARGET), gate)
        r = mla_value_proj(o.float(), kv_b.float(), DN).reshape(T, -1) * torch.sigmoid(gate.float())
        check(f"value_gate T={T}", rel(y, r), 1e-2)
    big, gbig = rnd(BIG, H, KV), rnd(BIG, H * DV)
    c = value_gate.heuristic(dict(T=0, H=H, KV=KV, DV=DV, bi=1), TARGET)
    invariant(f"value_gate row 0 alone / in 6 / in {BIG}",
              [value_gate.value_gate(big[:n], kv_b, DN, c, gbig[:n])[:1] for n in (1, 6, BIG)])


@section
def sampling_correctness():
    R = 8 if DRY else 64
    logits = torch.randn(R, VOCAB, device=DEV) * 3
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3] * (R // 4), device=DEV)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0] * (R // 4), device=DEV)
    u = torch.rand(R, device=DEV)
    ids = sampling.sample_tokens(logits, temp, top_p, u).cpu()
    ok, lg = 0, logits.double().cpu()
    for r in range(R):
        if temp[r] == 0:
            ok += int(ids[r]) == int(lg[r].argmax())
            continue
        p = torch.softmax(lg[r] / float(temp[r]), 0)
        sp, order = torch.sort(p, descending=True, stable=True)
        keep = torch.cumsum(sp, 0) - sp < float(top_p[r])
        q = torch.zeros_like(p).scatter(0, order[keep], sp[keep])
        cum = torch.cumsum(q, 0)
        ok += int(ids[r]) == int(((cum > float(u[r]) * cum[-1]) & (q > 0)).nonzero()[0])
    check(f"sampling ids == fp64 rule ({R} rows, V={VOCAB})", 1.0 - ok / R, 0.05, rows_equal=ok)


@section
def packed_timings():
    for name, splits in MODELS.items():
        ws = [rnd(n, D, scale=0.02) for n in splits]
        wcat = torch.cat(ws)
        body = compiled(lambda x, *w: tuple(x @ wi.t() for wi in w))
        for m in MS + [BIG]:
            x = rnd(m, D)
            N = sum(splits)
            nbytes, flops = 2 * (N * D + m * D + m * N), 2 * m * N * D
            fused, c = packed_call(x, ws)
            fused_bi, _ = packed_call(x, ws, bi=True)
            single = [(NS(x=x, w=w), cfg_of(LINEAR, NS(x=x, w=w), {})) for w in ws]
            variants = {
                "fused_triton": fused,
                "fused_triton_batch_invariant": fused_bi,
                "unfused_triton": lambda: [LINEAR.launch(a, {}, sc) for a, sc in single],
                "torch_eager_concat": lambda: x @ wcat.t(),
                "torch_eager_unfused": lambda: [x @ w.t() for w in ws],
                "torch_compile_reference": lambda: body(x, *ws),
            }
            shape = {"M": m, "N": N, "K": D, "splits": splits, "config": c}
            for v, fn in variants.items():
                timeit(name, v, shape, fn, nbytes, flops)
            if m <= 8 and not DRY:
                for v in ("fused_triton", "unfused_triton", "torch_eager_unfused"):
                    timeit(name, v + "_cudagraph", shape, variants[v], nbytes, flops, graph=True)
        del ws, wcat


@section
def value_gate_timings():
    H, KV, DN, DV, kv_b = vg_inputs()
    w_uv = kv_b.view(H, DN + DV, KV)[:, DN:]

    def reference(o, g):
        return torch.einsum("bhk,hvk->bhv", o, w_uv).reshape(o.shape[0], -1) * torch.sigmoid(g)

    comp = compiled(reference)
    for T in MS + [BIG]:
        o, g = rnd(T, H, KV), rnd(T, H * DV)
        c = value_gate.heuristic(dict(T=T, H=H, KV=KV, DV=DV, bi=0), TARGET)
        nbytes, flops = 2 * (H * DV * KV + T * H * KV + 2 * T * H * DV), 2 * T * H * DV * KV
        variants = {
            "fused_triton": lambda: value_gate.value_gate(o, kv_b, DN, c, g),
            "unfused_triton_proj_then_torch_gate": lambda: value_gate.value_gate(o, kv_b, DN, c) * torch.sigmoid(g),
            "torch_eager_reference": lambda: reference(o, g),
            "torch_compile_reference": lambda: comp(o, g),
        }
        for v, fn in variants.items():
            timeit("value_gate", v, {"T": T, "H": H, "kv": KV, "dv": DV, "config": c}, fn, nbytes, flops)
        if T <= 8 and not DRY:
            for v in ("fused_triton", "unfused_triton_proj_then_torch_gate", "torch_eager_reference"):
                timeit("value_gate", v + "_cudagraph", {"T": T}, variants[v], nbytes, flops, graph=True)


@section
def other_timings():
    for T in (8, BIG):
        bank, prev, part, proj, mnorm, g = mix_inputs(T)
        c = attn_res.heuristic(dict(T=T, d=D, n=9, bi=0), TARGET)

        def eager(bank=bank, prev=prev, part=part, proj=proj, mnorm=mnorm, g=g):
            p = prev + part
            return p, ref.rms_norm(ref.attn_res_mix([*bank, p], proj.reshape(-1), mnorm, 1e-5), g, 1e-5)

        nbytes, shape = 2 * T * D * 12, {"T": T, "bank": 8}
        timeit("attn_res_mix_norm", "fused_triton", shape, lambda: attn_res.attn_res_mix(
            bank, prev, proj, mnorm, 1e-5, c, part=part, norm_weight=g, norm_eps=1e-5), nbytes, 0)
        timeit("attn_res_mix_norm", "torch_eager_reference", shape, eager, nbytes, 0)
        timeit("attn_res_mix_norm", "torch_compile_reference", shape, compiled(eager), nbytes, 0)
    x, w = rnd(BIG, D), rnd(D)
    rc = norm_quant.row_heuristic(dict(R=BIG, D=D, rot=0, bi=0), TARGET)
    timeit("rms_norm", "triton", {"T": BIG}, lambda: norm_quant.norm_rot_quant(x, rc, norm="rms", weight=w, eps=1e-5),
           4 * BIG * D, 0)
    rms = compiled(lambda x, w: ref.rms_norm(x, w, 1e-5))
    timeit("rms_norm", "torch_compile_reference", {"T": BIG}, lambda: rms(x, w), 4 * BIG * D, 0)
    di, hi, ql = MLA["DI"], MLA["HI"], MLA["QL"]
    wq_b, g, b = rnd(hi * di, ql, scale=0.03), rnd(di), rnd(di)
    for T in (8, BIG):
        c_q, ik, iw, pool, spool = rnd(T, ql), rnd(T, di), rnd(T, hi), torch.zeros(2 * T, di, device=DEV).to(
            torch.float8_e4m3fn), torch.zeros(2 * T, device=DEV)
        meta = [torch.zeros(T, dtype=torch.long, device=DEV), torch.arange(T, device=DEV), torch.tensor([T], device=DEV)]
        attrs = {"heads": hi, "head_dim": di, "eps": 1e-6, "weight_scale": 0.01, "quant": "fp8_pow2",
                 "batch_invariant": False}
        a = NS(operands=[c_q, wq_b, ik, g, b, iw, pool, spool, *meta])
        c = cfg_of(FRONT, a, attrs)

        def unfused(c_q=c_q, ik=ik, iw=iw, pool=pool, spool=spool, T=T):
            q8 = formats.quantize_fp8_pow2(ref.hadamard_rotate((c_q @ wq_b.t()).reshape(T, hi, di)))
            k8, ks = formats.quantize_fp8_pow2(ref.hadamard_rotate(ref.layer_norm(ik, g, b, 1e-6)))
            pool[T:] = k8
            spool[T:] = ks
            return q8, iw * 0.01

        nbytes = 2 * (hi * di * ql + T * ql + T * di + 2 * T * hi) + T * (hi * di + 4 * hi + di + 4)
        timeit("indexer_front", "fused_triton", {"T": T, "config": c}, lambda: FRONT.launch(a, attrs, c), nbytes,
               2 * T * hi * di * ql)
        timeit("indexer_front", "torch_eager_reference_ops", {"T": T}, unfused, nbytes, 2 * T * hi * di * ql)
    R = 8 if DRY else 64
    logits = torch.randn(R, VOCAB, device=DEV) * 3
    temp, top_p, u = torch.full((R,), 0.8, device=DEV), torch.full((R,), 0.9, device=DEV), torch.rand(R, device=DEV)

    def torch_sampler():
        p = torch.softmax(logits / temp[:, None], -1)
        sp, order = torch.sort(p, descending=True, stable=True)
        sp = torch.where(torch.cumsum(sp, -1) - sp < top_p[:, None], sp, 0.0)
        return order.gather(1, torch.multinomial(sp, 1))

    timeit("sampling", "triton_top_p", {"R": R, "V": VOCAB},
           lambda: sampling.sample_tokens(logits, temp, top_p, u, check=False), 4 * logits.numel(), 0)
    timeit("sampling", "torch_eager_sort_multinomial", {"R": R, "V": VOCAB}, torch_sampler, 4 * logits.numel(), 0)


if __name__ == "__main__":
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    for step in (machine, gemm_correctness, norm_correctness, attn_res_correctness, value_gate_correctness,
                 sampling_correctness, packed_timings, value_gate_timings, other_timings):
        step()
    print(emit())
    print("\ngroup                   size variant                                   us  floor  ceil")
    for t in OUT["timings"]:
        sh = t["shape"].get("M", t["shape"].get("T", t["shape"].get("R")))
        print(f"{t['group']:<20} {sh!s:>6} {t['variant']:<38} {t['median_us']:9.1f} {t['ratio_vs_byte_floor']:5.2f} "
              f"{t['ratio_vs_flop_ceiling']:5.2f}")
    bad = [c for c in OUT["correctness"] if not c["ok"]] + [b for b in OUT["batch_invariance"] if not b["bitwise_equal"]]
    print(f"correctness failures: {len(bad)}; errors: {len(OUT['errors'])}; skipped: {len(OUT['skipped'])}")
