"""The verifier (ir/verifier.py): passes on the built model, catches each kind of broken graph, and
reports every problem of a module in one VerifyError."""

from __future__ import annotations

import pytest

from ir.core import Function, Node, TensorType, Value
from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import VerifyError, verify
from k31c.model.build import build_module
from k31c.model.presets import get_preset

SMALL = '''module @small {
  param @w : f32[8,4] {shard="col"}
  param @g : f32[8] {shard="rep"}
  func @f(%x: f32[T,4], %pool: f32[N,8], %req: i64[T], %pos: i64[T], %tbl: i32[R,MB]) -> (f32[T,8], f32[N,8]) {
    %y = linear(%x, @w) : f32[T,8]
    %n = rms_norm(%y, @g) {eps=1e-06} : f32[T,8]
    %s = sigmoid(%n) : f32[T,8]
    %p = cache_write(%pool, %s, %req, %pos, %tbl) {block_size=16} : f32[N,8]
    return %n, %p
  }
}
'''

FUSED = '''module @fused {
  param @w : f32[16,8] {shard="col"}
  func @f(%x: f32[T,8]) -> (f32[T,16]) {
    %y = linear_sigmoid_mul(%x, @w) : f32[T,16] body (%a: f32[T,8], %b: f32[16,8]) {
      %l = linear(%a, %b) : f32[T,16]
      %s = sigmoid(%l) : f32[T,16]
      %m = mul(%l, %s) : f32[T,16]
      return %m
    }
    return %y
  }
}
'''


def _problems(m) -> list[str]:
    with pytest.raises(VerifyError) as e:
        verify(m)
    probs = e.value.problems
    assert verify(m, raise_on_error=False) == probs
    assert f"({len(probs)} problem(s))" in str(e.value)
    for p in probs:
        assert p in str(e.value)
    return probs


def _one(m, *fragments) -> str:
    probs = _problems(m)
    assert len(probs) == 1, probs
    for frag in fragments:
        assert frag in probs[0], (frag, probs[0])
    return probs[0]


def _fn(m, name="f") -> Function:
    return m.functions[name]


def test_clean_inputs_verify():
    assert verify(parse_module(SMALL)) == []
    assert verify(parse_module(FUSED)) == []


@pytest.mark.parametrize("preset", ["k31-tiny", "k31-tiny-mxfp4"])
def test_built_model_verifies(preset):
    m = build_module(get_preset(preset))
    assert verify(m) == []
    assert verify(parse_module(print_module(m))) == []


def test_operand_used_before_definition():
    m = parse_module(SMALL)
    f = _fn(m)
    f.nodes[0], f.nodes[1] = f.nodes[1], f.nodes[0]  # rms_norm(%y) now runs before %y exists
    _one(m, "@f node 0 (%n = rms_norm)", "operand %y is not defined before use")


def test_value_defined_twice():
    m = parse_module(SMALL)
    _fn(m).nodes[2].outputs[0].name = "y"  # %s renamed to %y, already defined by node 0
    _one(m, "node 2 (%y = sigmoid)", "value %y defined twice")


def test_return_of_undefined_value():
    m = parse_module(SMALL)
    f = _fn(m)
    f.outputs[0] = Value("ghost", TensorType.of("f32", ("T", 8)))
    _one(m, "@f: returns undefined value %ghost")


@pytest.mark.parametrize("declared, shown, n", [
    (("f32", ("T", 9)), "f32[T,9]", 2),
    (("bf16", ("T", 8)), "bf16[T,8]", 1),  # cache_write accepts any float into an f32 pool
    (("i64", ("T", 8)), "i64[T,8]", 2),
    (("f32", ("T", 8, 1)), "f32[T,8,1]", 2)])
def test_wrong_declared_result_type(declared, shown, n):
    m = parse_module(SMALL)
    f = _fn(m)
    f.nodes[2].outputs[0].type = TensorType.of(*declared)  # sigmoid result
    probs = _problems(m)
    assert f"node 2 (%s = sigmoid): result %s declared {shown} but op sigmoid gives f32[T,8]" in probs[0]
    # the consumer (cache_write) then sees the wrong type too and says so
    assert all("node 3 (%p = cache_write)" in p for p in probs[1:]) and len(probs) == n, probs


def test_wrong_declared_type_from_text_is_caught_by_verify_not_parse():
    m = parse_module(SMALL.replace("%y = linear(%x, @w) : f32[T,8]", "%y = linear(%x, @w) : f32[T,7]"))
    probs = _problems(m)
    assert "result %y declared f32[T,7] but op linear gives f32[T,8]" in probs[0]


def test_unknown_op_without_body():
    m = parse_module(SMALL.replace("sigmoid(%n)", "frobnicate(%n)"))
    _one(m, "node 2 (%s = frobnicate)", "unknown op 'frobnicate' and no body")


def test_unknown_op_with_body_is_fine_and_body_is_checked():
    assert verify(parse_module(FUSED)) == []
    m = parse_module(FUSED.replace("%s = sigmoid(%l) : f32[T,16]", "%s = sigmoid(%l) : f32[T,17]"))
    probs = _problems(m)
    assert any("body" in p and "result %s declared f32[T,17]" in p for p in probs), probs


def test_missing_required_attribute():
    m = parse_module(SMALL.replace(" {eps=1e-06}", ""))
    _one(m, "node 1 (%n = rms_norm)", "missing attribute 'eps'")


def test_unknown_attribute():
    m = parse_module(SMALL.replace("{eps=1e-06}", "{eps=1e-06, epsilon=0.1}"))
    _one(m, "unknown attribute 'epsilon'", "rms_norm takes eps")


@pytest.mark.parametrize("value, shown", [('"1e-6"', "'1e-6'"), ("1", "1"), ("true", "True"), ("[1.0]", "[1.0]")])
def test_wrong_attribute_type(value, shown):
    m = parse_module(SMALL.replace("{eps=1e-06}", "{eps=" + value + "}"))
    _one(m, f"attribute eps={shown} must be float")


def test_param_used_with_a_type_other_than_declared():
    m = parse_module(SMALL)
    _fn(m).nodes[0].inputs[1] = Value("w", TensorType.of("bf16", (8, 4)), is_param=True)
    _one(m, "param @w used as bf16[8,4] but declared f32[8,4]")
    m = parse_module(SMALL)
    _fn(m).nodes[0].inputs[1] = Value("w2", TensorType.of("f32", (8, 4)), is_param=True)
    _one(m, "undeclared param @w2")


def test_pool_used_after_in_place_update():
    m = parse_module(SMALL.replace("    return %n, %p", "    %z = add(%pool, %p) : f32[N,8]\n    return %n, %p"))
    _one(m, "node 4 (%z = add)", "operand %pool was already updated in place by node 3 (cache_write)",
         "must not be used again")


def test_pool_returned_after_in_place_update():
    m = parse_module(SMALL.replace("return %n, %p", "return %n, %pool"))
    _one(m, "@f: returns %pool, which was updated in place by node 3 (cache_write)")


def test_built_model_pool_reuse_is_caught():
    """Mutate the built decode function: feed the original latent pool (consumed by its cache_write)
    to mla_attention instead of the written pool."""
    m = build_module(get_preset("k31-tiny"))
    f = m.functions["decode"]
    mla = next(n for n in f.nodes if n.op == "mla_attention")
    written = mla.inputs[2]
    assert written.producer is not None and written.producer.op == "cache_write"
    mla.inputs[2] = written.producer.inputs[0]
    msg = _one(m, "= mla_attention)", f"operand %{written.producer.inputs[0].name} was already updated in place")
    assert "(cache_write)" in msg


def test_body_types_must_match_the_node():
    m = parse_module(FUSED.replace("body (%a: f32[T,8], %b: f32[16,8])", "body (%a: f32[T,8], %b: bf16[16,8])"))
    probs = _problems(m)
    assert any("body takes (f32[T,8], bf16[16,8]) but the node passes (f32[T,8], f32[16,8])" in p for p in probs), probs
    m = parse_module(FUSED)
    node = _fn(m).nodes[0]
    node.outputs[0].type = TensorType.of("f32", ("T", 32))
    m.functions["f"].outputs[0].type = node.outputs[0].type
    probs = _problems(m)
    assert probs == ["@f node 0 (%y = linear_sigmoid_mul): body returns (f32[T,16]) but the node declares (f32[T,32])"]
    m = parse_module(FUSED)
    _fn(m).nodes[0].body.inputs.pop()
    probs = _problems(m)
    assert any("body takes (f32[T,8]) but the node passes (f32[T,8], f32[16,8])" in p for p in probs), probs


def test_result_shape_symbol_not_bound_by_inputs():
    m = parse_module(SMALL)
    f = _fn(m)
    f.nodes[2].outputs[0].type = TensorType.of("f32", ("M", 8))
    probs = _problems(m)
    assert any("result %s uses shape symbols ['M'] not bound by the inputs" in p for p in probs), probs


def test_wrong_operand_count_and_type_rule_failure():
    m = parse_module(SMALL.replace("sigmoid(%n)", "sigmoid(%n, %y)"))
    _one(m, "node 2 (%s = sigmoid)", "type rule failed", "op sigmoid takes operands (x), got 2")
    m = parse_module(SMALL.replace("linear(%x, @w) : f32[T,8]", "linear(%pool, @w) : f32[T,8]"))
    probs = _problems(m)
    assert "type rule failed" in probs[0] and "does not match weight" in probs[0], probs


def test_several_problems_reported_together():
    m = parse_module(SMALL.replace(" {eps=1e-06}", "")  # 1: missing attribute on rms_norm
                     .replace("sigmoid(%n)", "frobnicate(%n)")  # 2: unknown op without body
                     .replace("return %n, %p", "return %n, %pool"))  # 3: pool returned after update
    f = _fn(m)
    f.nodes[0].inputs[1] = Value("w", TensorType.of("bf16", (8, 4)), is_param=True)  # 4: param type
    f.nodes[0].outputs[0].type = TensorType.of("f32", ("T", 8))  # unchanged (still correct)
    with pytest.raises(VerifyError) as e:
        verify(m)
    probs = e.value.problems
    assert len(probs) == 4, probs
    msg = str(e.value)
    assert msg.startswith("IR verification failed (4 problem(s)):")
    assert "param @w used as bf16[8,4] but declared f32[8,4]" in probs[0]
    assert "missing attribute 'eps'" in probs[1]
    assert "unknown op 'frobnicate'" in probs[2]
    assert "returns %pool" in probs[3]
    assert msg.count("\n  - ") == 4


def test_problems_across_functions_and_bodies_are_all_reported():
    text = SMALL[: SMALL.rindex("}")] + FUSED[FUSED.index("  func"): FUSED.rindex("}")].replace("@f(", "@g(") + "}\n"
    text = text.replace('param @w : f32[16,8] {shard="col"}\n', "")
    text = text.replace("module @small {\n", 'module @small {\n  param @w16 : f32[16,8] {shard="col"}\n')
    text = text.replace("linear_sigmoid_mul(%x, @w)", "linear_sigmoid_mul(%x, @w16)")
    m = parse_module(text)
    assert verify(m) == []
    _fn(m, "f").nodes[1].attrs["eps"] = "x"
    _fn(m, "g").nodes[0].body.nodes[1].op = "sigmoidd"
    probs = _problems(m)
    assert len(probs) == 2, probs
    assert probs[0].startswith("@f node 1") and "must be float" in probs[0]
    assert probs[1].startswith("@g node 0 (%y = linear_sigmoid_mul) body node 1") and "unknown op 'sigmoidd'" in probs[1]


def test_node_objects_built_directly():
    """The verifier works on modules assembled without the parser or builder."""
    m = parse_module(SMALL)
    f = _fn(m)
    bad = Node("scale", [f.nodes[2].outputs[0]], {"factor": 2})
    bad.outputs = [Value("sc", TensorType.of("f32", ("T", 8)), bad)]
    f.nodes.insert(3, bad)
    _one(m, "node 3 (%sc = scale)", "attribute factor=2 must be float")
