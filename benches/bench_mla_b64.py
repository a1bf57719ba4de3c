"""H200 bench of sparse MLA decode (issue 4): the heuristic's default against other configs, batch 64, 32, 8 and 1,
12 heads, top-2048 FP8 latent rows of 8K contexts (paged, 64-row blocks in random order), absorbed form, whole
launcher (absorption, attention, combine) under CUDA-graph replay of several input sets in one graph (SETS: rows
from HBM, the graph's start spread over them); the default also as the runtime runs it (`default_q_absorbed`: q~
computed beforehand by the mla_absorb node, which the runtime overlaps with the indexer; the attention's own bytes).
Every config is checked against float64 (o~ and lse) and graph replay == eager over 50 replays (PDL on); at batch
64 and 32 the configs in L2RES also run with every token reading token 0's rows (L2 resident: the kernel's cost
without HBM); the ORIENT 3 (Gluon) configs also run `holes_check` (-1 entries, short contexts, an empty token,
positions through the block table). Session 13's call: benches/results/h200-2026-11-30-s13/
mla_b64_orient2*; session 15's: benches/results/h200-2026-11-30-s15/mla_b64_gluon*.
One JSON document in $OUT/mla_b64.json (rewritten after every measurement); the summary on stdout.

    python benches/bench_mla_b64.py [--budget-s 200] [--rounds 1] [--batches 64,32,8,1] [--gather]

--gather: first, per batch, the access pattern's own ceiling (`_gather_ceiling.py`: the same rows read and xor-reduced,
nothing else, several grid shapes) and a sequential read of as many bytes.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from benches._report import graph_ms  # noqa: E402
from _attention_checks import graph_vs_eager, mla_call as _call, mla_check as _check, mla_set  # noqa: E402

T0 = time.time()
BUDGET = float(sys.argv[sys.argv.index("--budget-s") + 1]) if "--budget-s" in sys.argv else 200.0
ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 1
ONLY = sys.argv[sys.argv.index("--batches") + 1].split(",") if "--batches" in sys.argv else None
DOC = {"bench": "mla_b64", "command": " ".join([sys.executable] + sys.argv), "machine": {}, "hbm": {},
       "measurements": [], "checks": [], "errors": [], "skipped": [], "kernels": []}
O2 = dict(ORIENT=2, BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=3, PREFETCH=1, KB=128)
O3 = dict(ORIENT=3, BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=3, PREFETCH=1)   # Gluon (_mla_gluon.py)


def configs(T):
    """(name, config): the heuristic's default first, then the previous default and variants. Session 13's call
    (benches/results/h200-2026-11-30-s13/mla_b64_orient2.json) timed ORIENT 2 forms since removed (_mla_rowsm.py's
    docstring); session 15's calls (benches/results/h200-2026-11-30-s15/mla_b64_gluon_call{1,2}.json and
    mla_b64_gluon_r2_call{1,2}.json) the ORIENT 3 (Gluon) forms, its removed ones in _mla_gluon.py's docstring."""
    from codegen.triton.mla_sparse import heuristic
    base = heuristic({"H": 12, "L": 2048, "KV": 512, "fmt": 1, "sparse": 1, "T": T, "bi": 0}, "h200")
    o1 = dict(ORIENT=1, BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=1, PREFETCH=1, F16=1, CHUNK=32)   # before s21
    if T == 1:
        return [("default", base), ("previous_orient1", o1), ("o3_c128_s2", dict(O3, CHUNK=128, num_stages=2))]
    if T == 8:
        return [("default", base), ("previous_orient1", o1), ("o3_c64_s2", dict(O3, CHUNK=64, num_stages=2))]
    if T == 32:
        return [("default", base), ("previous_c256_s2", dict(O3, CHUNK=256, num_stages=2)),
                ("o3_c512_s3_combine", dict(O3, CHUNK=512, FOLD=0))]
    return [("default", base), ("previous_c1024_s3", dict(O3, CHUNK=1024, FOLD=0)),
            ("o3_c512_s2", dict(O3, CHUNK=512, num_stages=2)), ("previous_orient2", dict(O2, CHUNK=512))]


# input sets rotated in one graph (graph_ms: its start, ~5-8 us, spread over them; one set at batch 64 / 32 before
# session 21 put it in every figure) so that rows come from HBM: 16 at batch 1 and 8, 4 at 32 and 64
SETS = {1: 16, 8: 16}

# configs also timed with every token reading token 0's rows (L2 resident: the kernel's cost without HBM)
L2RES = ("default", "previous_c1024_s3")


def fold_check(d, cfg):
    """The pieces merged in the attention launch (FOLD, where the config's split gives 2-4 pieces) vs the same config
    with the combine launch: o~ within a bf16 rounding step of fp32 sums in another order, lse to 1e-6."""
    o, lse = _call(d, cfg)()
    o0, lse0 = _call(d, dict(cfg, FOLD=0))()
    e_o = float((o.double() - o0.double()).norm() / o0.double().norm())
    e_l = float((lse.double() - lse0.double()).abs().max())
    return {"ok": e_o < 4e-3 and e_l < 1e-6 and bool(torch.isfinite(o).all()), "rel_err_o": e_o,
            "max_abs_err_lse": e_l, "bitwise": bool(torch.equal(o, o0) and torch.equal(lse, lse0))}


def holes_check(cfg, seed=901):
    """-1 entries (a quarter of them), short contexts (token t < 8 keeps its first 37 t + 1 entries), a token with
    none (o~ 0, lse -inf) and the positions path (selection through the block table) vs float64."""
    import bench_attention as ba
    from codegen.triton.mla_prefill import dequantize_latent
    from codegen.triton.mla_sparse import mla_sparse_decode
    d = _set(64, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = d["rows"].clone()
    rows[torch.rand(rows.shape, device="cuda", generator=g) < 0.25] = -1
    for t in range(8):
        rows[t, 37 * t + 1:] = -1
    rows[8] = -1
    c = dequantize_latent(d["pool"], "fp8", 512, d["ls"], 1.0).double()
    W = d["kvb"].double().view(12, 256, 512)
    qa = torch.einsum("thn,hnk->thk", d["qn"].double(), W[:, :128])

    def ref(r):
        cr = c[r.clamp(min=0)]
        z = ba.SCALE * (torch.einsum("thk,tlk->thl", qa, cr[..., :512]) +
                        torch.einsum("thr,tlr->thl", d["qp"].double(), cr[..., 512:]))
        z = z.masked_fill((r < 0)[:, None, :], float("-inf"))
        return torch.logsumexp(z, -1), torch.einsum("thl,tlk->thk", torch.softmax(z, -1).nan_to_num(), cr[..., :512])

    out = {}
    for name, sel, by_rows, want in (("holes", rows, True, ref(rows)), ("positions", d["sels"][0], False,
                                                                         ref(d["rows"]))):
        o, lse = mla_sparse_decode(d["qn"], d["qp"], d["pool"], d["kvb"], d["pos"], d["req"], d["tbl"], ba.BLOCK_SIZE,
                                   ba.SCALE, sel, latent_format="fp8", latent_scale=d["ls"], selection_rows=by_rows,
                                   latent_out=True, return_lse=True, config=cfg)
        lse64, o64 = want
        keep = torch.isfinite(lse64[:, 0])
        e_o = float((o.double()[keep] - o64[keep]).norm() / o64[keep].norm())
        e_l = float((lse.double()[keep] - lse64[keep]).norm() / lse64[keep].norm())
        empty_ok = bool((o[~keep] == 0).all()) and bool((lse[~keep] == float("-inf")).all())
        fin = bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse[keep]).all())
        out[name] = {"rel_err_o": e_o, "rel_err_lse": e_l, "empty_tokens": int((~keep).sum()), "empty_ok": empty_ok,
                     "ok": fin and empty_ok and e_o < 2e-2 and e_l < 2e-3}
    return {"ok": all(v["ok"] for v in out.values()), "config": cfg, **out}


def _save():
    text = json.dumps(DOC, indent=1, default=str)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "mla_b64.json"), "w").write(text)
    return text


def _set(T, seed):
    return mla_set(T, 8192, 2048, seed)


def measure(tag, name, cfg, sets, nbytes, calls=None):
    if BUDGET - (time.time() - T0) < 8:
        DOC["skipped"].append(f"{tag}_{name}")
        return None
    try:
        us = graph_ms(calls or [_call(d, cfg) for d in sets], reps=15) * 1e3
        m = {"name": f"{tag}_{name}", "config": cfg, "median_us": us, "bytes": nbytes}
        bw = DOC["hbm"].get("floor_TBps")
        if bw:
            m["floor_us"] = nbytes / (bw * 1e12) * 1e6
            m["frac_of_measured_bw"] = m["floor_us"] / us
        DOC["measurements"].append(m)
        frac = m.get("frac_of_measured_bw", 0) * 100
        print(f"{m['name']:34s} {us:8.2f} us {frac:5.1f}%", file=sys.stderr, flush=True)
        return m
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"{tag}_{name}: {e!r}\n{traceback.format_exc()[-1500:]}")
        return None
    finally:
        _save()


def check(name, fn):
    if BUDGET - (time.time() - T0) < 5:
        DOC["skipped"].append(f"check {name}")
        return None
    try:
        r = {"name": name, **fn()}
    except Exception as e:  # noqa: BLE001
        r = {"name": name, "ok": False, "error": repr(e)}
        DOC["errors"].append(f"check {name}: {e!r}\n{traceback.format_exc()[-1500:]}")
    DOC["checks"].append(r)
    _save()
    return r


def section(T):
    tag = f"b{T}"
    sets = [_set(T, 100 + i) for i in range(SETS.get(T, 4))]
    nbytes = T * 2048 * (576 + 8) + 12 * 128 * 512 * 2 + T * 12 * (192 * 2 + 512 * 2 + 4)
    res = {}
    for name, cfg in configs(T):
        ok = check(f"{tag}_{name}_vs_float64", lambda: _check(_set(T, 900 + len(res)), cfg))
        m = measure(tag, name, cfg, sets, nbytes)
        if m:
            m["checked_ok"] = bool(ok and ok["ok"])
            res[name] = m
    if not res:
        return
    for r in range(1, ROUNDS):     # more rounds, the configs alternated: each config's median is its rounds' median
        for name, cfg in configs(T):
            m = measure(tag, name, cfg, sets, nbytes) if name in res else None
            if m:
                m["round"] = r
                res[name].setdefault("rounds_us", [res[name]["median_us"]]).append(m["median_us"])
    for m in res.values():
        if "rounds_us" in m:
            m["median_us"] = sorted(m["rounds_us"])[len(m["rounds_us"]) // 2]
    others = [m for n, m in res.items() if n != "default" and m["checked_ok"]]
    best = min(others, key=lambda m: m["median_us"], default=None)
    summ = {"default_us": res.get("default", {}).get("median_us"), "default_config": configs(T)[0][1]}
    if best:
        summ.update(best_other=best["name"], best_other_us=best["median_us"], best_other_config=best["config"],
                    speedup_default_vs_best_other=summ["default_us"] and best["median_us"] / summ["default_us"])
    DOC.setdefault("summary", {})[tag] = summ
    # the default as the runtime runs it: q~ computed beforehand (the mla_absorb node, overlapped with the indexer on
    # the runtime's side stream), the attention's own bytes (no W_UK), results equal to the whole launcher's
    dflt = configs(T)[0][1]
    qa_bytes = T * 2048 * (576 + 8) + T * 12 * (512 * 2 + 64 * 2 + 512 * 2 + 4)
    same = check(f"{tag}_default_q_absorbed_equals_launcher", lambda: {"ok": all(
        torch.equal(a, b) for a, b in zip(_call(sets[0], dflt, absorbed=True)(), _call(sets[0], dflt)()))})
    m = measure(tag, "default_q_absorbed", dflt, [], qa_bytes,
                calls=[_call(d, dflt, absorbed=True) for d in sets])
    if m:
        m["checked_ok"] = bool(same and same["ok"])
        summ["default_q_absorbed_us"] = m["median_us"]
        summ["default_q_absorbed_frac"] = m.get("frac_of_measured_bw")
    for name, cfg in configs(T):   # graph replay == eager bitwise (PDL on) for every config that was timed
        if name in res:
            g = check(f"{tag}_{name}_graph_vs_eager", lambda: graph_vs_eager(_call(sets[0], cfg)))
            res[name]["graph_eq_eager"] = bool(g and g["ok"])
    if T > 1:
        for name, cfg in configs(T):
            if name in res and cfg.get("ORIENT") == 3:
                check(f"{tag}_{name}_holes_positions", lambda: holes_check(cfg))
                if cfg.get("FOLD") is None and 1 < -(-2048 // cfg["CHUNK"]) <= 4:
                    check(f"{tag}_{name}_fold_vs_combine", lambda: fold_check(sets[0], cfg))
    for name, cfg in configs(T):
        if T > 1 and name in L2RES:   # the kernel's cost without HBM: every token reads token 0's rows (L2 resident)
            l2 = dict(sets[0], rows=sets[0]["rows"][:1].expand(T, -1).contiguous())
            m = measure(tag, f"{name}_l2_resident_rows", cfg, [l2] * len(sets), nbytes)
            if m:
                summ[f"{name}_l2_resident_us"] = m["median_us"]
    del sets
    torch.cuda.empty_cache()


GATHER = [dict(pieces=4, R=32, warps=4, stages=3), dict(pieces=4, R=64, warps=4, stages=3),
          dict(pieces=8, R=32, warps=4, stages=3), dict(pieces=16, R=32, warps=4, stages=2),
          dict(pieces=2, R=64, warps=8, stages=4), dict(pieces=4, R=64, warps=8, stages=3),
          dict(pieces=8, R=64, warps=8, stages=2), dict(pieces=16, R=64, warps=4, stages=2)]


def gather_section(T):
    """--gather: the ceiling of the access pattern (`_gather_ceiling.gather_xor`: the selected rows' bytes read and
    xor-reduced, nothing else) over the same input sets, against the sequential-read floor; each variant checked against
    numpy's xor first."""
    from _gather_ceiling import gather_xor, reference_xor
    tag = f"b{T}_gather"
    sets = [_set(T, 100 + i) for i in range(SETS.get(T, 4))]
    nbytes = T * 2048 * 576
    for g in GATHER:
        name = "p{pieces}_r{R}_w{warps}_s{stages}".format(**g)
        d = sets[0]
        ok = check(f"{tag}_{name}_vs_torch", lambda: {"ok": bool(torch.equal(
            gather_xor(d["pool"], d["rows"], **g)(), reference_xor(d["pool"], d["rows"], g["pieces"])))})
        m = measure(tag, name, g, [], nbytes, calls=[gather_xor(x["pool"], x["rows"], **g) for x in sets])
        if m:
            m["checked_ok"] = bool(ok and ok["ok"])
    flat = [x["pool"].view(-1)[:nbytes].view(torch.float32) for x in sets]
    measure(tag, "sequential_read_same_bytes", {}, [], nbytes, calls=[lambda f=f: f.sum() for f in flat])
    del sets
    torch.cuda.empty_cache()


def kernels():
    from codegen.triton import _mla_gluon, _mla_heads, _mla_rowsm
    for fn in (_mla_heads._mla_heads_kernel, _mla_rowsm._mla_rowsm_kernel, _mla_gluon._mla_gluon_kernel):
        for caches in getattr(fn, "device_caches", {}).values():
            for k in list(caches[0].values()):
                try:
                    k._init_handles()
                    cx = {fn.arg_names[i[0]]: str(v) for i, v in getattr(k.src, "constants", {}).items()
                          if isinstance(i, tuple) and len(i) == 1 and fn.arg_names[i[0]].isupper()}
                    DOC["kernels"].append({"kernel": fn.__name__, "n_regs": k.n_regs, "n_spills": k.n_spills,
                                           "shared": k.metadata.shared, "num_warps": k.metadata.num_warps,
                                           "num_stages": k.metadata.num_stages, "constexprs": cx})
                except Exception as e:  # noqa: BLE001
                    DOC["kernels"].append({"kernel": fn.__name__, "error": repr(e)})


def warm(k, n):
    """Compile-only helper: a share of the configs (both batches), on small inputs of the same specialisation."""
    i = 0
    for T in (64, 32, 8, 1):
        d = _set(T, 7)
        for _, cfg in configs(T):
            if i % n == k:
                try:
                    _call(d, cfg)()
                except Exception:  # noqa: BLE001
                    pass
            i += 1
    torch.cuda.synchronize()


def main():
    if "--warm" in sys.argv:
        k, n = map(int, sys.argv[sys.argv.index("--warm") + 1].split(":"))
        warm(k, n)
        return
    import triton
    DOC["machine"] = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                      "gpu": torch.cuda.get_device_name()}
    n = 8
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", f"{k}:{n}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for k in range(n)]
    for p in procs:
        try:
            p.wait(timeout=max(1.0, T0 + 90 - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    DOC["warm_s"] = time.time() - T0
    x = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / (graph_ms([lambda: y.copy_(x)], 10) * 1e-3) / 1e12
    read = x.numel() / (graph_ms([lambda: x.view(torch.float32).sum()], 10) * 1e-3) / 1e12
    DOC["hbm"] = {"copy_TBps": copy, "read_TBps": read, "floor_TBps": max(copy, read)}
    del x, y
    torch.cuda.empty_cache()
    for T in (64, 32, 8, 1):
        if ONLY and str(T) not in ONLY:
            continue
        try:
            if "--gather" in sys.argv:
                gather_section(T)
            section(T)
        except Exception as e:  # noqa: BLE001
            DOC["errors"].append(f"b{T}: {e!r}\n{traceback.format_exc()[-1500:]}")
    try:
        kernels()
    except Exception as e:  # noqa: BLE001
        DOC["errors"].append(f"kernels: {e!r}")
    DOC["seconds"] = time.time() - T0
    _save()
    print(json.dumps({"summary": DOC.get("summary"), "errors": DOC["errors"], "skipped": DOC["skipped"],
                      "failed_checks": [c for c in DOC["checks"] if not c.get("ok")]}, indent=1, default=str))


if __name__ == "__main__":
    main()
