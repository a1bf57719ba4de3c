"""Symbolic shapes: tuples of sympy expressions over named, positive integer symbols.

Dims print as plain text (`B`, `R + 1`, `4*B`) and parse back with a small safe parser (no eval):
integers, symbol names, `+ - *`, `/` (exact division, e.g. `T/2` from a reshape's type rule),
`//` (floor division, printed `(a//b)`), `**` with an integer exponent (sympy's `B**2`), parentheses.
"""

from __future__ import annotations

import re
from functools import lru_cache

import sympy
from sympy.printing.str import StrPrinter

Dim = sympy.Expr
Shape = tuple  # tuple[Dim, ...]


@lru_cache(maxsize=None)
def sym(name: str) -> sympy.Symbol:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"invalid symbol name {name!r}")
    return sympy.Symbol(name, integer=True, positive=True)


def as_dim(d) -> Dim:
    if isinstance(d, sympy.Expr):
        return d
    if isinstance(d, bool):
        raise TypeError("a dimension cannot be a bool")
    if isinstance(d, int):
        return sympy.Integer(d)
    if isinstance(d, str):
        return parse_dim(d)
    raise TypeError(f"cannot use {d!r} as a dimension")


def shape(dims) -> Shape:
    return tuple(as_dim(d) for d in dims)


class _DimPrinter(StrPrinter):
    """sympy's str form, except floor(a/b) prints as `(a//b)` so that parse_dim reads it back."""

    def _print_floor(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        wrap = lambda x: self._print(x) if x.is_Atom else f"({self._print(x)})"  # noqa: E731
        return f"({wrap(num)}//{wrap(den)})"


@lru_cache(maxsize=65536)
def dim_str(d: Dim) -> str:
    """The dim's text (sympy expressions are immutable and hashable: printed once each; the printer dominated
    dumping a full-size module's IR)."""
    return _DimPrinter().doprint(d).replace(" ", "")


def shape_str(s: Shape) -> str:
    return "[" + ",".join(dim_str(d) for d in s) + "]"


@lru_cache(maxsize=65536)
def dims_equal(a: Dim, b: Dim) -> bool:
    """Whether two dims are the same expression (structurally equal ones without simplifying: shape inference
    compares every node's result with its recorded type, and simplify dominated the sharding passes)."""
    return a == b or sympy.simplify(a - b) == 0


def shapes_equal(a: Shape, b: Shape) -> bool:
    return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def numel(s: Shape) -> Dim:
    out = sympy.Integer(1)
    for d in s:
        out = out * d
    return out


def symbols_of(s: Shape) -> set[str]:
    return {str(x) for d in s for x in d.free_symbols}


def evaluate(d: Dim, env: dict[str, int]) -> int:
    if d.is_Integer:
        return int(d)
    free = sorted(str(x) for x in d.free_symbols)
    if any(k not in env for k in free):
        raise ValueError(f"dimension {dim_str(d)} is not determined by {env}")
    return _evaluate(d, tuple((k, int(env[k])) for k in free))


@lru_cache(maxsize=65536)
def _evaluate(d: Dim, bound: tuple) -> int:
    """d at the values of its own symbols (`bound`, sorted by name): one sympy substitution per distinct pair (they
    dominated planning a full-size module's kernel configs)."""
    val = d.subs({sym(k): v for k, v in bound})
    if not val.is_Integer:
        raise ValueError(f"dimension {dim_str(d)} is not an integer at {dict(bound)}")
    return int(val)


def bind(declared: Shape, actual: tuple[int, ...], env: dict[str, int], what: str) -> None:
    """Unify a declared symbolic shape with concrete sizes, extending env; raise on mismatch."""
    if len(declared) != len(actual):
        raise ValueError(f"{what}: expected rank {len(declared)} {shape_str(declared)}, found {list(actual)}")
    for d, n in zip(declared, actual):
        free = d.free_symbols - {sym(k) for k in env}
        if d.is_Symbol and free:
            env[str(d)] = int(n)
            continue
        if free:  # e.g. R+1 with R unknown: solve the single linear unknown
            (s,) = tuple(free) if len(free) == 1 else (None,)
            known = d.subs({sym(k): v for k, v in env.items()})  # e.g. B*H with H bound: solve B
            sol = sympy.solve(sympy.Eq(known, n), s) if s is not None else []
            if len(sol) != 1 or not sol[0].is_Integer:
                raise ValueError(f"{what}: cannot infer {dim_str(d)} from size {n}")
            env[str(s)] = int(sol[0])
            continue
        if evaluate(d, env) != n:
            raise ValueError(f"{what}: expected {shape_str(declared)} = "
                             f"{[evaluate(x, env) if not (x.free_symbols - {sym(k) for k in env}) else dim_str(x) for x in declared]}, "
                             f"found {list(actual)}")


# ---- safe parser for dimension expressions ---------------------------------------------------
_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(//|\*\*|[-+*/()]))")


def parse_dim(text: str) -> Dim:
    tokens = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"bad dimension expression {text!r} at {pos}")
        tokens.append(m.group(1) or m.group(2) or m.group(3))
        pos = m.end()
    p = _DimParser(tokens, text)
    out = p.expr()
    if p.i != len(tokens):
        raise ValueError(f"bad dimension expression {text!r}")
    return out


class _DimParser:
    def __init__(self, tokens, text):
        self.t, self.i, self.text = tokens, 0, text

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self):
        tok = self.peek()
        if tok is None:
            raise ValueError(f"bad dimension expression {self.text!r}: unexpected end")
        self.i += 1
        return tok

    def expr(self):
        v = self.term()
        while self.peek() in ("+", "-"):
            v = v + self.term() if self.take() == "+" else v - self.term()
        return v

    def term(self):
        v = self.unary()
        while self.peek() in ("*", "//", "/"):
            op = self.take()
            if op == "*":
                v = v * self.unary()
                continue
            d = self.unary()
            if d == 0:
                raise ValueError(f"bad dimension expression {self.text!r}: division by zero")
            # `/` is exact division, as a type rule may produce it (reshape [T,16] -> [-1,2,16] gives T/2)
            v = v / d if op == "/" else sympy.floor(v / d)
        return v

    def unary(self):
        if self.peek() == "-":
            self.take()
            return -self.unary()
        v = self.atom()
        if self.peek() == "**":  # sympy prints B*B as B**2: a non-negative integer exponent only
            self.take()
            e = self.take()
            if not e.isdigit():
                raise ValueError(f"bad dimension expression {self.text!r}: '**' needs an integer exponent")
            v = v ** int(e)
        return v

    def atom(self):
        tok = self.take()
        if tok == "(":
            v = self.expr()
            if self.take() != ")":
                raise ValueError(f"bad dimension expression {self.text!r}: missing ')'")
            return v
        if tok.isdigit():
            return sympy.Integer(int(tok))
        if tok[0].isalpha() or tok[0] == "_":
            return sym(tok)
        raise ValueError(f"bad dimension expression {self.text!r}: unexpected {tok!r}")
