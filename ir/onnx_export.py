"""Export one IR function as an ONNX model (for viewers such as Netron, and for `onnx.checker`).

Mapping (generic over any `Module`):
- every IR node becomes a node of the custom domain `ai.k31c` (opset 1) whose op_type is the IR op
  name; node names are the first result's SSA name;
- attributes: int → INT, bool → INT (0/1), float → FLOAT, str → STRING, list of ints / floats /
  strings → INTS / FLOATS / STRINGS, any other list → STRING holding its JSON; a `None` attribute
  (e.g. Kimi-Linear's `lower_bound`) is left out — absent means none;
- a fused node's `body` (the subgraph it replaced) becomes its GRAPH attribute `body`;
- element types map to ONNX types; the packed parameter formats `mxfp4` / `nvfp4` are declared as
  FLOAT4E2M1 tensors of their logical shape, with the block-scale layout in the doc string;
- symbolic dims (`B`, `R+1`, `N`) become `dim_param` strings; integer dims `dim_value`;
- parameters become graph INPUTS carrying type, shape, format and sharding (doc string) but no data,
  so a full-size model's file stays small (k31-pro decode: a few MB); `params_as="initializers"`
  writes them as initializers instead, with `weights` data (small models only);
- every intermediate value gets a `value_info` with its type, so viewers show shapes on edges.
"""

from __future__ import annotations

import json

import onnx
from onnx import TensorProto, helper

from .core import Function, Module, TensorType, Value
from .shapes import dim_str

DOMAIN = "ai.k31c"
DOMAIN_VERSION = 1
DEFAULT_OPSET = 21

_ELEM = {"f64": TensorProto.DOUBLE, "f32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16,
         "f16": TensorProto.FLOAT16, "f8e4m3": TensorProto.FLOAT8E4M3FN, "i64": TensorProto.INT64,
         "i32": TensorProto.INT32, "i8": TensorProto.INT8, "u8": TensorProto.UINT8, "bool": TensorProto.BOOL,
         "mxfp4": TensorProto.FLOAT4E2M1, "nvfp4": TensorProto.FLOAT4E2M1}
_PACKED_DOC = {"mxfp4": "k31c format mxfp4: E2M1 codes, one E8M0 scale per 32 values along the last axis",
               "nvfp4": "k31c format nvfp4: E2M1 codes, one E4M3 scale per 16 values + one fp32 per tensor"}


class OnnxExportError(ValueError):
    pass


def _value_info(name: str, t: TensorType, doc: str = "") -> onnx.ValueInfoProto:
    if t.dtype.name not in _ELEM:
        raise OnnxExportError(f"value {name}: IR dtype {t.dtype.name} has no ONNX element type")
    dims = [int(d) if d.is_number else dim_str(d) for d in t.shape]
    vi = helper.make_tensor_value_info(name, _ELEM[t.dtype.name], dims)
    notes = [x for x in (doc, _PACKED_DOC.get(t.dtype.name, "")) if x]
    if notes:
        vi.doc_string = "; ".join(notes)
    return vi


def _attribute(key: str, v):
    """An onnx AttributeProto, or None for a None value (left out)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return helper.make_attribute(key, int(v))
    if isinstance(v, (int, float, str)):
        return helper.make_attribute(key, v)
    if isinstance(v, (list, tuple)):
        items = list(v)
        for kinds in ((int,), (float, int), (str,)):
            if items and all(isinstance(x, kinds) and not isinstance(x, bool) for x in items):
                vals = [float(x) for x in items] if kinds == (float, int) else items
                return helper.make_attribute(key, vals)
        return helper.make_attribute(key, json.dumps(items))
    raise OnnxExportError(f"attribute {key}={v!r} of type {type(v).__name__} has no ONNX form")


class _Exporter:
    """Walks a function; names inside a fused body get the prefix `<node>::` (ONNX forbids a subgraph
    to redefine an outer name) while parameter references keep their global names."""

    def __init__(self, module: Module):
        self.m = module
        self.used_params: dict[str, Value] = {}

    def name(self, v: Value, scope: str) -> str:
        if v.is_param:
            self.used_params.setdefault(v.name, v)
            return v.name
        return scope + v.name

    def graph(self, f: Function, graph_name: str, scope: str = "") -> onnx.GraphProto:
        nodes, infos = [], []
        for n in f.nodes:
            outs = [self.name(v, scope) for v in n.outputs]
            node = helper.make_node(n.op, [self.name(v, scope) for v in n.inputs], outs,
                                    name=outs[0] if outs else scope + n.op, domain=DOMAIN)
            for k, val in n.attrs.items():
                a = _attribute(k, val)
                if a is not None:
                    node.attribute.append(a)
            if n.body is not None:
                inner = f"{node.name}::"
                node.attribute.append(helper.make_attribute("body", self.graph(n.body, f"{n.op}.body", inner)))
            nodes.append(node)
            infos += [_value_info(name, v.type) for name, v in zip(outs, n.outputs)]
        outputs = [_value_info(self.name(v, scope), v.type) for v in f.outputs]
        out_names = {vi.name for vi in outputs}
        infos = [vi for vi in infos if vi.name not in out_names]
        inputs = [_value_info(self.name(v, scope), v.type) for v in f.inputs]
        return helper.make_graph(nodes, graph_name, inputs, outputs, value_info=infos)


def function_to_onnx(module: Module, function: str, weights: dict | None = None,
                     params_as: str = "inputs") -> onnx.ModelProto:
    """ONNX model of `module.functions[function]`; see the module docstring for the mapping."""
    if params_as not in ("inputs", "initializers"):
        raise OnnxExportError(f"params_as must be 'inputs' or 'initializers', found {params_as!r}")
    if function not in module.functions:
        raise OnnxExportError(f"module @{module.name} has no function @{function}; it has "
                              f"{', '.join(module.functions)}")
    f = module.functions[function]
    ex = _Exporter(module)
    g = ex.graph(f, f"{module.name}.{function}")
    clash = sorted(set(ex.used_params) & ({v.name for v in f.inputs} | {v.name for n in f.walk() for v in n.outputs}))
    if clash:
        raise OnnxExportError(f"names used both as param and value: {clash[:5]}")
    for pname in sorted(ex.used_params):
        p = module.params[pname]
        doc = f"param: format={p.type.dtype.name} shard={p.shard}"
        if params_as == "initializers":
            g.initializer.append(_initializer(pname, p.type, (weights or {}).get(pname)))
        else:
            g.input.append(_value_info(pname, p.type, doc))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET),
                                                helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
                              producer_name="k31c", doc_string=f"k31c IR function @{function} of module @{module.name}")
    meta = {"k31c.module": module.name, "k31c.function": function, "k31c.params_as": params_as,
            **{f"k31c.attr.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in sorted(module.attrs.items())}}
    helper.set_model_props(model, meta)
    return model


def _initializer(name: str, t: TensorType, tensor) -> onnx.TensorProto:
    import torch

    if tensor is None or not isinstance(tensor, torch.Tensor):
        raise OnnxExportError(f"param {name}: initializers need a torch tensor of data (packed formats and "
                              f"missing weights export only as inputs: params_as='inputs')")
    if any(not d.is_number for d in t.shape) or tuple(int(d) for d in t.shape) != tuple(tensor.shape):
        raise OnnxExportError(f"param {name}: data shape {tuple(tensor.shape)} does not match {t}")
    x = tensor.detach().to("cpu").contiguous()
    if x.dtype == torch.bfloat16:
        return helper.make_tensor(name, TensorProto.BFLOAT16, list(x.shape), x.view(torch.int16).numpy().tobytes(),
                                  raw=True)
    return onnx.numpy_helper.from_array(x.numpy(), name)


def export_function(module: Module, function: str, path: str, **kw) -> onnx.ModelProto:
    """Write `function` as ONNX to `path` after `onnx.checker.check_model` accepts it."""
    model = function_to_onnx(module, function, **kw)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return model
