"""Two-operand elementwise kernel: the gated activations `situ_glu` and `swiglu` (SPEC §6), and `add`.

Per element (computed in fp32, fp64 when the operands are fp64 under the interpreter):
    situ_glu  y = b1*tanh(a/b1)*sigmoid(a) * b2*tanh(u/b2)   (beta1 None: b1 = 1; beta2 None: * u)
    swiglu    y = a*sigmoid(a) * u
    add       y = a + b
tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|), and for |x| < 0.25 (1e-3 in fp64) its Taylor
series to x^9 (error < 4e-8 relative; < 1e-30 in fp64), so small arguments keep their accuracy where
1 - e would cancel.

The operands may be column views of a packed projection's output (`fused.packed_linear`: row stride
> C); the result is a new contiguous tensor in a's dtype. A program handles a BLOCK_R x BLOCK_C tile.
Elementwise: batch invariant for any config.

`add` is implemented and tested but `supports` declines it: torch.add is already one elementwise
kernel, and the H200 bench (benches/bench_decode_fallbacks.py, MEASURED below) found this kernel within
noise of it inside a CUDA graph (1.36 vs 1.46 µs; 1.39 vs 1.44 µs at batch 8), while a Triton launch
costs more host time than a torch op outside one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._pdl import launch_kwargs, pdl_enter

ACTS = {"situ_glu": 0, "swiglu": 1, "add": 2}
PLAIN = ("f32", "bf16", "f16", "f64")
# H200, bf16, inside a CUDA graph (µs per launch): (this kernel, the torch op it would replace) at the
# rank preset's decode shapes; a template is offered only where it is faster.
MEASURED = {"add": {"shape": "[1, 7168] bf16", "triton_us": 1.36, "torch_us": 1.46}}
MIN_GAIN = 0.9  # offered only when at most 0.9x the torch op's time: smaller differences are noise


@triton.jit
def tanh_f(x, SMALL: tl.constexpr):
    """tanh(x): the series below |x| < SMALL (0.25 in fp32, 1e-3 in fp64), the exp form above."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.where(ax < SMALL, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def sigmoid_f(x):
    """1 / (1 + exp(-x)) without overflow: e = exp(-|x|) <= 1, sigmoid = (x >= 0 ? 1 : e) / (1 + e)."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def binary_math(a, u, beta1, beta2, ACT: tl.constexpr, HAS_B2: tl.constexpr, SMALL: tl.constexpr):
    """act(a, u) in the operands' (widened) dtype: ACT 0 situ_glu, 1 swiglu, 2 add (module docstring); shared
    with the GEMM epilogue that applies a GLU to its own output (packed_glu.py), so both round alike."""
    if ACT == 0:
        y = beta1 * tanh_f(a / beta1, SMALL) * sigmoid_f(a)
        if HAS_B2:
            u = beta2 * tanh_f(u / beta2, SMALL)
        y = y * u
    elif ACT == 1:
        y = a * sigmoid_f(a) * u
    else:
        y = a + u
    return y


@triton.jit
def _binary_kernel(a_ptr, u_ptr, y_ptr, R, C, stride_a, stride_u, stride_y, beta1, beta2,
                   ACT: tl.constexpr, HAS_B2: tl.constexpr, CDT: tl.constexpr, SMALL: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows[:, None] < R) & (cols[None, :] < C)
    a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=ok, other=0.0).to(CDT)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=ok, other=0.0).to(CDT)
    y = binary_math(a, u, beta1, beta2, ACT, HAS_B2, SMALL)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def _rows2d(x: torch.Tensor, C: int) -> torch.Tensor:
    x2 = x.reshape(-1, C)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def binary(act: str, a: torch.Tensor, u: torch.Tensor, config: dict, beta1=None, beta2=None) -> torch.Tensor:
    """y = act(a, u) elementwise (module doc); a and u of one shape [..., C]."""
    if a.shape != u.shape:
        raise ValueError(f"{act}: operands differ in shape, {tuple(a.shape)} vs {tuple(u.shape)}")
    if act not in ACTS:
        raise ValueError(f"unknown elementwise op {act!r} (one of {sorted(ACTS)})")
    C = a.shape[-1] if a.dim() else 1
    y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if a.numel() == 0:
        return y
    a2, u2, y2 = _rows2d(a, C), _rows2d(u, C), y.view(-1, C)
    R = a2.shape[0]
    br, bc = config["BLOCK_R"], config["BLOCK_C"]
    b1 = 1.0 if beta1 is None else float(beta1)
    fp64 = a.dtype == torch.float64
    _binary_kernel[(triton.cdiv(R, br), triton.cdiv(C, bc))](
        a2, u2, y2, R, C, a2.stride(0), u2.stride(0), y2.stride(0), b1, 1.0 if beta2 is None else float(beta2),
        ACT=ACTS[act], HAS_B2=beta2 is not None, CDT=tl.float64 if fp64 else tl.float32, SMALL=1e-3 if fp64 else 0.25,
        BLOCK_R=br, BLOCK_C=bc, num_warps=config["num_warps"], **launch_kwargs())
    return y


# ---- template plumbing ---------------------------------------------------------------------------
def _key(x) -> dict:
    rows = 1
    for d in x.shape[:-1]:
        rows *= int(d)
    return {"R": rows, "C": int(x.shape[-1]) if len(x.shape) else 1}


def _bucket(key: dict) -> dict:
    return {"R": pow2_bucket(key["R"]), "C": key["C"]}


TUNABLES = (Tunable("BLOCK_R", (1, 2, 4, 8, 16, 32)), Tunable("BLOCK_C", (256, 512, 1024, 2048, 4096)),
            Tunable("num_warps", (1, 2, 4, 8)))


def _heuristic(key: dict, target: str) -> dict:
    """GPU: one row x 512 columns per program, 8 warps (2 values per thread: the tanh/exp chain is latency
    bound, so more programs beat wider tiles). H200, rank preset rows of 3072 / 4224 bf16 in a CUDA graph:
    1.5 µs at batch 1 and 8 (1024 x 4 warps: 2.4 µs; 4 rows x 1024: 6.8 µs at batch 8; the reference
    chain 10.8-14.1 µs; torch.compile of it 1.4 µs). cpu (interpreter): one large tile."""
    if target == "cpu":
        bc = min(pow2_bucket(key["C"], 256), 4096)
        return {"BLOCK_R": max(1, min(32, 16384 // bc, pow2_bucket(key["R"]))), "BLOCK_C": bc, "num_warps": 4}
    return {"BLOCK_R": 1, "BLOCK_C": min(512, pow2_bucket(key["C"], 256)), "num_warps": 8}


def _constraints(config: dict, key: dict, target: str) -> list[str]:
    if config["BLOCK_R"] * config["BLOCK_C"] > 32768:
        return [f"tile BLOCK_R*BLOCK_C = {config['BLOCK_R'] * config['BLOCK_C']} > 32768 values"]
    return []


def _dtype_ok(*ts) -> str | None:
    for t in ts:
        name = getattr(t.dtype, "name", str(t.dtype))
        if getattr(t.dtype, "is_packed", False) or name not in PLAIN:
            return f"dtype {name} is not a plain float"
    return None


def _measured_slower(op: str, target: str) -> str | None:
    m = MEASURED.get(op)
    if m is None:
        return None
    if m["triton_us"] > MIN_GAIN * m["torch_us"]:
        return (f"torch's op is already one elementwise kernel; this kernel was not measurably faster on the H200 "
                f"({m['triton_us']:.2f} us vs {m['torch_us']:.2f} us, {m['shape']}, CUDA graph), so the torch op runs")
    return None


def _template(op: str, launch, doc: str) -> KernelTemplate:
    def supports(a, attrs, target):
        return _dtype_ok(*(getattr(a, n) for n in ("a", "u") if hasattr(a, n)), *([a.b] if hasattr(a, "b") else [])) \
            or _measured_slower(op, target)

    return KernelTemplate(
        family=op, backend="triton", ops=(op,), launch=launch, key_dims=lambda a, attrs: _key(a.a),
        heuristic=_heuristic, tunables=TUNABLES, bucket=_bucket, constraints=_constraints, supports=supports,
        batch_invariant=True, doc=doc)


TEMPLATES = [
    _template("situ_glu", lambda a, attrs, config: binary("situ_glu", a.a, a.u, config, attrs["beta1"],
                                                          attrs.get("beta2")),
              "b1*tanh(a/b1)*sigmoid(a) * b2*tanh(u/b2), one elementwise pass over strided rows"),
    _template("swiglu", lambda a, attrs, config: binary("swiglu", a.a, a.u, config),
              "silu(a) * u, one elementwise pass over strided rows"),
    _template("add", lambda a, attrs, config: binary("add", a.a, a.b, config),
              "a + b (declined where torch.add was measured as fast, see MEASURED)"),
]
