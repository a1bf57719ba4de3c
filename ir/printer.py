"""Text form of the IR. `ir.parser.parse_module(print_module(m))` rebuilds m exactly, and printing
that again gives the same text.

```
module @k31-tiny {
  attr config = "{...}"
  param @model.norm.weight : bf16[256] {shard="rep"}
  func @decode(%tokens: i64[R], ...) -> (f32[R,512], ...) attrs {kind="decode"} {
    %x = embedding(@model.embed_tokens.weight, %tokens) : bf16[R,256]
    %w, %ids = moe_router(%logits, @...bias) {topk=4} : f32[R,4], i64[R,4]
    %y = fused_op(%a) : f32[R,4] body (%a0: f32[R,4]) {
      ...
      return %z
    }
    return %logits, ...
  }
}
```
"""

from __future__ import annotations

import json
import math

from .core import Function, Module, Node, Value


def format_attr_value(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(format_attr_value(x) for x in v) + "]"
    raise TypeError(f"attribute value {v!r} of type {type(v).__name__} has no text form")


def format_attrs(attrs: dict) -> str:
    return "{" + ", ".join(f"{k}={format_attr_value(v)}" for k, v in attrs.items()) + "}"


def _sig(values: list[Value]) -> str:
    return ", ".join(f"{v.ref}: {v.type}" for v in values)


def _node_lines(n: Node, indent: str) -> list[str]:
    head = f"{indent}{', '.join(v.ref for v in n.outputs)} = {n.op}({', '.join(v.ref for v in n.inputs)})"
    if n.attrs:
        head += " " + format_attrs(n.attrs)
    head += " : " + ", ".join(str(v.type) for v in n.outputs)
    if n.body is None:
        return [head]
    lines = [head + f" body ({_sig(n.body.inputs)}) {{"]
    lines += _body_lines(n.body, indent + "  ")
    lines.append(indent + "}")
    return lines


def _body_lines(f: Function, indent: str) -> list[str]:
    lines = []
    for n in f.nodes:
        lines += _node_lines(n, indent)
    lines.append(f"{indent}return {', '.join(v.ref for v in f.outputs)}".rstrip())
    return lines


def print_function(f: Function, indent: str = "  ") -> str:
    head = f"{indent}func @{f.name}({_sig(f.inputs)}) -> ({', '.join(str(v.type) for v in f.outputs)})"
    if f.attrs:
        head += " attrs " + format_attrs(f.attrs)
    return "\n".join([head + " {", *_body_lines(f, indent + "  "), indent + "}"])


def print_module(m: Module) -> str:
    lines = [f"module @{m.name} {{"]
    for k, v in m.attrs.items():
        lines.append(f"  attr {k} = {format_attr_value(v)}")
    for p in m.params.values():
        attrs = {"shard": p.shard, **p.attrs}
        lines.append(f"  param @{p.name} : {p.type} {format_attrs(attrs)}")
    for f in m.functions.values():
        lines.append(print_function(f))
    lines.append("}")
    return "\n".join(lines) + "\n"
