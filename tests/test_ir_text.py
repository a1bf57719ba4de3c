"""Text form of the IR (ir/printer.py, ir/parser.py): exact round trip on the built presets and on a
hand-written module with a fused node body and attribute values of every kind; parse errors name the
line and column and what was expected."""

from __future__ import annotations

import math
import re

import pytest

from ir.core import Module
from ir.parser import ParseError, parse_module
from ir.printer import format_attr_value, print_module
from ir.verifier import verify
from k31c.model.build import build_module
from k31c.model.presets import get_preset

PRESETS = ["k31-tiny", "k3-tiny", "kimi-linear-tiny", "k31-tiny-mxfp4"]


def _signature(m: Module):
    """Structure independent of object identity: params, and per function its typed interface and
    every node (op, operand refs, attrs, result refs and types), bodies included."""
    def fn_sig(f):
        nodes = []
        for n in f.nodes:
            nodes.append((n.op, [v.ref for v in n.inputs], repr(n.attrs),
                          [(v.ref, str(v.type)) for v in n.outputs], fn_sig(n.body) if n.body else None))
        return ([(v.ref, str(v.type)) for v in f.inputs], nodes, [v.ref for v in f.outputs], repr(f.attrs))
    return (m.name, repr(m.attrs), [(p.name, str(p.type), p.shard, repr(p.attrs)) for p in m.params.values()],
            {k: fn_sig(f) for k, f in m.functions.items()})


@pytest.fixture(scope="module", params=PRESETS)
def built(request):
    return build_module(get_preset(request.param))


def test_built_module_text_round_trip(built):
    text = print_module(built)
    assert print_module(built) == text  # printing is stable
    assert text.startswith(f"module @{built.name} {{\n") and text.endswith("}\n")
    parsed = parse_module(text)
    assert print_module(parsed) == text
    assert _signature(parsed) == _signature(built)
    verify(parsed)
    assert parsed.op_counts() == built.op_counts()
    for fn in built.functions:
        assert parsed.op_counts(fn) == built.op_counts(fn)
    assert set(parsed.functions) == {"prefill", "decode", "verify"}
    # SSA references in the parsed module resolve to the producing node's own Value object
    for f in parsed.functions.values():
        produced = {id(o) for n in f.nodes for o in n.outputs} | {id(v) for v in f.inputs}
        for n in f.nodes:
            for v in n.inputs:
                assert v.is_param or id(v) in produced, v


def test_presets_differ_where_they_should():
    counts = {p: build_module(get_preset(p)).op_counts("decode") for p in PRESETS}
    assert counts["k31-tiny"].get("indexer_topk", 0) == 2
    assert "indexer_topk" not in counts["k3-tiny"]
    assert "attn_res_mix" not in counts["kimi-linear-tiny"]
    mx = parse_module(print_module(build_module(get_preset("k31-tiny-mxfp4"))))
    assert any(p.type.dtype.name == "mxfp4" for p in mx.params.values())


# A hand-written module: a fused node whose body is linear + sigmoid + mul, attribute values of
# every kind on the module, the params, the function and the nodes.
HAND = r'''module @hand-written {
  attr note = "say \"hi\"\n\ttab \\ back \u00e9"
  attr eps = 1e-06
  attr big = 1e+20
  attr lo = -inf
  attr hi = inf
  attr neg = -0.25
  attr n = -3
  attr zero = 0
  attr flag = true
  attr off = false
  attr nothing = none
  attr nested = [1, [2.5, "x"], [], [true, none, -inf, [-7]]]
  param @w : f32[16,8] {shard="col", init="linear", scale=0.5, tags=["a", "b"], frozen=false}
  param @g : bf16[16] {shard="rep"}
  param @experts : mxfp4[4,16,32] {shard="expert", block=32}
  func @f(%x: f32[T,8], %cu: i64[R+1], %half: f32[(T//2),16]) -> (f32[T,16], f32[T/2,16]) attrs {kind="test", max_tokens=4, tag="a,b", ratio=-1.5} {
    %y = linear_sigmoid_mul(%x, @w) : f32[T,16] body (%a: f32[T,8], %b: f32[16,8]) {
      %l = linear(%a, %b) : f32[T,16]
      %s = sigmoid(%l) : f32[T,16]
      %m = mul(%l, %s) : f32[T,16]
      return %m
    }
    %n = rms_norm(%y, @g) {eps=1e-06} : f32[T,16]
    %r = reshape(%n) {shape=[-1, 2, 16]} : f32[T/2,2,16]
    %h = slice(%r) {axis=1, start=0, stop=1} : f32[T/2,1,16]
    %o = reshape(%h) {shape=[-1, 16]} : f32[T/2,16]
    return %n, %o
  }
}
'''


def test_hand_written_module_round_trip_and_values():
    m = parse_module(HAND)
    assert print_module(m) == HAND
    assert print_module(parse_module(print_module(m))) == HAND
    a = m.attrs
    assert a["note"] == 'say "hi"\n\ttab \\ back \u00e9'
    assert a["eps"] == 1e-06 and isinstance(a["eps"], float)
    assert a["big"] == 1e20 and a["neg"] == -0.25
    assert a["lo"] == -math.inf and a["hi"] == math.inf
    assert a["n"] == -3 and isinstance(a["n"], int) and a["zero"] == 0
    assert a["flag"] is True and a["off"] is False and a["nothing"] is None
    assert a["nested"] == [1, [2.5, "x"], [], [True, None, -math.inf, [-7]]]
    w = m.params["w"]
    assert w.shard == "col" and w.attrs == {"init": "linear", "scale": 0.5, "tags": ["a", "b"], "frozen": False}
    assert m.params["experts"].type.dtype.name == "mxfp4" and m.params["experts"].attrs == {"block": 32}
    f = m.functions["f"]
    assert f.attrs == {"kind": "test", "max_tokens": 4, "tag": "a,b", "ratio": -1.5}
    fused = f.nodes[0]
    assert fused.op == "linear_sigmoid_mul" and fused.body is not None
    assert [n.op for n in fused.body.nodes] == ["linear", "sigmoid", "mul"]
    assert [v.name for v in fused.body.inputs] == ["a", "b"]
    assert fused.body.outputs[0] is fused.body.nodes[2].outputs[0]
    assert f.nodes[1].attrs == {"eps": 1e-06}
    assert f.nodes[2].attrs == {"shape": [-1, 2, 16]}
    assert m.op_counts() == {"linear_sigmoid_mul": 1, "linear": 1, "sigmoid": 1, "mul": 1, "rms_norm": 1,
                             "reshape": 2, "slice": 1}
    verify(m)


def test_printer_builds_the_same_text_from_a_programmatic_copy():
    """Attribute values set in Python (tuples, negative floats, strings needing escapes) print in the
    canonical form and parse back to equal values."""
    m = parse_module(HAND)
    m.attrs["tuple"] = (1, -2.5e-07, "q\"uote")
    m.params["w"].attrs["neg"] = -1e-06
    text = print_module(m)
    assert 'attr tuple = [1, -2.5e-07, "q\\"uote"]' in text
    back = parse_module(text)
    assert back.attrs["tuple"] == [1, -2.5e-07, 'q"uote']
    assert back.params["w"].attrs["neg"] == -1e-06
    assert print_module(back) == text
    assert format_attr_value(float("nan")) == "nan" and math.isnan(parse_module(
        HAND.replace("attr zero = 0", "attr zero = nan")).attrs["zero"])
    with pytest.raises(TypeError, match="no text form"):
        format_attr_value({"a": 1})


def test_builder_made_types_round_trip():
    """Types a type rule derives (reshape with -1 gives T/2) print in a form the parser reads back."""
    from ir.builder import FunctionBuilder
    from ir.core import Param, TensorType

    m = Module("derived")
    m.add_param(Param("w", TensorType.of("bf16", (16, 8)), "col"))
    b = FunctionBuilder(m, "f")
    x = b.input("x", "f32", ("T", 8))
    y = b.op("linear", x, b.param("w"))
    r = b.op("reshape", y, shape=[-1, 2, 16])
    h = b.op("slice", r, axis=1, start=1, stop=2)
    c = b.op("concat", h, h, axis=0)
    m.add_function(b.ret(c))
    assert str(c.type) == "f32[T,1,16]" and str(r.type) == "f32[T/2,2,16]"
    text = print_module(m)
    back = parse_module(text)
    assert print_module(back) == text
    verify(back)


def _where(text: str, needle: str, occurrence: int = 1) -> tuple[int, int]:
    pos = -1
    for _ in range(occurrence):
        pos = text.index(needle, pos + 1)
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _parse_error(text: str) -> str:
    with pytest.raises(ParseError) as e:
        parse_module(text)
    return str(e.value)


def test_parse_error_undefined_value():
    bad = HAND.replace("%n = rms_norm(%y, @g)", "%n = rms_norm(%yy, @g)")
    line, col = _where(bad, "%yy")
    msg = _parse_error(bad)
    assert msg == f"line {line}, col {col}: use of undefined value %yy"


def test_parse_error_body_cannot_see_outer_values():
    bad = HAND.replace("%s = sigmoid(%l)", "%s = sigmoid(%x)")
    line, col = _where(bad, "sigmoid(%x)")
    assert _parse_error(bad) == f"line {line}, col {col + len('sigmoid(')}: use of undefined value %x"


def test_parse_error_undeclared_param():
    bad = HAND.replace("rms_norm(%y, @g)", "rms_norm(%y, @gain)")
    line, col = _where(bad, "@gain")
    assert _parse_error(bad) == f"line {line}, col {col}: use of undeclared param @gain"


def test_parse_error_missing_close_paren():
    bad = HAND.replace("rms_norm(%y, @g) {eps", "rms_norm(%y, @g {eps")
    line, col = _where(bad, "{eps")
    msg = _parse_error(bad)
    assert msg.startswith(f"line {line}, col {col}: expected ")
    assert "')'" in msg and "found '{'" in msg, msg


def test_parse_error_declared_results_do_not_match_returned_types():
    bad = HAND.replace("-> (f32[T,16], f32[T/2,16])", "-> (f32[T,16], bf16[T/2,16])")
    msg = _parse_error(bad)
    line, _ = _where(bad, "func @f")
    assert re.match(rf"line {line}, col \d+: function @f", msg), msg
    assert "f32[T,16], bf16[T/2,16]" in msg and "returns (f32[T,16], f32[T/2,16])" in msg, msg
    bad = HAND.replace("-> (f32[T,16], f32[T/2,16])", "-> (f32[T,16])")
    msg = _parse_error(bad)
    assert f"line {line}," in msg and "(f32[T,16])" in msg and "returns (f32[T,16], f32[T/2,16])" in msg
    bad = HAND.replace("-> (f32[T,16], f32[T/2,16])", "-> (f32[T,16], f32[(T//2),16])")  # T/2 is not T//2
    assert "returns (f32[T,16], f32[T/2,16])" in _parse_error(bad)


@pytest.mark.parametrize("old, new, needle, expected", [
    ("%n = rms_norm", "%y = rms_norm", "%y = rms_norm", "value %y defined twice"),
    ("  param @g", "  parm @g", "parm", "expected 'attr', 'param' or 'func', found 'parm'"),
    ("param @w : f32[16,8]", "param @w : f33[16,8]", "f33", "expected type, found 'f33'"),
    ("param @w : f32[16,8]", "param @w : f32[16,8$]", "f32[16,8$]", "bad type f32[16,8$]"),
    ("{eps=1e-06} : f32[T,16]", "{eps=} : f32[T,16]", "} : f32[T,16]\n    %r",
     "expected an attribute value, found '}'"),
    ("{eps=1e-06} : f32[T,16]", "{eps=1e-06 axis=1} : f32[T,16]", "axis=1", "expected ',' or '}', found 'axis'"),
    ("%o = reshape(%h)", "%o = reshape(%h) $", "$", "unexpected character '$'"),
])
def test_parse_errors_name_line_column_and_expectation(old, new, needle, expected):
    bad = HAND.replace(old, new, 1)
    assert bad != HAND
    line, col = _where(bad, needle)
    msg = _parse_error(bad)
    assert msg.startswith(f"line {line}, col {col}: "), msg
    assert expected in msg, msg


def test_parse_error_at_end_of_input():
    msg = _parse_error(HAND[: HAND.index("    return %n, %o")])
    assert "end of input" in msg and re.match(r"line \d+, col \d+: expected", msg), msg
