"""KDA chunked prefill and gate kernels (codegen/triton/kda_prefill.py, _kda_common.py, _kda_chunk_tiles.py,
_kda_wu.py) against the literal references: `ir.ref.kda` (recurrence, chunked form, gate) and fla-core's naive KDA; the tiny model
through both KDA kernels; the H200 heuristics. The fused decode's own tests: tests/test_kda_decode_kernels.py.
CPU: Triton interpreter, fp32, tiny shapes (chunk 64 kept); the bf16 full-shape check runs on a GPU only
(benches/bench_kda.py times it)."""

from __future__ import annotations

import pytest
import torch
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from codegen.triton.kda_decode import TEMPLATES as DECODE_TEMPLATES
from codegen.triton.kda_prefill import TEMPLATES as PREFILL_TEMPLATES
from codegen.triton.kda_prefill import kda_gate, kda_prefill
from ir.core import TensorType
from ir.ops import OPS
from ir.ref import kda as ref
from ir.ref.basic import l2_norm
from tests.helpers import assert_close_rel
from tests.kda_decode_case import cu as _cu

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)



def _inputs(gen, T, H, D, Dv=None, gate_scale=1.0):
    """L2-normalised q, k; v; K3-like log decay in (-5, 0) (mostly mild); beta in (0, 1)."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = l2_norm(r(T, H, D), 1e-6), l2_norm(r(T, H, D), 1e-6)
    g = -5.0 * torch.sigmoid(gate_scale * (r(T, H, D) * 2.0 - 4.0))
    return q, k, r(T, H, Dv or D), g, torch.sigmoid(r(T, H))


def _pool(gen, S, H, D, Dv):
    return torch.randn(S, H, D, Dv, generator=gen) * 0.5


# ------------------------------------------------------------------------------------------ prefill
@pytest.mark.parametrize("H,D,Dv,lengths,config", [
    (2, 32, 32, [1, 5, 64, 70], None),                                   # CPU heuristic: one slice
    (2, 32, 16, [130, 3], {"BK": 16, "BV_INTRA": 16, "BV": 8}),           # several slices / V blocks
    (2, 32, 16, [130, 3], {"BK": 16, "BV": 8, "SPLIT_INTRA": 1, "BK_WU": 16, "BV_WU": 8}),  # A + W/U kernels
    (2, 32, 16, [130, 3], {"BK": 16, "BV_INTRA": 8, "BV": 8, "A64": 1}),  # kernel 1 in 64-row form
])
def test_prefill_ragged_vs_recurrence(H, D, Dv, lengths, config):
    g = _gen(1)
    T, R = sum(lengths), len(lengths)
    q, k, v, gate, beta = _inputs(g, T, H, D, Dv)
    pool = _pool(g, R + 2, H, D, Dv)
    slots = torch.randperm(R + 2, generator=g)[:R]
    mine, want = pool.clone(), pool.clone()
    o = kda_prefill(q, k, v, gate, beta, mine, slots, _cu(lengths), D ** -0.5, config=config)
    o_ref = ref.kda_recurrence(q, k, v, gate, beta, want, slots, _cu(lengths), D ** -0.5)
    assert_close_rel(o, o_ref, 1e-5, "o vs recurrence")
    assert_close_rel(mine[slots], want[slots], 1e-5, "final states vs recurrence")
    others = [s for s in range(R + 2) if s not in slots.tolist()]
    assert torch.equal(mine[others], pool[others]), "pool rows of other slots were modified"
    o_chunk = ref.kda_chunked(q, k, v, gate, beta, pool.clone(), slots, _cu(lengths), D ** -0.5)
    assert_close_rel(o, o_chunk, 1e-5, "o vs ir.ref chunked")


def test_prefill_vs_fla_naive_d64():
    """The tiny model's head size: vs naive_chunk_kda (T multiple of 64) and naive_recurrent_kda."""
    g = _gen(2)
    H, D, T = 1, 64, 128
    q, k, v, gate, beta = _inputs(g, T, H, D)
    pool = _pool(g, 2, H, D, D)
    init = pool[1].clone()
    o = kda_prefill(q, k, v, gate, beta, pool, torch.tensor([1]), _cu([T]), D ** -0.5)
    for fn in (naive_chunk_kda, naive_recurrent_kda):
        o_ref, s_ref = fn(q[None], k[None], v[None], gate[None], beta[None], scale=D ** -0.5,
                          initial_state=init[None].clone(), output_final_state=True)
        assert_close_rel(o, o_ref[0], 1e-5, f"o vs {fn.__name__}")
        assert_close_rel(pool[1], s_ref[0], 1e-5, f"final state vs {fn.__name__}")


def test_prefill_checkpoint_states_equal_recurrence():
    g = _gen(3)
    H, D = 2, 16
    lengths = [3, 100, 70]
    positions = [[1, 3], [1, 17, 64, 65, 100, 64], [70]]
    q, k, v, gate, beta = _inputs(g, sum(lengths), H, D)
    pool = _pool(g, 4, H, D, D)
    slots, cu = torch.tensor([2, 0, 3]), _cu(lengths)
    mine, want = pool.clone(), pool.clone()
    o, ck = kda_prefill(q, k, v, gate, beta, mine, slots, cu, D ** -0.5, checkpoint_positions=positions)
    o_ref, states = ref.kda_recurrence(q, k, v, gate, beta, want, slots, cu, D ** -0.5, keep_states=True)
    assert_close_rel(o, o_ref, 1e-5, "o with checkpoint cuts")
    assert_close_rel(mine, want, 1e-5, "final states with checkpoint cuts")
    for r, pos in enumerate(positions):
        assert ck[r].shape == (len(pos), H, D, D)
        for i, p in enumerate(pos):
            assert_close_rel(ck[r][i], states[cu[r] + p - 1], 1e-5, f"checkpoint req {r} position {p}")
    with pytest.raises(ValueError, match="not in 1..3"):
        kda_prefill(q, k, v, gate, beta, mine, slots, cu, 0.25, checkpoint_positions=[[4], [], []])


@pytest.fixture
def bf16_in_interpreter(monkeypatch):
    """Make the interpreter's bf16 behave as on the GPU: it multiplies bf16 dot operands as raw bit patterns
    (TOOLCHAIN.md), so widen them to fp32 first (exact), and it rounds fp32 -> bf16 toward zero, so round to
    nearest even instead. Then a kernel's bf16 rounding points are what the test sees. No-op on a GPU."""
    if DEV == "cuda":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def widen(x):
        if x.dtype.scalar == tl.bfloat16:
            return TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return x

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            u = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            return TensorHandle(u.astype(np.uint16), tl.bfloat16)
        return real_cast(self, src, dst_type)

    real_dot, real_cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl
    monkeypatch.setattr(InterpreterBuilder, "create_dot",
                        lambda self, a, b, d, *rest: real_dot(self, widen(a), widen(b), d, *rest))
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", cast)


@pytest.mark.parametrize("config", [{}, {"LOWP_A": 1, "LOWP_WU": 1}, {"SPLIT_INTRA": 1, "LOWP_WU": 1, "BK_WU": 16},
                                    {"BK": 64, "LOWP_A": 1, "LOWP_WU": 1},  # the H200 heuristic's form
                                    {"BK": 32, "LOWP_A": 1, "LOWP_WU": 1, "A64": 1}])
def test_prefill_bf16_inputs_and_bf16_products(bf16_in_interpreter, config):
    """bf16 q/k/v/beta (bf16 workspace, bf16 tensor-core products where the config asks) within the bf16
    contract (1e-2) of the fp32 recurrence; also the intra kernel split in two (A + inverse, then W/U) and kernel 1
    in 64-row form (A64)."""
    g = _gen(10)
    H, D, lengths = 1, 64, [130, 9]
    q, k, v, gate, beta = _inputs(g, sum(lengths), H, D)
    pool = _pool(g, 3, H, D, D) * 0.6
    slots, cu = torch.tensor([2, 0]), _cu(lengths)
    mine, want = pool.clone(), pool.clone()
    low = [x.to(torch.bfloat16) for x in (q, k, v)]
    o = kda_prefill(*low, gate, beta.to(torch.bfloat16), mine, slots, cu, D ** -0.5, config={"BK": 16, **config})
    o_ref = ref.kda_recurrence(*(x.float() for x in low), gate, beta.to(torch.bfloat16).float(), want, slots, cu,
                               D ** -0.5)
    assert o.dtype == torch.bfloat16
    assert_close_rel(o.float(), o_ref, 1e-2, f"bf16 o {config}")
    assert_close_rel(mine, want, 1e-2, f"bf16 states {config}")


def _max_subblock_span(gate, lengths):
    """Largest |sum of g| over 16 consecutive tokens of one 64-chunk sub-block (the fast-path check)."""
    spans, start = [], 0
    for n in lengths:
        for c in range(0, n, 64):
            for s in range(c, min(c + 64, n), 16):
                seg = gate[start + s:start + min(s + 16, c + 64, n)]
                spans.append(seg.sum(0).abs().max().item())
        start += n
    return max(spans)


@pytest.mark.parametrize("variant,a_log_scale,config", [
    ("lower_bound", 0.0, None), ("softplus", 0.5, None), ("softplus", 3.0, None),
    ("lower_bound", 0.0, {"A64": 1}), ("softplus", 3.0, {"A64": 1})])
def test_prefill_fused_gate(variant, a_log_scale, config):
    """Raw f/A_log/dt_bias through the fused gate equals kda_gate + recurrence; A_log*3 makes decays
    so strong that sub-blocks take the exact (per-column) diagonal path (also in the 64-row forms)."""
    g = _gen(4)
    H, D, lengths = 2, 16, [1, 5, 64, 70]
    T = sum(lengths)
    q, k, v, _, beta = _inputs(g, T, H, D)
    f, dt_bias = torch.randn(T, H * D, generator=g) * 2, torch.randn(H * D, generator=g)
    A_log = torch.randn(H, generator=g) * a_log_scale
    lb = -5.0 if variant == "lower_bound" else None
    gate = ref.kda_gate(f, A_log, dt_bias, lb)
    if a_log_scale > 1:
        assert _max_subblock_span(gate, lengths) > 60.0, "test must exercise the exact diagonal path"
    pool = _pool(g, 4, H, D, D)
    slots = torch.tensor([3, 1, 0, 2])
    mine, want = pool.clone(), pool.clone()
    o = kda_prefill(q, k, v, None, beta, mine, slots, _cu(lengths), D ** -0.5, f=f, A_log=A_log, dt_bias=dt_bias,
                    lower_bound=lb, config=config)
    o_ref = ref.kda_recurrence(q, k, v, gate, beta, want, slots, _cu(lengths), D ** -0.5)
    assert_close_rel(o, o_ref, 1e-5, f"o, fused {variant} gate")
    assert_close_rel(mine, want, 1e-5, f"states, fused {variant} gate")


def test_kda_gate_kernel_both_variants():
    g = _gen(5)
    T, H, D = 7, 3, 16
    f = torch.randn(T, H * D, generator=g) * 8  # reaches the softplus threshold (20) and tiny tails
    f[0, :4] = torch.tensor([25.0, -30.0, 19.9, -80.0])
    A_log, dt_bias = torch.randn(H, generator=g), torch.randn(H * D, generator=g)
    for lb in (-5.0, None):
        for bias in (dt_bias, None):
            out = kda_gate(f, A_log, bias, lb, block=64)
            x = f.double().view(T, H, D) + (0 if bias is None else bias.double().view(H, D))
            a = A_log.double().exp().view(H, 1)
            want = lb * torch.sigmoid(a * x) if lb is not None else -a * torch.nn.functional.softplus(x)
            assert out.shape == (T, H, D) and out.dtype == torch.float32
            assert_close_rel(out, want, 1e-6, f"gate lb={lb} bias={bias is not None}")
            assert_close_rel(out, ref.kda_gate(f, A_log, bias, lb), 1e-6, "gate vs ir.ref")


def test_prefill_and_gate_templates_drop_in():
    """launch(a, attrs, config) with the op registry's binding returns what the op reference returns."""
    g = _gen(6)
    H, D, lengths = 2, 16, [9, 64]
    q, k, v, gate, beta = _inputs(g, sum(lengths), H, D)
    pool = _pool(g, 3, H, D, D)
    slots, cu = torch.tensor([2, 0]), _cu(lengths)
    t_kda, t_gate = PREFILL_TEMPLATES
    for form in ("recurrent", "chunked"):
        attrs = OPS["kda"].full_attrs({"scale": D ** -0.5, "form": form})
        a = OPS["kda"].bind([q, k, v, gate, beta, pool.clone(), slots, cu])
        b = OPS["kda"].bind([q, k, v, gate, beta, pool.clone(), slots, cu])
        key = t_kda.key_dims(a, attrs)
        assert t_kda.constraints(t_kda.heuristic(key, "cpu"), key, "cpu") == []
        o, st = t_kda.launch(a, attrs, t_kda.heuristic(key, "cpu"))
        o_ref, st_ref = OPS["kda"].reference(b, attrs)
        assert st is a.state
        assert_close_rel(o, o_ref, 1e-5, f"template o ({form})")
        assert_close_rel(st, st_ref, 1e-5, f"template state ({form})")
    qt = TensorType.of("f32", ("B", H, D))
    assert t_kda.supports(OPS["kda"].bind([qt] * 8), {}, "cpu") is None  # symbolic token count is fine
    bad = OPS["kda"].bind([qt, qt, TensorType.of("f32", ("B", H, 3))] + [qt] * 5)
    assert "powers of two" in t_kda.supports(bad, {}, "cpu")
    assert "fused kda_decode" in t_kda.supports(OPS["kda"].bind([qt] * 8), {"keep_states": True}, "cpu")
    f, A_log = torch.randn(5, H * D, generator=g), torch.randn(H, generator=g)
    a = OPS["kda_gate"].bind([f, A_log, None])
    attrs = OPS["kda_gate"].full_attrs({"lower_bound": -5.0})
    out = t_gate.launch(a, attrs, t_gate.heuristic(t_gate.key_dims(a, attrs), "cpu"))
    assert_close_rel(out, OPS["kda_gate"].reference(a, attrs), 1e-6, "kda_gate template")


def test_tiny_model_prefill_decode_verify_through_the_kernels():
    """k31-tiny (D=64) after passes/kda_decode_fusion.py: the compiled executor runs every `kda` of
    prefill through kda_prefill and every fused.kda_decode of decode/verify through kda_decode; logits of
    a ragged prefill (66 + 3 tokens), a decode and a verification step equal the unfused reference."""
    from codegen.registry import templates_for
    from codegen.select import Choice
    from k31c.model.build import BuildOptions, build_module
    from k31c.model.init_weights import random_weights
    from k31c.model.presets import get_preset
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import ReferenceRuntime
    from passes import kda_decode_fusion
    from passes.base import PassContext

    cfg = get_preset("k31-tiny")
    weights = random_weights(cfg, 3)
    opts = BuildOptions(latent_cache_dtype="f32")  # KDA kernels are under test: no FP8 rounding downstream
    fused = build_module(cfg, opts)
    assert kda_decode_fusion.run(fused, PassContext()) > 0
    choices = [Choice(fname, i, n.op, "", templates_for(n.op)[0]) for fname, fn in fused.functions.items()
               for i, n in enumerate(fn.nodes) if n.op in ("kda", "fused.kda_decode")]
    engine = Executor(fused, weights, choices, target="cpu")
    logits = []
    for module, eng in ((fused, engine), (build_module(cfg, opts), None)):
        rt = ReferenceRuntime(module, weights, max_rows=256, max_requests=2, engine=eng)
        rt.add_request("a", 128)
        rt.add_request("b", 128)
        logits.append([rt.prefill({"a": list(range(1, 67)), "b": list(range(5, 8))}), rt.decode({"a": 3, "b": 4}),
                       rt.verify({"a": [5, 6, 7], "b": [8]})])
    n_kda = sum(cfg.layer_kind(i) == "kda" for i in range(cfg.num_hidden_layers))
    assert engine.calls["kda_prefill"] == n_kda and engine.calls["kda_decode"] == 2 * n_kda
    for what, mine, want in zip(("prefill", "decode", "verify"), *logits):
        assert_close_rel(mine, want, 1e-4, f"tiny model logits, {what}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels are checked on a GPU (the interpreter "
                                                          "computes bf16 wrongly); benches/bench_kda.py times them")
def test_bf16_full_shape_gpu():
    g = _gen(9)
    H, D, lengths = 32, 128, [8192, 1000]
    q, k, v, gate, beta = (x.to(DEV) for x in _inputs(g, sum(lengths), H, D))
    pool = _pool(g, 3, H, D, D).to(DEV)
    slots, cu = torch.tensor([2, 0], device=DEV), _cu(lengths).to(DEV)
    mine, want = pool.clone(), pool.clone()
    o = kda_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), gate, beta.bfloat16(), mine, slots, cu, D ** -0.5)
    o_ref = ref.kda_chunked(q, k, v, gate, beta, want, slots, cu, D ** -0.5)
    assert_close_rel(o.float(), o_ref, 1e-2, "bf16 prefill o")
    assert_close_rel(mine, want, 1e-2, "bf16 prefill states")


def test_prefill_state_kernel_smem_matches_the_h200():
    """Kernel 2's shared-memory model equals what Triton 3.6 allocated on the H200 (benches/bench_kda.py,
    session 6), so the constraints reject the one variant that failed there (BV 128 x 3 stages) and keep the rest."""
    from codegen.triton.kda_prefill import constraints, state_kernel_smem
    key = {"H": 32, "D": 128, "Dv": 128, "T": 32768, "R": 4}
    kib = {(32, 3): 188, (64, 3): 208, (64, 2): 144, (128, 2): 176, (128, 3): 248}
    for (bv, stages), want in kib.items():
        cfg = {"BK": 64, "BV_INTRA": 64, "BV": bv, "STAGES": stages}
        assert state_kernel_smem(cfg, key) == want * 1024, (bv, stages)
        assert bool(constraints(cfg, key, "cuda")) == (bv == 128 and stages == 3), (bv, stages)


def test_gpu_heuristics_are_the_measured_configs():
    """The H200 heuristics pick what benches/bench_kda.py measured fastest (session 8), and satisfy the
    templates' constraints: prefill bf16 products, the 64-row kernel 1 with BK 32 under a 168-register cap (session
    10), kernel 2 BV 128 x 4 warps x 2 stages for 4 x 32
    (request, head) pairs (BV 32 for one request and without the batch, as batch-invariant mode asks); decode
    split 4 with EARLY at B=1 (H 12 and 32), one program per (request, head) with the gate GEMM at B=64."""
    (t_pre, _), (t_dec,) = PREFILL_TEMPLATES, DECODE_TEMPLATES
    for R, (bv, warps, stages) in {1: (32, 4, 3), 2: (64, 4, 3), 4: (128, 4, 2), None: (32, 4, 3)}.items():
        key = {"H": 32, "D": 128, "Dv": 128, "T": 8192 * (R or 1)} | ({"R": R} if R else {})
        cfg = t_pre.heuristic(key, "cuda")
        assert (cfg["BK"], cfg["LOWP_A"], cfg["LOWP_WU"], cfg["SPLIT_INTRA"]) == (32, 1, 1, 0)
        assert (cfg["A64"], cfg["BV_INTRA"], cfg["MAXNREG_INTRA"]) == (1, 32, 168)
        assert (cfg["BV"], cfg["WARPS"], cfg["STAGES"]) == (bv, warps, stages), (R, cfg)
        assert t_pre.constraints(cfg, {"R": 1, **key}, "cuda") == []
    want = {(64, 32): (1, 64, 1, 32, 0), (1, 32): (4, 32, 0, 128, 1), (1, 12): (4, 32, 0, 128, 1),
            (2, 32): (2, 64, 0, 128, 1)}
    for (R, H), (split, bv, gate_mm, rb, early) in want.items():
        key = {"H": H, "D": 128, "T": R, "R": R}
        cfg = t_dec.heuristic(key, "cuda")
        assert (cfg["SPLIT"], cfg["BV"], cfg["GATE_MM"], cfg["RB"], cfg["EARLY"]) == (split, bv, gate_mm, rb, early)
        assert t_dec.constraints(cfg, key, "cuda") == []
    assert t_dec.heuristic({"H": 32, "D": 128, "T": 512, "R": 64}, "cuda")["GATE_MM"] == 0  # 8-token verification
    assert "EARLY" in t_dec.constraints({"SPLIT": 2, "BV": 32, "EARLY": 1}, {"D": 128}, "cuda")[0]


_SM90_PREFILL = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as tc
from codegen.aot.record import Recorder
from codegen.triton import kda_prefill as kp
target = GPUTarget("cuda", 90, 32)
T, H, D = 128, 2, 128
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(T, H, D, generator=g).bfloat16() for _ in range(3))
cfg = kp.heuristic({"H": H, "D": D, "Dv": D, "T": T, "R": 1}, "cuda")
for a64 in (0, 1):
    with Recorder(target) as rec:
        kp.kda_prefill(q, k, v, -torch.rand(T, H, D, generator=g), torch.rand(T, H, generator=g).bfloat16(),
                       torch.zeros(1, H, D, D), torch.zeros(1, dtype=torch.int64), torch.tensor([0, T]), 0.088,
                       config=dict(cfg, A64=a64))
    for spec in rec.specs.values():
        fn, sig, cx, at, opts = spec.compile_args
        print(a64, fn.fn.__name__, len(tc(ASTSource(fn, sig, cx, at), target=target, options=dict(vars(opts))).asm["ptx"]) > 0)
'''


def test_prefill_kernels_compile_for_sm90():
    """The GPU heuristic's prefill (kernel 1 in both forms, A64 0 / 1, and kernel 2) compiled to PTX for sm_90 in a
    subprocess through the AOT recorder: the interpreter runs each jit helper untyped, the compiler types them."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _SM90_PREFILL], env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=repo),
                       capture_output=True, text=True, timeout=300, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    built = {tuple(line.split()) for line in p.stdout.splitlines()}
    assert {("0", "_kda_intra_kernel", "True"), ("1", "_kda_intra64_kernel", "True"),
            ("1", "_kda_state_kernel", "True")} <= built, p.stdout
