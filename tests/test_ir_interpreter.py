"""The reference interpreter (ir/interpreter.py) on small FunctionBuilder functions, against float64
formulas written here; fused bodies; compute dtypes; input errors; in-place pools."""

from __future__ import annotations

import math

import pytest
import torch

from ir.builder import FunctionBuilder
from ir.core import Function, Module, Node, Param, TensorType, Value
from ir.formats import quantize_mxfp4
from ir.interpreter import Interpreter, InterpreterError
from ir.packed import PackedMXFP4
from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import verify

try:
    from tests.helpers import assert_close_rel
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _module(params: dict[str, tuple[str, tuple]]) -> Module:
    m = Module("t")
    for name, (dt, dims) in params.items():
        m.add_param(Param(name, TensorType.of(dt, dims)))
    return m


def _finish(m: Module, b: FunctionBuilder, *outs) -> Module:
    m.add_function(b.ret(*outs))
    assert verify(m) == []
    return m


# ---- float64 formulas --------------------------------------------------------------------------
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _dequant_mxfp4_f64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Own decoder: low nibble = even element, bit 3 sign, E8M0 scale 2^(b-127) per 32 values."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half, dtype=torch.float64)
    for r in range(rows):
        for j in range(half):
            byte = int(packed[r, j])
            for k, code in enumerate((byte & 0xF, byte >> 4)):
                v = _E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
                col = 2 * j + k
                out[r, col] = v * 2.0 ** (int(scales[r, col // 32]) - 127)
    return out


def _rms_norm64(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _mix64(sources, proj, norm, eps):
    """SPEC §2 mix, one token at a time with explicit loops."""
    T, d = sources[0].shape
    out = torch.zeros(T, d, dtype=torch.float64)
    for t in range(T):
        scores = []
        for v in sources:
            row = v[t]
            inv = 1.0 / math.sqrt(sum(float(c) ** 2 for c in row) / d + eps)
            scores.append(sum(float(row[c]) * inv * float(norm[c]) * float(proj[0, c]) for c in range(d)))
        mx = max(scores)
        ex = [math.exp(s - mx) for s in scores]
        z = sum(ex)
        for e, v in zip(ex, sources):
            out[t] += (e / z) * v[t]
    return out


# ---- ops against formulas ----------------------------------------------------------------------
def test_linear_with_mxfp4_weight():
    N, K, T = 24, 64, 5
    g = _gen(11)
    wf = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g))  # rows of varied scale
    packed, scales = quantize_mxfp4(wf)
    m = _module({"w": ("mxfp4", (N, K)), "w_bf16": ("bf16", (N, K))})
    b = FunctionBuilder(m, "f")
    x = b.input("x", "bf16", ("T", K))
    y = b.op("linear", x, b.param("w"))
    y2 = b.op("linear", x, b.param("w_bf16"))
    _finish(m, b, y, y2)
    assert str(y.type) == "bf16[T,24]"
    x_t = torch.randn(T, K, generator=g)
    wd = _dequant_mxfp4_f64(packed, scales)
    assert (wd - wf.double()).abs().max() > 0  # quantisation really happened
    w_bf16 = wf.to(torch.bfloat16)
    for cdt, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        out, out2 = Interpreter(m, {"w": PackedMXFP4(packed, scales), "w_bf16": w_bf16}, cdt).run("f", {"x": x_t})
        assert out.dtype == cdt and out.shape == (T, N)
        assert_close_rel(out, x_t.double() @ wd.T, tol, f"mxfp4 linear {cdt}")
        assert_close_rel(out2, x_t.double() @ w_bf16.double().T, tol, f"bf16 linear {cdt}")
    # the dequantised weight differs from the float one: comparing against it must fail
    with pytest.raises(AssertionError):
        assert_close_rel(out, x_t.double() @ wf.double().T, 1e-5)


def test_rms_norm_and_elementwise():
    d, T = 48, 7
    g = _gen(12)
    m = _module({"gain": ("f32", (d,))})
    b = FunctionBuilder(m, "f")
    x = b.input("x", "f32", ("T", d))
    n = b.op("rms_norm", x, b.param("gain"), eps=1e-5)
    n0 = b.op("rms_norm", x, eps=1e-2)
    s = b.op("mul", b.op("silu", n), b.op("scale", b.op("sigmoid", n0), factor=-1.5))
    _finish(m, b, n, s)
    gain = 1 + 0.1 * torch.randn(d, generator=g)
    x_t = torch.randn(T, d, generator=g) * 3
    out_n, out_s = Interpreter(m, {"gain": gain}, torch.float64).run("f", [x_t])
    x64 = x_t.double()
    ref_n = _rms_norm64(x64, gain.double(), 1e-5)
    ref_n0 = _rms_norm64(x64, 1.0, 1e-2)
    ref_s = ref_n * torch.sigmoid(ref_n) * (-1.5 / (1 + torch.exp(-ref_n0)))
    assert_close_rel(out_n, ref_n, 1e-12, "rms_norm")
    assert_close_rel(out_s, ref_s, 1e-12, "silu*scale(sigmoid)")


def test_attn_res_mix_vs_loop():
    d, T, n_src = 32, 4, 3
    g = _gen(13)
    m = _module({"proj": ("bf16", (1, d)), "norm": ("bf16", (d,))})
    b = FunctionBuilder(m, "f")
    srcs = [b.input(f"v{i}", "f32", ("T", d)) for i in range(n_src)]
    y = b.op("attn_res_mix", b.param("proj"), b.param("norm"), *srcs, eps=1e-5)
    _finish(m, b, y)
    proj = (torch.randn(1, d, generator=g)).to(torch.bfloat16)
    norm = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16)
    vs = [torch.randn(T, d, generator=g) * (i + 1) for i in range(n_src)]
    ref = _mix64([v.double() for v in vs], proj.double(), norm.double(), 1e-5)
    for cdt, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        (out,) = Interpreter(m, {"proj": proj, "norm": norm}, cdt).run("f", {f"v{i}": v for i, v in enumerate(vs)})
        assert_close_rel(out, ref, tol, f"attn_res_mix {cdt}")
    # the weights are not uniform: a plain average is far from it
    with pytest.raises(AssertionError):
        assert_close_rel(sum(v.double() for v in vs) / n_src, ref, 1e-3)


def test_reshape_slice_concat():
    T, H, D = 3, 4, 8
    g = _gen(14)
    m = Module("t")
    b = FunctionBuilder(m, "f")
    x = b.input("x", "f32", ("T", H * D))
    z = b.input("z", "f32", ("T", 5))
    r = b.op("reshape", x, shape=[-1, H, D])
    s = b.op("slice", r, axis=2, start=2, stop=6)
    s2 = b.op("slice", r, axis=-2, start=1, stop=3)
    flat = b.op("reshape", s, shape=[-1, H * 4])
    c = b.op("concat", flat, z, flat, axis=1)
    c0 = b.op("concat", x, x, axis=0)
    _finish(m, b, r, s, s2, c, c0)
    assert [str(v.type) for v in (r, s, s2, c, c0)] == [
        "f32[T,4,8]", "f32[T,4,4]", "f32[T,2,8]", "f32[T,37]", "f32[2*T,32]"]
    x_t, z_t = torch.randn(T, H * D, generator=g), torch.randn(T, 5, generator=g)
    outs = Interpreter(m, {}, torch.float64).run("f", {"x": x_t, "z": z_t})
    x64, z64 = x_t.double(), z_t.double()
    ref_r = torch.tensor([[[float(x64[t, h * D + e]) for e in range(D)] for h in range(H)] for t in range(T)],
                         dtype=torch.float64)
    ref_s = ref_r[:, :, 2:6]
    ref_c = torch.cat([ref_s.reshape(T, -1), z64, ref_s.reshape(T, -1)], 1)
    for got, ref in zip(outs, (ref_r, ref_s, ref_r[:, 1:3], ref_c, torch.cat([x64, x64]))):
        assert got.shape == ref.shape and torch.equal(got, ref)


# ---- fused bodies ------------------------------------------------------------------------------
def _fused_and_unfused():
    """Two functions: linear -> sigmoid -> mul unfused, and the same as one node carrying it as body."""
    m = _module({"w": ("bf16", (16, 8))})
    b = FunctionBuilder(m, "unfused")
    x = b.input("x", "f32", ("T", 8))
    l = b.op("linear", x, b.param("w"))
    y = b.op("mul", l, b.op("sigmoid", l))
    m.add_function(b.ret(b.op("scale", y, factor=0.5)))

    body = FunctionBuilder(m, "glu.body")
    a = body.input("a", "f32", ("T", 8))
    w = body.input("wt", "bf16", (16, 8))
    lb = body.op("linear", a, w)
    body_fn = body.ret(body.op("mul", lb, body.op("sigmoid", lb)))

    b2 = FunctionBuilder(m, "fused")
    x2 = b2.input("x", "f32", ("T", 8))
    node = Node("fused_linear_silu", [x2, b2.param("w")], {}, body=body_fn)
    node.outputs = [Value("y", TensorType.of("f32", ("T", 16)), node)]
    b2.fn.nodes.append(node)
    m.add_function(b2.ret(b2.op("scale", node.outputs[0], factor=0.5)))
    assert verify(m) == []
    return m


def test_node_with_body_equals_unfused():
    m = _fused_and_unfused()
    g = _gen(15)
    wts = {"w": torch.randn(16, 8, generator=g).to(torch.bfloat16)}
    x_t = torch.randn(6, 8, generator=g)
    for cdt in (torch.float32, torch.float64):
        it = Interpreter(m, wts, cdt)
        (u,) = it.run("unfused", {"x": x_t})
        (f,) = it.run("fused", {"x": x_t})
        assert torch.equal(u, f)
        l64 = x_t.double() @ wts["w"].double().T
        assert_close_rel(f, 0.5 * l64 * torch.sigmoid(l64), 1e-5 if cdt == torch.float32 else 1e-12, str(cdt))
    # also after a text round trip
    back = parse_module(print_module(m))
    (f2,) = Interpreter(back, wts).run("fused", {"x": x_t})
    (u2,) = Interpreter(m, wts).run("unfused", {"x": x_t})
    assert torch.equal(f2, u2)


def test_body_is_what_runs():
    """Changing the body changes the fused node's result (the interpreter does not look at the op name)."""
    m = _fused_and_unfused()
    fused = m.functions["fused"].nodes[0]
    fused.body.nodes[1].op = "silu"  # mul(l, silu(l)) instead of mul(l, sigmoid(l))
    g = _gen(16)
    wts = {"w": torch.randn(16, 8, generator=g).to(torch.bfloat16)}
    x_t = torch.randn(4, 8, generator=g)
    (f,) = Interpreter(m, wts, torch.float64).run("fused", {"x": x_t})
    l64 = x_t.double() @ wts["w"].double().T
    assert_close_rel(f, 0.5 * l64 * l64 * torch.sigmoid(l64), 1e-12)


def test_unregistered_op_without_body_errors():
    m = _fused_and_unfused()
    m.functions["fused"].nodes[0].body = None
    with pytest.raises(InterpreterError, match="'fused_linear_silu' is not registered and has no body"):
        Interpreter(m, {"w": torch.ones(16, 8)}).run("fused", {"x": torch.ones(2, 8)})


# ---- compute dtypes ----------------------------------------------------------------------------
def test_fp64_and_fp32_compute_agree():
    d, T, n_src = 64, 5, 3
    g = _gen(17)
    m = _module({"w1": ("bf16", (96, d)), "w2": ("bf16", (d, 48)), "gain": ("bf16", (48,)),
                 "proj": ("bf16", (1, d)), "norm": ("bf16", (d,))})
    b = FunctionBuilder(m, "f")
    x = b.input("x", "bf16", ("T", d))
    h = b.op("linear", x, b.param("w1"))
    a, u = b.op("slice", h, axis=1, start=0, stop=48), b.op("slice", h, axis=1, start=48, stop=96)
    act = b.op("situ_glu", a, u, beta1=4.0, beta2=25.0)
    y = b.op("linear", b.op("rms_norm", act, b.param("gain"), eps=1e-5), b.param("w2"))
    mix = b.op("attn_res_mix", b.param("proj"), b.param("norm"), x, y, b.op("add", x, y), eps=1e-5)
    _finish(m, b, b.op("cast", mix, dtype="f32"))
    wts = {"w1": torch.randn(96, d, generator=g) * d ** -0.5, "w2": torch.randn(d, 48, generator=g) * 48 ** -0.5,
           "gain": 1 + 0.1 * torch.randn(48, generator=g), "proj": torch.randn(1, d, generator=g),
           "norm": torch.ones(d) + 0.1 * torch.randn(d, generator=g)}
    wts = {k: v.to(torch.bfloat16) for k, v in wts.items()}
    x_t = torch.randn(T, d, generator=g).to(torch.bfloat16)
    (o32,) = Interpreter(m, wts, torch.float32).run("f", {"x": x_t})
    (o64,) = Interpreter(m, wts, torch.float64).run("f", {"x": x_t})
    assert o32.dtype == torch.float32 and o64.dtype == torch.float64
    err = assert_close_rel(o32, o64, 1e-5, "fp32 vs fp64 compute")
    assert err > 0  # they are computed differently


# ---- input errors ------------------------------------------------------------------------------
def _small():
    m = _module({"w": ("f32", (8, 4))})
    b = FunctionBuilder(m, "f")
    x = b.input("x", "f32", ("T", 4))
    ids = b.input("cu", "i64", ("R+1",))
    r = b.input("base", "i64", ("R",))
    return _finish(m, b, b.op("linear", x, b.param("w")), ids, r)


def test_input_shape_mismatch_names_input_and_sizes():
    m = _small()
    it = Interpreter(m, {"w": torch.randn(8, 4, generator=_gen(18))})
    ok = {"x": torch.randn(3, 4, generator=_gen(19)), "cu": torch.arange(3), "base": torch.arange(2)}
    assert it.run("f", ok)[0].shape == (3, 8)
    with pytest.raises(InterpreterError) as e:
        it.run("f", {**ok, "x": torch.randn(3, 5, generator=_gen(20))})
    assert str(e.value) == "input %x of @f: expected [T,4] = [3, 4], found [3, 5]"
    with pytest.raises(InterpreterError) as e:
        it.run("f", {**ok, "base": torch.arange(3)})  # R = 2 from cu (R+1 = 3), base has 3
    assert str(e.value) == "input %base of @f: expected [R] = [2], found [3]"
    with pytest.raises(InterpreterError, match=r"input %x of @f: expected rank 2 \[T,4\], found \[12\]"):
        it.run("f", {**ok, "x": torch.randn(12, generator=_gen(21))})


def test_input_wrong_dtype_names_input_and_types():
    m = _small()
    it = Interpreter(m, {"w": torch.randn(8, 4, generator=_gen(22))})
    ok = {"x": torch.randn(3, 4, generator=_gen(23)), "cu": torch.arange(3), "base": torch.arange(2)}
    with pytest.raises(InterpreterError) as e:
        it.run("f", {**ok, "x": torch.arange(12).reshape(3, 4)})
    assert str(e.value) == "input %x: expected f32[T,4], found torch.int64"
    with pytest.raises(InterpreterError) as e:
        it.run("f", {**ok, "cu": torch.arange(3).float()})
    assert str(e.value) == "input %cu of @f: declared i64[R+1], found torch torch.float32"


def test_missing_input_and_weights():
    m = _small()
    it = Interpreter(m, {"w": torch.randn(8, 4, generator=_gen(24))})
    with pytest.raises(InterpreterError, match=r"@f: missing inputs \['cu', 'base'\]"):
        it.run("f", {"x": torch.randn(3, 4, generator=_gen(25))})
    with pytest.raises(InterpreterError, match="@f takes 3 inputs, got 1"):
        it.run("f", [torch.randn(3, 4, generator=_gen(26))])
    with pytest.raises(InterpreterError, match=r"1 params have no weight, e.g. \['w'\]"):
        Interpreter(m, {})
    with pytest.raises(InterpreterError, match=r"param @w: declared f32\[8,4\], weight has shape \[4, 8\]"):
        Interpreter(m, {"w": torch.randn(4, 8, generator=_gen(27))}).run(
            "f", {"x": torch.randn(3, 4, generator=_gen(28)), "cu": torch.arange(3), "base": torch.arange(2)})


# ---- in-place pools ----------------------------------------------------------------------------
def _cache_module(pool_dtype: str):
    m = Module("c")
    b = FunctionBuilder(m, "write")
    pool = b.input("pool", pool_dtype, ("N", 6))
    vals = b.input("vals", pool_dtype, ("T", 6))
    req, pos, tbl = b.input("req", "i64", ("T",)), b.input("pos", "i64", ("T",)), b.input("tbl", "i32", ("R", "MB"))
    new = b.op("cache_write", pool, vals, req, pos, tbl, block_size=2)
    return _finish(m, b, new)


def test_cache_write_updates_callers_pool():
    m = _cache_module("f32")
    g = _gen(29)
    pool = torch.randn(12, 6, generator=g)
    before = pool.clone()
    vals = torch.randn(4, 6, generator=g)
    req, pos = torch.tensor([0, 0, 1, 1]), torch.tensor([3, 4, 0, 1])
    tbl = torch.tensor([[5, 0, 3], [1, 2, -1]], dtype=torch.int32)  # blocks of 2 rows, in any order
    (out,) = Interpreter(m, {}, torch.float32).run("write", {"pool": pool, "vals": vals, "req": req, "pos": pos,
                                                            "tbl": tbl})
    assert out.data_ptr() == pool.data_ptr()  # the caller's tensor, updated in place
    expect = before.clone()
    for i, row in enumerate([0 * 2 + 1, 3 * 2 + 0, 1 * 2 + 0, 1 * 2 + 1]):
        expect[row] = vals[i]
    assert torch.equal(pool, expect) and not torch.equal(pool, before)


def test_cache_write_fp8_pool_in_place():
    m = _cache_module("f8e4m3")
    g = _gen(30)
    pool = (torch.randn(10, 6, generator=g) * 10).to(torch.float8_e4m3fn)
    before = pool.float().clone()
    vals = (torch.randn(2, 6, generator=g) * 10).to(torch.float8_e4m3fn)
    for cdt in (torch.float32, torch.float64):  # FP8 is never widened, whatever the compute dtype
        p = pool.clone()
        (out,) = Interpreter(m, {}, cdt).run("write", {"pool": p, "vals": vals, "req": torch.tensor([0, 0]),
                                                       "pos": torch.tensor([0, 2]),
                                                       "tbl": torch.tensor([[2, 4]], dtype=torch.int32)})
        assert out.data_ptr() == p.data_ptr() and p.dtype == torch.float8_e4m3fn
        expect = before.clone()
        expect[4], expect[8] = vals[0].float(), vals[1].float()
        assert torch.equal(p.float(), expect)


def test_pool_in_another_dtype_is_returned_updated():
    """A bf16 pool is widened to the compute dtype (a copy): the update is in the returned tensor."""
    m = _cache_module("bf16")
    g = _gen(31)
    pool = torch.randn(8, 6, generator=g).to(torch.bfloat16)
    vals = torch.randn(1, 6, generator=g).to(torch.bfloat16)
    (out,) = Interpreter(m, {}).run("write", {"pool": pool, "vals": vals, "req": torch.tensor([0]),
                                              "pos": torch.tensor([1]), "tbl": torch.tensor([[2]], dtype=torch.int32)})
    assert torch.equal(out[5], vals[0].float())
    assert torch.equal(out[:5], pool[:5].float()) and torch.equal(out[6:], pool[6:].float())


def test_function_object_and_positional_inputs():
    m = _small()
    f = m.functions["f"]
    assert isinstance(f, Function)
    w = torch.randn(8, 4, generator=_gen(32))
    x_t = torch.randn(2, 4, generator=_gen(33))
    a = Interpreter(m, {"w": w}, torch.float64).run(f, [x_t, torch.arange(2), torch.arange(1)])[0]
    assert_close_rel(a, x_t.double() @ w.double().T, 1e-12)
