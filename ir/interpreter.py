"""The reference interpreter: executes any function of a module with the ops' torch references.

Every float storage type (bf16, f16, f32, f64) is computed in the compute dtype (fp32 or fp64), except
that with a 16-bit compute dtype (bf16 on a GPU) values the IR declares f32 (KDA states, router logits,
the expert sum, scales) stay fp32, as they are at run time;
FP8 values stay FP8 (their quantisation is part of the semantics); packed weights (MXFP4) are
dequantised once when first used. Shapes of inputs and results are checked against the declared
symbolic types as it goes. Pools updated in place by an op are the caller's tensors: the caller
sees the update (and the function also returns them). A node with a body runs its body.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from . import shapes as S
from .core import Function, Module, Node, Value
from .dtypes import WIDENED_FLOATS
from .ops import OPS
from .packed import PackedMXFP4


class InterpreterError(RuntimeError):
    pass


class Interpreter:
    def __init__(self, module: Module, weights: Mapping[str, torch.Tensor | PackedMXFP4],
                 compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 check_shapes: bool = True):
        self.module, self.weights = module, weights
        self.compute_dtype, self.device = compute_dtype, torch.device(device)
        self.check_shapes = check_shapes
        self._params: dict[str, torch.Tensor] = {}
        missing = [n for n in module.params if n not in weights]
        if missing:
            raise InterpreterError(f"{len(missing)} params have no weight, e.g. {missing[:5]}")

    # ---- values -------------------------------------------------------------------------------
    def param(self, name: str) -> torch.Tensor:
        t = self._params.get(name)
        if t is None:
            w = self.weights[name]
            p = self.module.params[name]
            if isinstance(w, PackedMXFP4):
                t = w.to(self.device).dequantize(self.compute_dtype)
            else:
                t = self.prepare(w, p.type.dtype.name)
            if tuple(t.shape) != tuple(int(d) for d in p.type.shape):
                raise InterpreterError(f"param @{name}: declared {p.type}, weight has shape {list(t.shape)}")
            self._params[name] = t
        return t

    def node_param(self, n, name: str):
        """The weight `name` as node `n` takes it: the reference takes every weight widened (`param`);
        an engine whose kernels read packed weights overrides this."""
        return self.param(name)

    def float_dtype(self, dtype_name: str) -> torch.dtype:
        """The torch dtype a value declared `dtype_name` is held in (a widened float or mxfp4)."""
        if dtype_name in ("f32", "f64") and self.compute_dtype in (torch.bfloat16, torch.float16):
            return torch.float32
        return self.compute_dtype

    def prepare(self, t: torch.Tensor, dtype_name: str) -> torch.Tensor:
        t = t.to(self.device)
        if dtype_name in WIDENED_FLOATS or dtype_name == "mxfp4":
            return t.to(self.float_dtype(dtype_name))
        return t

    # ---- execution ----------------------------------------------------------------------------
    def run(self, fn: str | Function, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        f = self.module.function(fn) if isinstance(fn, str) else fn
        if not isinstance(inputs, Mapping):
            if len(inputs) != len(f.inputs):
                raise InterpreterError(f"@{f.name} takes {len(f.inputs)} inputs, got {len(inputs)}")
            inputs = {v.name: t for v, t in zip(f.inputs, inputs)}
        missing = [v.name for v in f.inputs if v.name not in inputs]
        if missing:
            raise InterpreterError(f"@{f.name}: missing inputs {missing}")
        env: dict[str, int] = {}
        vals: dict[str, torch.Tensor] = {}
        for v in f.inputs:
            t = inputs[v.name]
            if v.type.dtype.name in WIDENED_FLOATS:
                if not t.is_floating_point():
                    raise InterpreterError(f"input %{v.name}: expected {v.type}, found {t.dtype}")
                want = self.float_dtype(v.type.dtype.name)
                if t.dtype != want or t.device != self.device:
                    t = t.to(self.device, want)  # a copy: in-place pools must be given in this dtype
            self._check(v, t, env, f"input %{v.name} of @{f.name}")
            vals[v.name] = t
        return self._run_body(f, vals, env)

    def _run_body(self, f: Function, vals: dict, env: dict) -> list[torch.Tensor]:
        last_use = {}
        for i, n in enumerate(f.nodes):
            for v in n.inputs:
                last_use[v.name] = i
        keep = {v.name for v in f.outputs}
        for i, n in enumerate(f.nodes):
            args = [self.node_param(n, v.name) if v.is_param else vals[v.name] for v in n.inputs]
            outs = self._execute(n, args, env)
            for v, t in zip(n.outputs, outs):
                if v.type.dtype.name in WIDENED_FLOATS and t.is_floating_point():
                    want = self.float_dtype(v.type.dtype.name)
                    t = t if t.dtype == want else t.to(want)  # e.g. cast(bf16 -> f32) under a bf16 compute dtype
                self._check(v, t, env, f"result {v.ref} of {n.op} in @{f.name}")
                vals[v.name] = t
            for v in n.inputs:
                if not v.is_param and last_use.get(v.name) == i and v.name not in keep:
                    vals.pop(v.name, None)
        return [vals[v.name] for v in f.outputs]

    def _execute(self, n: Node, args: list, env: dict) -> list[torch.Tensor]:
        if n.body is not None:
            inner = {v.name: t for v, t in zip(n.body.inputs, args)}
            return self._run_body(n.body, inner, dict(env))
        op = OPS.get(n.op)
        if op is None:
            raise InterpreterError(f"op {n.op!r} is not registered and has no body")
        try:
            out = op.reference(op.bind(args), op.full_attrs(n.attrs))
        except Exception as e:  # name the node: a bare traceback from deep in a reference is hard to place
            raise InterpreterError(f"{n.op} producing {', '.join(o.ref for o in n.outputs)} failed: {e}") from e
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(n.outputs):
            raise InterpreterError(f"{n.op} returned {len(outs)} results, expected {len(n.outputs)}")
        return outs

    def _check(self, v: Value, t: torch.Tensor, env: dict, what: str):
        if not self.check_shapes:
            return
        try:
            S.bind(v.type.shape, tuple(t.shape), env, what)
        except ValueError as e:
            raise InterpreterError(str(e)) from None
        dt = v.type.dtype
        if dt.name in WIDENED_FLOATS or dt.kind == "packed":  # computed in the compute dtype
            ok = t.is_floating_point()
        else:  # fp8, integers and bool are held exactly as declared
            ok = t.dtype == dt.torch_dtype
        if not ok:
            raise InterpreterError(f"{what}: declared {v.type}, found torch {t.dtype}")
