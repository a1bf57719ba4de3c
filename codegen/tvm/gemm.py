"""TVM dense GEMM family for the CPU: `linear` (y = x @ w^T, float w) and `fused.packed_linear`.

Math, per output row m and column n (fp32 or fp64, the activations' dtype):
    y[m, n] = sum_{k = 0..K-1} x[m, k] * w[n, k]      (k in increasing order, one accumulator per output)

Weight layout: the kernel streams w^T: the weights (the concatenation, for a packed projection) are
transposed once to wt [K, Npad] (Npad = N rounded up to 64, zero columns) and cached per weight object
and in-place version, so each k step is a contiguous row of wt (one extra copy of each weight, kept
while the weight lives). MXFP4 weights are read as stored by `gemm_mxfp4.py` instead.

Schedule (the tunables): the output is cut into BM x BN tiles; a tile's BM x BN accumulators live in
vector registers (BN columns = BN/16 AVX-512 vectors per row) and every k step adds x[m, k] * wt[k, tile]
(broadcast times a vector: no horizontal sums). UNROLL unrolls the BM rows; PAR = 2 runs the column
tiles on the thread pool (waking the pool costs ~7 us: only large GEMMs gain). Every output is reduced
over k in order whatever the config or M: batch invariant.
"""

from __future__ import annotations

import weakref

import torch

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket

from ._build import HAVE_TVM, build, cpu_rule, dtype_of, static_int, type_name, aligned

if HAVE_TVM:
    from tvm.script import tirx as T

PAD = 64  # wt columns are padded to a multiple of the largest BN
TUNABLES = (
    Tunable("BM", (1, 2, 4, 8)),
    Tunable("BN", (16, 32, 64)),
    Tunable("UNROLL", (0, 1)),
    Tunable("PAR", (1, 2)),
)


def _prim(NP: int, K: int, dt: str, BM: int, BN: int, UNROLL: int, PAR: int):
    inner = T.unroll if UNROLL else T.serial

    @T.prim_func(s_tir=True)
    def gemm(x_h: T.handle, wt: T.Buffer((K, NP), dt), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), dt)
        y = T.match_buffer(y_h, (M, NP), dt)
        for nb in T.parallel(NP // BN) if PAR > 1 else T.serial(NP // BN):
            for mb in range(T.ceildiv(M, BM)):
                acc = T.alloc_buffer((BM, BN), dt, scope="local")
                for a in inner(BM):
                    for j in T.vectorized(BN):
                        acc[a, j] = T.cast(0, dt)
                for k in range(K):
                    for a in inner(BM):
                        for j in T.vectorized(BN):
                            acc[a, j] = acc[a, j] + x[T.min(mb * BM + a, M - 1), k] * wt[k, nb * BN + j]
                for a in range(BM):
                    if mb * BM + a < M:
                        for j in T.vectorized(BN):
                            y[mb * BM + a, nb * BN + j] = acc[a, j]
    return gemm


# ---- transposed, padded weights: built once per distinct list of weight objects -------------------
_PACKED: dict[tuple, tuple] = {}


def transposed_weight(ws: list, dtype: torch.dtype) -> torch.Tensor:
    """wt [K, Npad] = concat(ws)^T in `dtype`, zero-padded to a multiple of PAD columns; cached by the
    weights' identity and in-place version (stale entries are dropped when a weight is freed)."""
    key = (tuple(id(w) for w in ws), dtype)
    versions = tuple(w._version for w in ws)
    hit = _PACKED.get(key)
    if hit is not None and all(r() is w for r, w in zip(hit[0], ws)) and hit[1] == versions:
        return hit[2]
    for k in [k for k, v in _PACKED.items() if any(r() is None for r in v[0])]:
        del _PACKED[k]
    w = torch.cat([w.to(dtype) for w in ws], dim=0)
    n, k = w.shape
    wt = torch.zeros(k, -(-n // PAD) * PAD, dtype=dtype)
    wt[:, :n] = w.t()
    _PACKED[key] = ([weakref.ref(w) for w in ws], versions, wt)
    return wt


def gemm(x: torch.Tensor, ws: list, config: dict) -> torch.Tensor:
    """y [M, N] = x [M, K] @ concat(ws)^T (N = sum of the weights' rows); a column view when N % 64."""
    if x.dim() != 2 or any(w.dim() != 2 or w.shape[1] != x.shape[1] for w in ws):
        raise ValueError(f"tvm gemm: x [M, K] and weights [N_i, K] expected, found x {tuple(x.shape)}, "
                         f"weights {[tuple(w.shape) for w in ws]}")
    problems = constraints(config, {}, "cpu")
    if problems:
        raise ValueError(f"tvm gemm config {config}: {'; '.join(problems)}")
    (M, K), N = x.shape, sum(int(w.shape[0]) for w in ws)
    dt = dtype_of(x, "x")
    wt = transposed_weight(ws, x.dtype)
    NP = wt.shape[1]
    y = torch.empty(M, NP, dtype=x.dtype)
    if M:
        cfg = tuple(config[t.name] for t in TUNABLES)
        fn = build("tvm_gemm", (NP, K, dt, cfg), lambda: _prim(NP, K, dt, *cfg))
        fn(aligned(x), wt, y)
    return y if NP == N else y[:, :N]


# ---- template plumbing ---------------------------------------------------------------------------
def _key(x, ws) -> dict:
    rows = 1
    for d in x.shape[:-1]:
        rows *= int(d)
    return {"M": rows, "N": sum(int(w.shape[0]) for w in ws), "K": int(x.shape[-1])}


def bucket(key: dict) -> dict:
    return {**key, "M": pow2_bucket(key["M"])}


def heuristic(key: dict, target: str) -> dict:
    """Rows per tile = M up to 4 (1, 2, 4) of 64 columns; past 64 MFLOP 8 x 32 tiles on the thread pool.
    Measured on the 2-core CPU (benches/bench_tvm_cpu.py): the pool lost at every k31-tiny shape (up to
    64 x 512 x 256) and won at 8 x 1536 x 7168."""
    M = key["M"]
    if 2 * M * key["N"] * key["K"] >= (1 << 26) and key["N"] > 64:
        return {"BM": 8, "BN": 32, "UNROLL": 1, "PAR": 2}
    return {"BM": 1 if M <= 1 else (2 if M <= 2 else 4), "BN": 64, "UNROLL": 1, "PAR": 1}


def constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    if PAD % config["BN"]:
        out.append(f"BN={config['BN']} does not divide the weight padding {PAD}")
    if config["BM"] * config["BN"] > 8 * 64:
        out.append(f"BM*BN={config['BM'] * config['BN']} accumulators exceed the 32 vector registers")
    return out


def _supports(family: str, x, ws, target) -> str | None:
    why = cpu_rule(family, target)
    if why:
        return why
    if type_name(x) not in ("f32", "bf16", "f16", "f64"):
        return f"activation dtype {type_name(x)} is not a float"
    kinds = sorted({type_name(w) for w in ws})
    if not set(kinds) <= {"f32", "bf16", "f16", "f64"}:
        return f"weight dtypes {kinds} (float weights only here; MXFP4 runs in tvm_gemm_mxfp4)"
    if any(len(w.shape) != 2 or static_int(w.shape[0]) is None for w in ws) or static_int(x.shape[-1]) is None:
        return "weights must be static 2-D [out, in]"
    return None


def _launch_linear(a, attrs, config):
    y = gemm(a.x.reshape(-1, a.x.shape[-1]), [a.w], config)
    return y.reshape(*a.x.shape[:-1], y.shape[-1])


def _launch_packed(a, attrs, config):
    x, ws = a.operands[0], list(a.operands[1:])
    splits = list(attrs["splits"])
    if len(splits) != len(ws) or any(int(w.shape[0]) != s for w, s in zip(ws, splits)):
        raise ValueError(f"packed_linear: splits {splits} do not match weights {[tuple(w.shape) for w in ws]}")
    y = gemm(x.reshape(-1, x.shape[-1]), ws, config)
    return tuple(part.reshape(*x.shape[:-1], part.shape[-1]) for part in torch.split(y, splits, dim=1))


TEMPLATES = [] if not HAVE_TVM else [
    KernelTemplate(
        family="tvm_gemm", backend="tvm", ops=("linear",), launch=_launch_linear,
        key_dims=lambda a, attrs: _key(a.x, [a.w]), heuristic=heuristic, tunables=TUNABLES, bucket=bucket,
        constraints=constraints, supports=lambda a, attrs, target: _supports("tvm_gemm", a.x, [a.w], target),
        batch_invariant=True, doc="y = x @ w^T on the CPU (TIR, llvm), float weights streamed transposed"),
    KernelTemplate(
        family="tvm_packed_gemm", backend="tvm", ops=("fused.packed_linear",), launch=_launch_packed,
        key_dims=lambda a, attrs: _key(a.operands[0], a.operands[1:]), heuristic=heuristic, tunables=TUNABLES,
        bucket=bucket, constraints=constraints,
        supports=lambda a, attrs, target: _supports("tvm_packed_gemm", a.operands[0], a.operands[1:], target),
        batch_invariant=True, doc="[y_1..y_n] = split(x @ concat(w_1..w_n)^T) on the CPU, weights packed once"),
]
