"""TVM MXFP4 GEMM family for the CPU: `linear` whose weight is MXFP4, read as stored and dequantised in
the kernel (y = x @ w^T, w = `ir.packed.PackedMXFP4`: packed u8 [N, K/2], low nibble = even k; scales u8
[N, K/32]), exactly as `ir.formats.dequantize_mxfp4`:
    code = low or high nibble of packed[n, k/2] (k even: low);  |e2m1| from the bits: e = (code & 7) >> 1,
    m = code & 1, value = m/2 when e = 0 else 2^(e-1) (1 + m/2), negated when code & 8;
    scale = 2^(s - 127) built from the bits of an fp32 (s = 0: the subnormal 2^-127, s = 255: NaN);
    y[m, n] = sum_k x[m, k] * value * scale   (value * scale is exact: a power-of-two multiple)
The weight is never dequantised in memory: the kernel reads 0.53 bytes per weight instead of 4.

Schedule (the tunables): BM x BN micro-tiles (rows of x x rows of w); each 16-byte run of a weight
row's scale block is walked VB bytes at a time as vectors of bytes: the low nibbles are the even k, the
high ones the odd k (x read with stride 2). A tile keeps BM*BN*2 accumulators of VB lanes (lane (p, v)
sums the k = 2j + p of the bytes j = v mod VB), added in order at the end. UNROLL unrolls the micro-tile
loops; PAR = 2 runs the column tiles on the thread pool. A row's reduction order depends on K and VB
only: batch invariant for a fixed VB (the heuristic's VB does not depend on M).
"""

from __future__ import annotations

import torch

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from ir.packed import PackedMXFP4

from ._build import HAVE_TVM, aligned, build, cpu_rule, dtype_of, largest_divisor, static_int, type_name

if HAVE_TVM:
    from tvm.script import tirx as T

U8 = "uint8"
TUNABLES = (
    Tunable("BM", (1, 2, 4)),
    Tunable("BN", (1, 2, 4, 8)),
    Tunable("VB", (4, 8, 16)),
    Tunable("UNROLL", (0, 1)),
    Tunable("PAR", (1, 2)),
)


def _prim_mxfp4(N: int, K: int, dt: str, BM: int, BN: int, VB: int, UNROLL: int, PAR: int):
    NB = N // BN
    inner = T.unroll if UNROLL else T.serial

    @T.prim_func(s_tir=True)
    def gemm_mx(x_h: T.handle, wp: T.Buffer((N, K // 2), U8), ws: T.Buffer((N, K // 32), U8), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), dt)
        y = T.match_buffer(y_h, (M, N), dt)
        for nb in T.parallel(NB) if PAR > 1 else T.serial(NB):
            for mb in range(T.ceildiv(M, BM)):
                acc = T.alloc_buffer((BM, BN, 2, VB), dt, scope="local")  # [.., parity of k, byte lane]
                scl = T.alloc_buffer((BN,), dt, scope="local")
                for a, b, p in T.grid(BM, BN, 2):
                    for v in T.vectorized(VB):
                        acc[a, b, p, v] = T.cast(0, dt)
                for kb in range(K // 32):
                    for b in range(BN):
                        sb = T.cast(ws[nb * BN + b, kb], "int32")
                        scl[b] = T.cast(T.reinterpret("float32", T.Select(
                            sb == 0, 0x400000, T.Select(sb == 255, 0x7FC00000, T.shift_left(sb, 23)))), dt)
                    for jb in range(16 // VB):
                        for a in inner(BM):
                            for b in inner(BN):
                                for p in T.unroll(2):
                                    for v in T.vectorized(VB):
                                        # meta_var inlines (a let inside a vectorized loop would bind one lane)
                                        j = T.meta_var(kb * 16 + jb * VB + v)  # byte: k = 2j (low), 2j+1 (high)
                                        code = T.meta_var(T.bitwise_and(T.shift_right(
                                            T.cast(wp[nb * BN + b, j], "int32"), p * 4), 15))
                                        e = T.meta_var(T.shift_right(T.bitwise_and(code, 7), 1))
                                        m = T.meta_var(T.bitwise_and(code, 1))
                                        bits = T.meta_var(T.Select(e == 0, m * (126 << 23),
                                                                   T.shift_left(e + 126, 23) + T.shift_left(m, 22)))
                                        val = T.meta_var(T.reinterpret("float32", T.bitwise_or(
                                            bits, T.shift_left(T.shift_right(code, 3), 31))))
                                        acc[a, b, p, v] = acc[a, b, p, v] + x[T.min(mb * BM + a, M - 1), 2 * j + p] \
                                            * (T.cast(val, dt) * scl[b])
                for a, b in T.grid(BM, BN):
                    if mb * BM + a < M:
                        s = T.alloc_buffer((1,), dt, scope="local")
                        s[0] = T.cast(0, dt)
                        for p, v in T.grid(2, VB):
                            s[0] = s[0] + acc[a, b, p, v]
                        y[mb * BM + a, nb * BN + b] = s[0]
    return gemm_mx


def gemm_mxfp4(x: torch.Tensor, w: PackedMXFP4, config: dict) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantize(w)^T, w a PackedMXFP4 of logical shape [N, K]."""
    if x.dim() != 2 or not isinstance(w, PackedMXFP4) or len(w.shape) != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"tvm MXFP4 gemm: x [M, K] and a 2-D PackedMXFP4 [N, K] expected, found x "
                         f"{tuple(x.shape)}, w {type(w).__name__} {tuple(getattr(w, 'shape', ()))}")
    (M, K), N = x.shape, int(w.shape[0])
    dt = dtype_of(x, "x")
    problems = constraints(config, {"N": N, "K": K}, "cpu")
    if problems:
        raise ValueError(f"tvm MXFP4 gemm config {config} for N={N}, K={K}: {'; '.join(problems)}")
    y = torch.empty(M, N, dtype=x.dtype)
    if M:
        cfg = tuple(config[t.name] for t in TUNABLES)
        fn = build("tvm_gemm_mxfp4", (N, K, dt, cfg), lambda: _prim_mxfp4(N, K, dt, *cfg))
        fn(aligned(x), aligned(w.packed), aligned(w.scales), y)
    return y


def key_dims(a, attrs) -> dict:
    rows = 1
    for d in a.x.shape[:-1]:
        rows *= int(d)
    return {"M": rows, "N": int(a.w.shape[0]), "K": int(a.x.shape[-1])}


def heuristic(key: dict, target: str) -> dict:
    """One row x 8 weight rows for M <= 2 (weight streaming), 4 x 2 above; 16 bytes (32 weights) per vector
    step; the thread pool past ~4 MFLOP."""
    bm = 1 if key["M"] <= 2 else 4
    bn = largest_divisor(key["N"], (1, 2, 4, 8) if bm == 1 else (1, 2))
    par = 2 if key["M"] * key["N"] * key["K"] >= (1 << 21) and key["N"] // bn >= 2 else 1
    return {"BM": bm, "BN": bn, "VB": 16, "UNROLL": 1, "PAR": par}


def constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    if key["N"] % config["BN"]:
        out.append(f"BN={config['BN']} does not divide N={key['N']}")
    if key["K"] % 32 or 16 % config["VB"]:
        out.append(f"VB={config['VB']} must divide the 16 bytes of an MXFP4 block, and 32 must divide K={key['K']}")
    if config["BM"] * config["BN"] > 16:
        out.append(f"BM*BN={config['BM'] * config['BN']} accumulator vectors exceed 16 registers")
    return out


def supports(a, attrs, target) -> str | None:
    why = cpu_rule("tvm_gemm_mxfp4", target)
    if why:
        return why
    if type_name(a.w) != "mxfp4":
        return f"weight is {type_name(a.w)}, not mxfp4 (float weights run in tvm_gemm)"
    if type_name(a.x) not in ("f32", "bf16", "f16", "f64"):
        return f"activation dtype {type_name(a.x)} is not a float"
    if len(a.w.shape) != 2 or static_int(a.w.shape[0]) is None or static_int(a.x.shape[-1]) is None:
        return "the weight must be a static 2-D [out, in]"
    return None


def _launch(a, attrs, config):
    y = gemm_mxfp4(a.x.reshape(-1, a.x.shape[-1]), a.w, config)
    return y.reshape(*a.x.shape[:-1], y.shape[-1])


TEMPLATES = [] if not HAVE_TVM else [KernelTemplate(
    family="tvm_gemm_mxfp4", backend="tvm", ops=("linear",), launch=_launch, key_dims=key_dims,
    heuristic=heuristic, tunables=TUNABLES, bucket=lambda key: {**key, "M": pow2_bucket(key["M"])},
    constraints=constraints, supports=supports, batch_invariant=True,
    doc="y = x @ w^T on the CPU with MXFP4 weights dequantised in the kernel (TIR, llvm)")]
