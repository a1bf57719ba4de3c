"""Symbolic dims (ir/shapes.py): the safe dim parser and printer round trip, junk is rejected with a
clear error, and `bind` infers symbols (incl. `R+1`) from concrete sizes and reports mismatches."""

from __future__ import annotations

import random

import pytest
import sympy

from ir import shapes as S
from ir.core import TensorType

B, R, H = S.sym("B"), S.sym("R"), S.sym("H")


@pytest.mark.parametrize("text, expected, printed", [
    ("B", B, "B"),
    ("R+1", R + 1, "R+1"),
    ("4*B", 4 * B, "4*B"),
    ("B*H", B * H, "B*H"),
    ("(R+1)*2", 2 * R + 2, "2*R+2"),
    (" R + 1 ", R + 1, "R+1"),
    ("R-1", R - 1, "R-1"),
    ("7", sympy.Integer(7), "7"),
    ("B*(R+1)", B * (R + 1), "B*(R+1)"),
    ("B//2", sympy.floor(B / 2), "(B//2)"),
    ("(B+1)//2+1", sympy.floor((B + 1) / 2) + 1, "((B+1)//2)+1"),
    ("2*(B//H)", 2 * sympy.floor(B / H), "2*(B//H)"),
    ("T/2", S.sym("T") / 2, "T/2"),
    ("H*H*B", H ** 2 * B, "B*H**2"),  # sympy folds products into powers; they parse back  # exact division, as reshape's type rule produces it
    ("3*(R+1)/2", sympy.Rational(3, 2) * (R + 1), "3*R/2+3/2"),
])
def test_dim_parse_print_round_trip(text, expected, printed):
    d = S.parse_dim(text)
    assert sympy.simplify(d - expected) == 0, (text, d)
    assert S.dim_str(d) == printed
    again = S.parse_dim(S.dim_str(d))
    assert again == d and S.dim_str(again) == printed, (text, again)


def test_dim_symbols_are_positive_integers_and_shared():
    d = S.parse_dim("R+1")
    (r,) = d.free_symbols
    assert r is S.sym("R") and r.is_integer and r.is_positive
    # same symbol object everywhere, so expressions from different places cancel
    assert S.dims_equal(S.parse_dim("(R+1)*2"), S.parse_dim("2*R+2"))
    assert not S.dims_equal(S.parse_dim("R+1"), S.parse_dim("R"))


def test_shape_str_round_trip_through_types():
    t = TensorType.of("f32", ("R+1", "4*B", 16, "B//2"))
    assert str(t) == "f32[R+1,4*B,16,(B//2)]"
    back = TensorType.of("f32", [S.parse_dim(x) for x in str(t)[4:-1].split(",")])
    assert back.same_as(t)
    assert S.symbols_of(t.shape) == {"R", "B"}


def test_random_dim_expressions_round_trip():
    rng = random.Random(1234)
    names = ["B", "R", "N", "S", "H"]

    def gen(depth):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(names) if rng.random() < 0.6 else str(rng.randint(1, 9))
        op = rng.choice(["+", "-", "*", "//", "/"])
        rhs = str(rng.randint(2, 5)) if op in ("//", "/") else gen(depth - 1)
        return f"({gen(depth - 1)}){op}({rhs})"

    for _ in range(150):
        text = gen(3)
        d = S.parse_dim(text)
        printed = S.dim_str(d)
        assert " " not in printed
        back = S.parse_dim(printed)
        assert sympy.simplify(back - d) == 0, (text, printed, back)
        assert S.dim_str(back) == printed


@pytest.mark.parametrize("junk", ["", "B+", "3B", "B**H", "B***2", "B**-1", "B/0", "B//(2-2)", "(B", "B)", "x y", "B$", "1.5", "B,", "()",
                                  "B+*2", "import os"])
def test_parse_dim_rejects_junk_with_clear_error(junk):
    with pytest.raises(ValueError) as e:
        S.parse_dim(junk)
    msg = str(e.value)
    assert "bad dimension expression" in msg and repr(junk.strip()) in msg, msg


def test_as_dim_rejects_non_dims():
    assert S.as_dim(5) == 5 and S.as_dim("B") == B
    with pytest.raises(TypeError, match="bool"):
        S.as_dim(True)
    with pytest.raises(TypeError, match="dimension"):
        S.as_dim(2.5)
    with pytest.raises(ValueError, match="invalid symbol name"):
        S.sym("1x")


def test_bind_infers_symbols_including_offsets():
    rng = random.Random(7)
    for _ in range(10):
        r, b, n = rng.randint(1, 40), rng.randint(1, 40), rng.randint(1, 100)
        env: dict[str, int] = {}
        # R+1 seen before R: the single linear unknown is solved for
        S.bind(S.shape(["R+1", "B", "N", 8]), (r + 1, b, n, 8), env, "cu")
        assert env == {"R": r, "B": b, "N": n}
        S.bind(S.shape(["R", "4*B"]), (r, 4 * b), env, "again")  # consistent: no error, env unchanged
        assert env == {"R": r, "B": b, "N": n}
    env = {}
    S.bind(S.shape(["4*B"]), (12,), env, "x")
    assert env == {"B": 3}
    env = {"H": 4}
    S.bind(S.shape(["B*H"]), (20,), env, "x")  # H known: B solved
    assert env == {"H": 4, "B": 5}


def test_bind_reports_mismatch_naming_expected_and_found():
    env = {}
    with pytest.raises(ValueError) as e:
        S.bind(S.shape(["R", "R+1"]), (4, 6), env, "input %cu_seqlens")
    msg = str(e.value)
    assert msg.startswith("input %cu_seqlens:")
    assert "[R,R+1]" in msg and "[4, 5]" in msg and "found [4, 6]" in msg, msg

    with pytest.raises(ValueError) as e:
        S.bind(S.shape(["B", 64]), (3, 32), {}, "input %x")
    msg = str(e.value)
    assert "input %x" in msg and "[B,64]" in msg and "[3, 64]" in msg and "found [3, 32]" in msg, msg

    with pytest.raises(ValueError, match=r"input %x: expected rank 2 \[B,64\], found \[3\]"):
        S.bind(S.shape(["B", 64]), (3,), {}, "input %x")
    with pytest.raises(ValueError, match=r"cannot infer 4\*B from size 10"):
        S.bind(S.shape(["4*B"]), (10,), {}, "input %x")
    with pytest.raises(ValueError, match=r"cannot infer B\*H from size 12"):
        S.bind(S.shape(["B*H"]), (12,), {}, "input %x")
    # an already bound symbol is checked, not rebound
    env = {"B": 3}
    with pytest.raises(ValueError, match=r"found \[4\]"):
        S.bind(S.shape(["B"]), (4,), env, "input %y")
    assert env == {"B": 3}


def test_evaluate_and_numel():
    d = S.parse_dim("(R+1)*2")
    assert S.evaluate(d, {"R": 5}) == 12
    with pytest.raises(ValueError, match="not determined"):
        S.evaluate(d, {"B": 1})
    assert S.evaluate(S.numel(S.shape(["B", "R+1", 3])), {"B": 2, "R": 4}) == 30
