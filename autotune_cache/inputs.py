"""Operands for tuning one (kernel template, shape bucket) of a compiled module, and the reference
answer every candidate config is checked against.

Where the operands come from: metadata (token positions, request bases, cu_seqlens, slots), routing
ids, index selections, gates in (-inf, 0) and L2-normalised keys all carry invariants that random
tensors of the right type would break (and a kernel may legitimately misbehave on such inputs). So the
operands of every kernel node are *captured*: the module's entry functions run in the reference
interpreter on random tokens of the compiler's representative step shapes (`REPRESENTATIVE`,
prefill B=256 R=4, decode R=8, verify B=32 R=8, pools N=4096 rows and S=8 slots, the same shapes
`k31c compile` keys `kernels/configs.json` with), and each kernel node's operands are cloned just
before the node runs. Every node of the same template whose operands fall in the same bucket is one
`Problem`; its operand sets (one per node, e.g. one per layer, then clones until `n_sets`) are
rotated while timing so that no measurement reuses one buffer back to back.

The reference of a set is the node's own semantics: the op's `reference` (or, for a fused node, its
IR body) run by the interpreter on a copy of the set, computed once per captured node. The model runs
in fp32; with `compute_dtype=torch.bfloat16` (the GPU executor's) the kernel operands are cast as the
executor would hold them and the reference sees those rounded values in fp32 (a higher-precision
oracle on exactly the kernel's inputs). Pools that a kernel updates in place are cloned for every
candidate (`Problem.fresh`), so candidates never see one another's writes. Packed (MXFP4) weights
reach the kernel packed and the reference dequantised, as in `k31c.runtime.executor`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import sympy
import torch

from ir.core import Module, Node
from ir.dtypes import WIDENED_FLOATS
from ir.interpreter import Interpreter
from ir.ops import OPS
from ir.packed import PackedMXFP4

from .policy import bucket_id
from .records import canonical_json

from k31c.compiler import POOL_SIZES, REPRESENTATIVE  # the shapes `k31c compile` keys configs.json with


@dataclass
class OperandSet:
    kernel_args: list  # what the template's launch receives (packed weights packed)
    ref_args: list  # what the reference receives (packed weights dequantised)
    expected: list  # the reference results (shared by clones of the same captured node)
    site: str  # "function:index" of the node it was captured from
    node: Node | None = None  # that node: nodes of one bucket may differ in attrs (e.g. prefix_add)
    attrs: dict | None = None  # its launch attrs


@dataclass
class Problem:
    """One (template, bucket): the node (first site), its launch attrs, the operand sets to rotate."""
    template: object
    node: Node
    attrs: dict
    key: dict
    bucket: dict
    env: dict  # symbol values at capture (B, R, N, S, ...)
    sets: list = field(default_factory=list)

    @property
    def bid(self) -> str:
        return bucket_id(self.template.family, self.bucket)

    @property
    def sites(self) -> list[str]:
        return sorted({s.site for s in self.sets})

    def bind(self, args: list, node: Node | None = None):
        node = node or self.node
        op = OPS.get(node.op)
        return op.bind(args) if op is not None and node.body is None else SimpleNamespace(operands=args)

    def fresh(self, i: int) -> list:
        """Kernel operands of set i with every non-parameter tensor cloned (pools a kernel updates in
        place, and anything a faulty kernel might scribble on): one candidate never sees another's writes."""
        node = self.sets[i].node or self.node
        return [a.clone() if isinstance(a, torch.Tensor) and not v.is_param else a
                for v, a in zip(node.inputs, self.sets[i].kernel_args)]

    def launch(self, i: int, args: list, config: dict) -> list:
        """Launch on operands `args` of set i (its own node's binding and attrs)."""
        s = self.sets[i]
        out = self.template.launch(self.bind(args, s.node), dict(s.attrs or self.attrs), dict(config))
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def cost(self) -> tuple[float | None, float | None]:
        """(flops, bytes) of the node at the captured shapes (`node_cost`); a symbol the shapes do not bind
        (an op's context length L) takes the kernel key's dim of that name when it has one."""
        keyed = {k: v for k, v in self.key.items() if isinstance(v, int) and not isinstance(v, bool)}
        return node_cost(self.node, {**keyed, **self.env})


def node_cost(node: Node, env: dict) -> tuple[float | None, float | None]:
    """(flops, bytes) of a node at symbol values `env` from the ops' sympy cost rules. A fused node: the
    sum over its body's ops, less the intermediates that stay on chip (each written once and read by
    every body consumer), so pools count as their body ops count them (rows touched, not whole pools)."""
    subs = {sympy.Symbol(k, integer=True, positive=True): v for k, v in env.items()}

    def num(x):
        try:
            v = sympy.sympify(x).subs(subs)
            return float(v) if v.is_number else None
        except (TypeError, ValueError):
            return None

    def total(n):
        op = OPS.get(n.op)
        if op is not None and n.body is None:
            fl, by = op.cost([v.type for v in n.inputs], [v.type for v in n.outputs], n.attrs)
            return num(fl), num(by)
        if n.body is None:
            return None, None
        fl, by = 0.0, 0.0
        outs = {v.name for v in n.body.outputs}
        for m in n.body.nodes:
            f, b = total(m)
            fl = None if f is None or fl is None else fl + f
            by = None if b is None or by is None else by + b
            for v in m.outputs:
                if v.name not in outs and by is not None:
                    readers = sum(1 for k in n.body.nodes for u in k.inputs if u.name == v.name)
                    size = num(v.type.nbytes())
                    by = None if size is None else by - size * (1 + readers)
        return fl, (max(by, 0.0) if by is not None else None)

    return total(node)


def kernel_dtype(declared: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the executor at `compute_dtype` holds a value declared `declared` (a widened float) in."""
    if declared in ("f32", "f64") and compute_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return compute_dtype


class _Capture(Interpreter):
    """The reference interpreter (fp32), cloning the operands of the wanted nodes just before they run.

    Kernel operands are cast to what the executor at `kernel_compute` gives them (bf16 for values the IR
    declares bf16, fp32 for f32 ones); the reference operands are those same (rounded) values in fp32,
    so the reference is computed in higher precision on exactly the kernel's inputs. (The reference
    interpreter does not run every op in bf16 on CUDA: the KDA chunked form's triangular solve.)"""

    def __init__(self, module, weights, device, wanted: dict, kernel_compute: torch.dtype):
        super().__init__(module, weights, torch.float32, device)
        self.wanted = wanted  # id(node) -> (function, index)
        self.kernel_compute = kernel_compute
        self.captured: list = []  # (function, index, node, kernel_args, ref_args, env)
        self.active = True

    def _execute(self, n: Node, args: list, env: dict):
        site = self.wanted.get(id(n)) if self.active else None
        if site is not None:
            kern, ref = [], []
            for v, a in zip(n.inputs, args):
                w = self.weights.get(v.name) if v.is_param else None
                if isinstance(w, PackedMXFP4):  # packed to the kernel, dequantised (fp32) to the reference
                    kern.append(w.to(self.device))
                    ref.append(a)
                    continue
                k = a if v.is_param else a.clone()
                if v.type.dtype.name in WIDENED_FLOATS and k.is_floating_point():
                    k = k.to(kernel_dtype(v.type.dtype.name, self.kernel_compute))
                kern.append(k)
                ref.append(k.float() if k.is_floating_point() and k.dtype != torch.float64 and
                           v.type.dtype.name in WIDENED_FLOATS else k)
            self.captured.append((site[0], site[1], n, kern, ref, dict(env)))
        return super()._execute(n, args, env)

    def reference(self, n: Node, args: list, env: dict) -> list:
        self.active = False
        try:
            return [t.clone() for t in Interpreter._execute(self, n, [a.clone() if isinstance(a, torch.Tensor)
                                                                          else a for a in args], dict(env))]
        finally:
            self.active = True


def _run_steps(module: Module, engine: _Capture, functions: set, shapes: dict, seed: int):
    """Prefill, decode and verify steps of the given shapes ({fn: {"B": tokens, "R": requests}}) on
    random tokens; only the wanted functions' steps are captured (and decode/verify run only when
    wanted). Requests not prefilled by the captured prefill get a short uncaptured one first; a
    decode/verify shape's "context" (e.g. {"decode": {"R": 1, "context": 8192}}) sets that prefill's length,
    so context-keyed kernels (indexer, sparse MLA) are tuned at serving contexts."""
    from k31c.runtime.reference import ReferenceRuntime

    rng = random.Random(seed)
    pre = shapes.get("prefill", {"B": 4, "R": 1})
    per = max(1, pre["B"] // pre["R"])
    steps = [(f, shapes[f]) for f in ("decode", "verify") if f in functions]
    if "prefill" not in functions:
        # context for the decode/verify captures only: an uncaptured prefill, short unless a context is asked
        per = max([s.get("context", 0) for _, s in steps] + [min(per, 16)])
    n_req = max([pre["R"]] + [s["R"] for _, s in steps])
    if n_req > POOL_SIZES["S"]:
        raise ValueError(f"capture shapes need {n_req} requests; the pools hold {POOL_SIZES['S']}")
    cap = per + sum(max(1, s.get("B", s["R"]) // s["R"]) for _, s in steps) + 8
    rt = ReferenceRuntime(module, engine.weights, max_rows=max(POOL_SIZES["N"], n_req * cap),
                          max_requests=POOL_SIZES["S"], engine=engine)
    vocab = rt.vocab_size
    toks = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    for r in range(n_req):
        rt.add_request(f"r{r}", cap)
    engine.active = "prefill" in functions
    rt.prefill({f"r{r}": toks(per) for r in range(pre["R"])})
    engine.active = False
    if n_req > pre["R"]:
        rt.prefill({f"r{r}": toks(per) for r in range(pre["R"], n_req)})
    for fname, s in steps:
        engine.active = True
        rt.step(fname, {f"r{r}": toks(max(1, s.get("B", s["R"]) // s["R"])) for r in range(s["R"])})
        engine.active = False


def capture_problems(module: Module, weights, choices, *, device="cpu", compute_dtype=torch.float32,
                     batch_invariant: bool = False, families=None, bucket: dict | None = None,
                     n_sets: int = 4, seed: int = 0, shapes: dict | None = None) -> list[Problem]:
    """Problems for every kernel node selected in `choices` (optionally only `families`, and only the
    bucket equal to `bucket`), with at least `n_sets` operand sets each. `shapes` overrides the step
    shapes ({"prefill": {"B": 256, "R": 4}, ...}; default `REPRESENTATIVE`)."""
    if weights is None:
        raise ValueError("tuning needs the model's weights to capture real operands: this artifact was compiled "
                         "without weights (a preset over the size limit); tune a tiny/bench-sized artifact or "
                         "compile from a checkpoint")
    wanted = {}
    templates = {}
    for c in choices:
        if c.template is None or (families and c.template.family not in families):
            continue
        node = module.function(c.function).nodes[c.index]
        wanted[id(node)] = (c.function, c.index)
        templates[id(node)] = c.template
    if not wanted:
        return []
    torch.manual_seed(seed)
    engine = _Capture(module, weights, device, wanted, compute_dtype)
    _run_steps(module, engine, {f for f, _ in wanted.values()}, {**REPRESENTATIVE, **(shapes or {})}, seed)
    problems: dict[str, Problem] = {}
    for fname, index, node, kern, ref, env in engine.captured:
        t = templates[id(node)]
        op = OPS.get(node.op)
        attrs = {**(op.full_attrs(node.attrs) if op is not None else dict(node.attrs)),
                 "batch_invariant": batch_invariant}
        prob = Problem(t, node, attrs, {}, {}, env)
        prob.key = dict(t.key_dims(prob.bind(kern), attrs))
        prob.bucket = dict(t.bucket(prob.key))
        if bucket is not None and canonical_json(prob.bucket) != canonical_json(dict(bucket)):
            continue
        expected = engine.reference(node, ref, env)
        site = OperandSet(kern, ref, expected, f"{fname}:{index}", node, attrs)
        problems.setdefault(prob.bid, prob).sets.append(site)
    out = []
    for prob in problems.values():
        base = list(prob.sets)
        i = 0
        while len(prob.sets) < n_sets:  # clones: distinct buffers, so rotation defeats caches
            s = base[i % len(base)]
            clone = lambda xs: [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]  # noqa: E731
            prob.sets.append(OperandSet(clone(s.kernel_args), clone(s.ref_args), s.expected, s.site, s.node, s.attrs))
            i += 1
        out.append(prob)
    return sorted(out, key=lambda p: p.bid)


def problem_from_sets(template, op_name: str, sets: list[list], attrs: dict, params: tuple = ()) -> Problem:
    """A Problem over hand-made operand sets of a registered op (benches, tests): the node's types are
    read from the first set, `params` are the operand indices that are weights, and the expected
    results are the op's reference on a copy of each set."""
    from ir.core import TensorType, Value

    op = OPS[op_name]
    names = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
             torch.int64: "i64", torch.int32: "i32"}
    ins = [Value(f"in{i}", TensorType.of(names[t.dtype], list(t.shape)), is_param=i in params)
           for i, t in enumerate(sets[0])]
    full = op.full_attrs(attrs)
    outs = op.infer(op.bind([v.type for v in ins]), full)
    node = Node(op_name, ins, dict(attrs), [Value(f"out{i}", t) for i, t in enumerate(outs)])
    prob = Problem(template, node, {**full, "batch_invariant": False}, {}, {}, {})
    prob.key = dict(template.key_dims(prob.bind(sets[0]), prob.attrs))
    prob.bucket = dict(template.bucket(prob.key))
    for i, args in enumerate(sets):
        out = op.reference(op.bind([a.clone() for a in args]), full)
        expected = [t.clone() for t in (out if isinstance(out, (tuple, list)) else [out])]
        prob.sets.append(OperandSet(list(args), list(args), expected, f"set{i}"))
    return prob


# ---- checking a candidate's results -----------------------------------------------------------------
def result_error(actual: list, expected: list) -> dict:
    """The worst error over the results: {"float": max ||a - e|| / ||e|| (float64), "int": max fraction of
    differing elements}; inf for a non-finite value, a missing result or a shape mismatch."""
    inf = {"float": float("inf"), "int": float("inf")}
    if len(actual) != len(expected):
        return inf
    worst = {"float": 0.0, "int": 0.0}
    for a, e in zip(actual, expected):
        if not isinstance(a, torch.Tensor) or tuple(a.shape) != tuple(e.shape):
            return inf
        if e.is_floating_point():
            a64, e64 = a.detach().to("cpu", torch.float64), e.detach().to("cpu", torch.float64)
            if not (torch.isfinite(a64).all() and torch.isfinite(e64).all()):
                return inf  # NaN never passes (a non-finite reference cannot check anything either)
            ne = torch.linalg.vector_norm(e64).item()
            err = torch.linalg.vector_norm(a64 - e64).item() / ne if ne > 0 else torch.linalg.vector_norm(a64).item()
            worst["float"] = max(worst["float"], err)
        elif e.numel():
            worst["int"] = max(worst["int"], (a.detach().cpu() != e.detach().cpu()).double().mean().item())
    return worst
