"""TVM row-norm family for the CPU: `rms_norm`, `attn_res_mix`, `fused.attn_res_mix_norm` and
`fused.embedding_rms_norm` (the rows gathered by indexing, exact copies, then `rms_norm`: the unfused pair's
numbers on the CPU, where a launch costs nothing worth fusing away).

Per row x[0:d] (fp32 or fp64, the input's dtype):
    rms_norm     y = x / sqrt(sum(x^2)/d + eps) * w                                  (w optional)
    mix          V = [bank_1..bank_n, last], w_c = mix_norm[c] * proj[c],
                 score_i = (V_i . w) / sqrt(sum(V_i^2)/d + eps),  alpha = softmax_i(score),
                 x = sum_i alpha_i V_i  (in source order, as `ir.ref.basic.attn_res_mix`)
    fused        [prefix = prev + part, stored; last = prefix]  then mix, then
                 h = x / sqrt(sum(x^2)/d + norm_eps) * norm_w   (passes/attn_res_fusion.py)
The bank sources arrive stacked ([n, T, d], one copy; the first source of a block has none).

Schedule (the tunables): row sums use VEC lanes (lane v sums columns c = v mod VEC, lanes added in
order), elementwise passes are VEC-wide vectors; PAR = 2 spreads the rows over the thread pool (the
pool wake-up costs ~7 us, so only long batches gain). A row's reduction order depends on d and VEC only:
batch invariant for a fixed VEC, and VEC is chosen from d.
"""

from __future__ import annotations

import torch

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket

from ..triton.attn_res import split_fused  # the fused node's operand order, defined once
from ._build import HAVE_TVM, aligned, build, cpu_rule, dtype_of, largest_divisor, static_int, type_name

if HAVE_TVM:
    from tvm.script import tirx as T

TUNABLES = (Tunable("VEC", (1, 4, 8, 16)), Tunable("PAR", (1, 2)))


def _rows(par: int, n):
    return T.parallel(n) if par > 1 else T.serial(n)


def _prim_rms(D: int, dt: str, has_w: bool, VEC: int, PAR: int):
    @T.prim_func(s_tir=True)
    def rms(x_h: T.handle, w: T.Buffer((D,), dt), y_h: T.handle, eps: T.float64):
        T.func_attr({"tirx.noalias": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, D), dt)
        y = T.match_buffer(y_h, (M, D), dt)
        for m in _rows(PAR, M):
            acc = T.alloc_buffer((VEC,), dt, scope="local")
            r = T.alloc_buffer((1,), dt, scope="local")
            for v in T.vectorized(VEC):
                acc[v] = T.cast(0, dt)
            for co in range(D // VEC):
                for v in T.vectorized(VEC):
                    acc[v] = acc[v] + x[m, co * VEC + v] * x[m, co * VEC + v]
            r[0] = T.cast(0, dt)
            for v in range(VEC):
                r[0] = r[0] + acc[v]
            r[0] = T.sqrt(r[0] / T.cast(D, dt) + T.cast(eps, dt))
            for co in range(D // VEC):
                for v in T.vectorized(VEC):
                    if has_w:
                        y[m, co * VEC + v] = x[m, co * VEC + v] / r[0] * w[co * VEC + v]
                    else:
                        y[m, co * VEC + v] = x[m, co * VEC + v] / r[0]
    return rms


def _prim_mix(D: int, NB: int, dt: str, prefix_add: bool, norm: bool, VEC: int, PAR: int):
    """bank [max(NB,1), T, D] (NB live), prev, part, prefix [1, T, D] (prefix written when prefix_add),
    out [T, D] (x, or h when norm)."""
    n = NB + 1

    @T.macro
    def score(src, i, m, proj, mnorm, acc):
        for v in T.vectorized(VEC):
            acc[0, v] = T.cast(0, dt)
            acc[1, v] = T.cast(0, dt)
        for co in range(D // VEC):
            for v in T.vectorized(VEC):
                acc[0, v] = acc[0, v] + src[i, m, co * VEC + v] * (mnorm[co * VEC + v] * proj[co * VEC + v])
                acc[1, v] = acc[1, v] + src[i, m, co * VEC + v] * src[i, m, co * VEC + v]
        for v in range(1, VEC):
            acc[0, 0] = acc[0, 0] + acc[0, v]
            acc[1, 0] = acc[1, 0] + acc[1, v]

    @T.prim_func(s_tir=True)
    def mix(proj: T.Buffer((D,), dt), mnorm: T.Buffer((D,), dt), g: T.Buffer((D,), dt), bank_h: T.handle,
            prev_h: T.handle, part_h: T.handle, prefix_h: T.handle, out_h: T.handle, eps: T.float64,
            norm_eps: T.float64):
        T.func_attr({"tirx.noalias": True})
        M = T.int64()
        bank = T.match_buffer(bank_h, (max(NB, 1), M, D), dt)
        prev = T.match_buffer(prev_h, (1, M, D), dt)
        part = T.match_buffer(part_h, (1, M, D), dt)
        prefix = T.match_buffer(prefix_h, (1, M, D), dt)
        out = T.match_buffer(out_h, (M, D), dt)
        for m in _rows(PAR, M):
            acc = T.alloc_buffer((2, VEC), dt, scope="local")
            sc = T.alloc_buffer((n + 2,), dt, scope="local")  # scores, then max and sum of exps
            xo = T.alloc_buffer((D,), dt, scope="local")
            for i in range(NB):
                score(bank, i, m, proj, mnorm, acc)
                sc[i] = acc[0, 0] / T.sqrt(acc[1, 0] / T.cast(D, dt) + T.cast(eps, dt))
            if prefix_add:
                for co in range(D // VEC):
                    for v in T.vectorized(VEC):
                        prefix[0, m, co * VEC + v] = prev[0, m, co * VEC + v] + part[0, m, co * VEC + v]
                score(prefix, 0, m, proj, mnorm, acc)
            else:
                score(prev, 0, m, proj, mnorm, acc)
            sc[NB] = acc[0, 0] / T.sqrt(acc[1, 0] / T.cast(D, dt) + T.cast(eps, dt))
            sc[n] = sc[0]
            for i in range(1, n):
                sc[n] = T.max(sc[n], sc[i])
            sc[n + 1] = T.cast(0, dt)
            for i in range(n):
                sc[i] = T.exp(sc[i] - sc[n])
                sc[n + 1] = sc[n + 1] + sc[i]
            for co in range(D // VEC):
                for v in T.vectorized(VEC):
                    xo[co * VEC + v] = T.cast(0, dt)
            for i in range(NB):
                for co in range(D // VEC):
                    for v in T.vectorized(VEC):
                        xo[co * VEC + v] = xo[co * VEC + v] + sc[i] / sc[n + 1] * bank[i, m, co * VEC + v]
            for co in range(D // VEC):
                for v in T.vectorized(VEC):
                    if prefix_add:
                        xo[co * VEC + v] = xo[co * VEC + v] + sc[NB] / sc[n + 1] * prefix[0, m, co * VEC + v]
                    else:
                        xo[co * VEC + v] = xo[co * VEC + v] + sc[NB] / sc[n + 1] * prev[0, m, co * VEC + v]
            if norm:
                for v in T.vectorized(VEC):
                    acc[1, v] = T.cast(0, dt)
                for co in range(D // VEC):
                    for v in T.vectorized(VEC):
                        acc[1, v] = acc[1, v] + xo[co * VEC + v] * xo[co * VEC + v]
                for v in range(1, VEC):
                    acc[1, 0] = acc[1, 0] + acc[1, v]
                acc[0, 0] = T.sqrt(acc[1, 0] / T.cast(D, dt) + T.cast(norm_eps, dt))
                for co in range(D // VEC):
                    for v in T.vectorized(VEC):
                        out[m, co * VEC + v] = xo[co * VEC + v] / acc[0, 0] * g[co * VEC + v]
            else:
                for co in range(D // VEC):
                    for v in T.vectorized(VEC):
                        out[m, co * VEC + v] = xo[co * VEC + v]
    return mix


def _check(config: dict, d: int, what: str):
    if d % config["VEC"]:
        raise ValueError(f"tvm {what}: VEC={config['VEC']} does not divide the row length {d}")


def rms_norm(x: torch.Tensor, weight, eps: float, config: dict) -> torch.Tensor:
    D = x.shape[-1]
    _check(config, D, "rms_norm")
    dt = dtype_of(x, "rms_norm input")
    x2 = aligned(x.reshape(-1, D))
    y = torch.empty_like(x2)
    if x2.shape[0]:
        w = (aligned(weight.to(x.dtype)) if weight is not None else x2.new_ones(D))
        cfg = (config["VEC"], config["PAR"])
        has_w = weight is not None
        fn = build("tvm_rms_norm", (D, dt, has_w, cfg), lambda: _prim_rms(D, dt, has_w, *cfg))
        fn(x2, w, y, float(eps))
    return y.reshape(x.shape)


def attn_res_mix(bank: list, last, proj, mix_norm, eps: float, config: dict, *, part=None, norm_weight=None,
                 norm_eps: float = 0.0):
    """(prefix or None, out): out = mix (or its RMSNorm when norm_weight is given); see the docstring."""
    shape, D = last.shape, last.shape[-1]
    _check(config, D, "attn_res_mix")
    dt = dtype_of(last, "attn_res_mix sources")
    for s in [*bank, *([part] if part is not None else [])]:
        if s.shape != shape or s.dtype != last.dtype:
            raise ValueError(f"tvm attn_res_mix: sources differ: {tuple(s.shape)} {s.dtype} vs "
                             f"{tuple(shape)} {last.dtype}")
    prev = aligned(last.reshape(-1, D))
    vec = lambda t: aligned(t.reshape(-1).to(last.dtype))  # noqa: E731
    proj, mnorm = vec(proj), vec(mix_norm)
    if proj.numel() != D or mnorm.numel() != D:
        raise ValueError(f"tvm attn_res_mix: proj {proj.numel()} / norm {mnorm.numel()} values do not match d={D}")
    g = vec(norm_weight) if norm_weight is not None else proj
    stacked = torch.stack([b.reshape(-1, D) for b in bank]) if bank else prev.unsqueeze(0)
    part2 = aligned(part.reshape(-1, D)) if part is not None else prev
    prefix = torch.empty_like(prev) if part is not None else prev
    out = torch.empty_like(prev)
    if prev.shape[0]:
        flags = (len(bank), dt, part is not None, norm_weight is not None)
        cfg = (config["VEC"], config["PAR"])
        fn = build("tvm_attn_res_mix", (D, *flags, cfg), lambda: _prim_mix(D, *flags, *cfg))
        fn(proj, mnorm, g, stacked, prev[None], part2[None], prefix[None], out, float(eps), float(norm_eps))
    return (prefix.reshape(shape) if part is not None else None), out.reshape(shape)


# ---- template plumbing ---------------------------------------------------------------------------
def _nrows(x) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= int(d)
    return n


def bucket(key: dict) -> dict:
    return {**key, "T": pow2_bucket(key["T"])}


def heuristic(key: dict, target: str) -> dict:
    """8 lanes for rows up to 1024 values, 16 above; the thread pool only past 2^20 values (at every measured
    shape, d = 256 and 7168 with 1..64 rows, it did not pay on the 2-core CPU: bench_tvm_cpu.py)."""
    vec = largest_divisor(key["d"], (1, 4, 8) if key["d"] <= 1024 else (1, 4, 8, 16))
    return {"VEC": vec, "PAR": 2 if key["T"] * key["d"] * key.get("n", 1) >= (1 << 20) else 1}


def constraints(config: dict, key: dict, target: str) -> list[str]:
    return [] if key["d"] % config["VEC"] == 0 else [f"VEC={config['VEC']} does not divide d={key['d']}"]


def _supports(family: str, x, target) -> str | None:
    why = cpu_rule(family, target)
    if why:
        return why
    if static_int(x.shape[-1]) is None:
        return f"row length {x.shape[-1]} is symbolic"
    if type_name(x) not in ("f32", "bf16", "f16", "f64"):
        return f"dtype {type_name(x)} is not a float"
    return None


def _launch_rms(a, attrs, config):
    return rms_norm(a.x, a.weight, attrs["eps"], config)


def _launch_mix(a, attrs, config):
    return attn_res_mix(a.sources[:-1], a.sources[-1], a.proj, a.norm, attrs["eps"], config)[1]


def _launch_mix_norm(a, attrs, config):
    proj, mnorm, g, bank, last, part = split_fused(a.operands, attrs)
    prefix, h = attn_res_mix(bank, last, proj, mnorm, attrs["eps"], config, part=part, norm_weight=g,
                             norm_eps=attrs["norm_eps"])
    return (prefix, h) if part is not None else h


def _launch_embedding_rms(a, attrs, config):
    table, ids, weight = a.operands
    e = table[ids]      # exact row copies; a negative id counts from the end, as `embedding` does
    return e, rms_norm(e, weight, attrs["eps"], config)


def _key_embedding(a, attrs) -> dict:
    table, ids, _ = a.operands
    n = 1
    for d in ids.shape:
        n *= int(d)
    return {"T": n, "d": int(table.shape[-1]), "n": 1}


def _key_rows(x, n: int = 1) -> dict:
    return {"T": _nrows(x), "d": int(x.shape[-1]), "n": n}


def _template(family, op, launch, key_dims, x_of, doc):
    return KernelTemplate(
        family=family, backend="tvm", ops=(op,), launch=launch, key_dims=key_dims, heuristic=heuristic,
        tunables=TUNABLES, bucket=bucket, constraints=constraints,
        supports=lambda a, attrs, target: _supports(family, x_of(a, attrs), target), batch_invariant=True, doc=doc)


def _fused_last(a, attrs):
    return split_fused(a.operands, attrs)[4]


TEMPLATES = [] if not HAVE_TVM else [
    _template("tvm_rms_norm", "rms_norm", _launch_rms, lambda a, attrs: _key_rows(a.x), lambda a, attrs: a.x,
              "x / sqrt(mean(x^2) + eps) * w on the CPU (TIR, llvm)"),
    _template("tvm_attn_res_mix", "attn_res_mix", _launch_mix,
              lambda a, attrs: _key_rows(a.sources[0], len(a.sources)), lambda a, attrs: a.sources[0],
              "AttnRes mix on the CPU: softmax over sources of rmsnorm(V_i).w, weighted sum"),
    _template("tvm_attn_res_mix_norm", "fused.attn_res_mix_norm", _launch_mix_norm,
              lambda a, attrs: _key_rows(_fused_last(a, attrs), int(attrs["bank"]) + 1), _fused_last,
              "prefix add + AttnRes mix + the following RMSNorm on the CPU, one pass per row"),
    _template("tvm_embedding_rms_norm", "fused.embedding_rms_norm", _launch_embedding_rms, _key_embedding,
              lambda a, attrs: a.operands[0], "embedding rows (indexing) + rms_norm on the CPU"),
]
