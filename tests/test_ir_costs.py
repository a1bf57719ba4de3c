"""The op registry's declarations (ir/ops): every op documented with a reference, and costs as sympy
expressions: linear flops = 2*M*N*K, finite byte counts per function, a whole-model flop count."""

from __future__ import annotations

import inspect

import pytest
import sympy

from ir.builder import FunctionBuilder
from ir.core import Function, Module, Node, Param, TensorType, Value
from ir.ops import OPS, get_op
from ir.shapes import sym
from ir.verifier import verify
from k31c.model.build import build_module
from k31c.model.presets import get_preset

SYMBOL_VALUES = {"B": 37, "R": 5, "L": 3000, "N": 4096, "S": 64, "T": 11}


def node_cost(n: Node) -> tuple[sympy.Expr, sympy.Expr]:
    """(flops, bytes) of one node: its op's declared cost, or (an unregistered fused op) its body's."""
    if n.op in OPS:
        return get_op(n.op).cost([v.type for v in n.inputs], [v.type for v in n.outputs], n.attrs)
    assert n.body is not None, f"op {n.op} has neither a declaration nor a body"
    return function_cost(n.body)


def function_cost(f: Function) -> tuple[sympy.Expr, sympy.Expr]:
    fl, by = sympy.Integer(0), sympy.Integer(0)
    for n in f.nodes:  # not walk(): a fused node's cost replaces its body's
        a, b = node_cost(n)
        fl, by = fl + a, by + b
    return sympy.expand(fl), sympy.expand(by)


def module_cost(m: Module, fn: str) -> tuple[sympy.Expr, sympy.Expr]:
    return function_cost(m.function(fn))


def _num(e: sympy.Expr, **extra) -> float:
    env = {**SYMBOL_VALUES, **extra}
    v = e.subs({sym(k): val for k, val in env.items()})
    assert v.is_number, (e, v)
    return float(v)


def _finite_expr(e: sympy.Expr) -> bool:
    return isinstance(e, sympy.Expr) and not e.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) \
        and all(str(s) in SYMBOL_VALUES for s in e.free_symbols)


# ---- declarations ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_is_documented_with_reference_and_rules(name):
    op = OPS[name]
    assert op.name == name
    assert isinstance(op.doc, str) and len(op.doc.strip()) >= 8, f"op {name} has no doc"
    assert callable(op.reference) and callable(op.infer)
    assert op.outputs and all(isinstance(x, str) for x in op.inputs)
    for k, a in op.attrs.items():
        assert a.kinds and all(isinstance(t, type) for t in a.kinds), (name, k)
    for idx, operand in op.inplace.items():
        assert idx < len(op.outputs) and operand in [x.rstrip("?").lstrip("*") for x in op.inputs]
    for cost in (op.flops, op.bytes):
        assert cost is None or len(inspect.signature(cost).parameters) == 3


def test_registry_holds_the_model_ops():
    used = set(build_module(get_preset("k31-tiny")).op_counts()) | \
        set(build_module(get_preset("kimi-linear-tiny")).op_counts())
    assert used <= set(OPS), used - set(OPS)
    assert {"linear", "mla_attention", "indexer_topk", "kda", "moe_experts", "attn_res_mix"} <= used


# ---- linear --------------------------------------------------------------------------------------
@pytest.mark.parametrize("wfmt", ["bf16", "f32", "mxfp4"])
def test_linear_flops_are_2MNK_symbolically(wfmt):
    M, N, K = sympy.symbols("M N K", integer=True, positive=True)
    op = get_op("linear")
    x, w = TensorType.of("bf16", (M, K)), TensorType.of(wfmt, (N, K))
    (y,) = op.infer(op.bind([x, w]), {})
    assert str(y) == "bf16[M,N]"
    fl, by = op.cost([x, w], [y], {})
    assert sympy.simplify(fl - 2 * M * N * K) == 0
    bits = {"bf16": 16, "f32": 32, "mxfp4": 4.25}[wfmt]
    assert sympy.simplify(by - (2 * M * K + N * K * bits / 8 + 2 * M * N)) == 0
    # batched input: the leading dims multiply
    B_, T_ = sympy.symbols("B T", integer=True, positive=True)
    x3 = TensorType.of("f32", (B_, T_, K))
    (y3,) = op.infer(op.bind([x3, w]), {})
    assert sympy.simplify(op.cost([x3, w], [y3], {})[0] - 2 * B_ * T_ * N * K) == 0
    # concrete
    xc, wc = TensorType.of("f32", (3, 64)), TensorType.of(wfmt, (96, 64))
    assert op.cost([xc, wc], op.infer(op.bind([xc, wc]), {}), {})[0] == 2 * 3 * 96 * 64


def test_inplace_result_is_not_counted_as_a_write_of_the_whole_pool():
    op = get_op("cache_write")
    pool, vals = TensorType.of("f32", ("N", 8)), TensorType.of("f32", ("T", 8))
    idx = TensorType.of("i64", ("T",))
    fl, by = op.cost([pool, vals, idx, idx, TensorType.of("i64", ("R",))], [pool], {})
    assert fl == 0 and sym("N") not in by.free_symbols
    assert sympy.simplify(by - (2 * 32 * sym("T") + 3 * 8 * sym("T"))) == 0


def test_fused_node_costs_its_body():
    m = Module("f")
    m.add_param(Param("w", TensorType.of("bf16", (16, 8))))
    body = FunctionBuilder(m, "body")
    a, wt = body.input("a", "f32", ("T", 8)), body.input("wt", "bf16", (16, 8))
    lb = body.op("linear", a, wt)
    body_fn = body.ret(body.op("mul", lb, body.op("sigmoid", lb)))
    b = FunctionBuilder(m, "f")
    x = b.input("x", "f32", ("T", 8))
    node = Node("fused_linear_silu", [x, b.param("w")], {}, body=body_fn)
    node.outputs = [Value("y", TensorType.of("f32", ("T", 16)), node)]
    b.fn.nodes.append(node)
    m.add_function(b.ret(node.outputs[0]))
    verify(m)
    fl, _ = module_cost(m, "f")
    T = sym("T")
    assert sympy.simplify(fl - (2 * T * 16 * 8 + 4 * T * 16 + T * 16)) == 0


# ---- whole functions -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k31():
    return build_module(get_preset("k31-tiny"))


@pytest.mark.parametrize("fn", ["prefill", "decode", "verify"])
def test_function_bytes_are_finite_sympy_expressions(k31, fn):
    fl, by = module_cost(k31, fn)
    for e in (fl, by):
        assert _finite_expr(e), e
        assert _num(e) > 0
    f = k31.function(fn)
    for n in f.nodes:
        nf, nb = node_cost(n)
        assert _finite_expr(nf) and _finite_expr(nb), (n.op, nf, nb)
        assert _num(nb) >= 0 and _num(nf) >= 0, (n.op, nf, nb)
    # the traffic of a step does not grow with the pools' capacity (N latent rows, S state slots)
    assert not ({"N", "S"} & {str(s) for s in by.free_symbols}), by
    # ... but it does with the tokens of the step and the context
    tok = "R" if fn == "decode" else "B"
    assert _num(by, **{tok: 64}) > _num(by, **{tok: 1})
    assert _num(by, L=10_000) > _num(by, L=100)


def test_k31_tiny_decode_flops(k31):
    cfg = get_preset("k31-tiny")
    fl, _ = module_cost(k31, "decode")
    assert {str(s) for s in fl.free_symbols} == {"R", "L"}
    total = _num(fl)
    assert total > 0
    R, L = sym("R"), sym("L")
    # linear nodes contribute exactly 2 * R * (in*out) for every weight they read
    f = k31.function("decode")
    lin = sum((node_cost(n)[0] for n in f.nodes if n.op == "linear"), sympy.Integer(0))
    w_elems = sum(int(n.inputs[1].type.numel()) for n in f.nodes if n.op == "linear")
    assert sympy.simplify(lin - 2 * R * w_elems) == 0
    assert w_elems > cfg.vocab_size * cfg.hidden_size  # lm_head alone is 512*256
    # with the indexer, only the indexer scores grow with the context L: 2*H_I*(D_I+1) per token per MLA layer
    n_mla = sum(cfg.layer_kind(i) == "mla" for i in range(cfg.num_hidden_layers))
    per_l = sympy.expand(fl).coeff(L)
    assert sympy.simplify(per_l - n_mla * 2 * R * cfg.index_n_heads * (cfg.index_head_dim + 1)) == 0
    # decode flops are linear in R
    assert sympy.simplify(fl.subs(R, 2 * R) - 2 * fl) == 0
    # experts: only the active ones are counted
    moe = sum((node_cost(n)[0] for n in f.nodes if n.op == "moe_experts"), sympy.Integer(0))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    ell = cfg.routed_expert_hidden_size
    assert sympy.simplify(moe - n_moe * 6 * R * cfg.num_experts_per_token * cfg.moe_intermediate_size * ell) == 0
    # expert bytes: a decode step of R tokens reads at most R*K of the E experts' weights, never more than all
    node = next(n for n in f.nodes if n.op == "moe_experts")
    w_bytes = sum(float(v.type.nbytes()) for v in node.inputs[3:])
    by = node_cost(node)[1]
    E, K = cfg.num_experts, cfg.num_experts_per_token
    fixed = float(by.subs(R, 1)) - w_bytes * K / E
    assert 0 < fixed < w_bytes * K / E  # per-token activations, routing and output: small beside the experts
    assert abs(float(by.subs(R, 2)) - 2 * fixed - w_bytes * min(1, 2 * K / E)) < 1e-6
    assert abs(float(by.subs(R, 64)) - 64 * fixed - w_bytes) < 1e-6  # 64*K > E: every expert once


def test_dense_mla_flops_grow_with_context():
    """K3 (no indexer): MLA attends the whole context, 2*H*(kv+rope + kv) per token per context position."""
    cfg = get_preset("k3-tiny")
    fl, _ = module_cost(build_module(cfg), "decode")
    n_mla = sum(cfg.layer_kind(i) == "mla" for i in range(cfg.num_hidden_layers))
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    per_l = sympy.expand(fl).coeff(sym("L"))
    assert sympy.simplify(per_l - n_mla * 2 * sym("R") * cfg.num_attention_heads * (width + cfg.kv_lora_rank)) == 0


def test_mxfp4_experts_cost_fewer_bytes_same_flops():
    a, b = build_module(get_preset("k31-tiny")), build_module(get_preset("k31-tiny-mxfp4"))
    fa, ba = module_cost(a, "decode")
    fb, bb = module_cost(b, "decode")
    assert sympy.simplify(fa - fb) == 0
    assert _num(bb) < _num(ba)
