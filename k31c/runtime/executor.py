"""The compiled executor: runs a compiled module node by node, each node through the kernel that
`codegen.select` chose for it, or through the op's reference when none was (the fallbacks `compile`
listed). It is the reference interpreter with kernel dispatch: shapes are checked the same way.

Configs are chosen per kernel and shape bucket: a record from the artifact's `kernels/configs.json`
when it has one for that bucket, else the template's declared heuristic (counted as a miss and shown
by `stats()`). Packed weights (MXFP4) reach kernels packed; the reference fallback sees them
dequantised.

CUDA graphs (`cuda_graphs=True`, honoured only on a cuda device; `k31c.runtime.cuda_graphs` captures
and replays): while `static_context` is set (a graph's warm-up and capture), nothing may read device
data on the host. Kernels then get `attrs["max_context"] = static_context` (the graph's context bound:
table width x block size) instead of deriving the context from `token_pos.max()` (their tuning keys
too, `_paging.context_bound`), and op references that read device data on the host get the sync-free
versions listed in `cuda_graphs.GRAPH_SAFE_REFERENCE`.

On cuda the executor puts its device's L2 fetch granularity at 128 bytes (`l2_fetch.py`: the MoE kernels' heuristics
are measured under it).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch

from autotune_cache.policy import bucket_id as tuning_bucket_id
from codegen.kernel import KernelTemplate
from codegen.select import Choice
from ir.core import Module, Node
from ir.interpreter import Interpreter, InterpreterError
from ir.ops import OPS
from ir.packed import PackedMXFP4

from . import l2_fetch

PLAIN = "_plain"  # a config's launch option, not a template tunable: 1 = launch this kernel without programmatic
# dependent launch (codegen/triton/_pdl.py); the template gets the config without it. `k31c tune --in-graph`
# tries it per bucket (autotune_cache/graph_tune.py): whether a launch should overlap its predecessor is a
# property of the step it runs in.


def bucket_id(template: KernelTemplate, key: dict) -> str:
    """The tuning-record bucket of a launch: the template's bucketing of its key dims."""
    return tuning_bucket_id(template.family, template.bucket(key))


def _tensors(args):
    """The CUDA tensors among a node's arguments (variadic operands are lists)."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors(a)
        elif isinstance(a, torch.Tensor) and a.is_cuda:
            yield a


def _launch_plain(t: KernelTemplate, a, attrs: dict, config: dict):
    """Launch with the config's `_plain` option applied (PLAIN) and removed from what the template gets."""
    cfg = {k: v for k, v in config.items() if k != PLAIN}
    if not config[PLAIN]:
        return t.launch(a, attrs, cfg)
    from codegen.triton import _pdl

    before = _pdl.set_enabled(False)
    try:
        return t.launch(a, attrs, cfg)
    finally:
        _pdl.set_enabled(before)


class Executor(Interpreter):
    def __init__(self, module: Module, weights, choices: list[Choice], *, target: str = "cpu",
                 configs: dict | None = None, batch_invariant: bool = False, tuning=None,
                 compute_dtype: torch.dtype = torch.float32, device: str = "cpu", cuda_graphs: bool = False):
        """`tuning`: an `autotune_cache.MissPolicy` consulted when the artifact has no config for a bucket
        (records, declared heuristic with misses counted, or tune); without it the heuristic is used.
        `cuda_graphs`: ask the runtime to replay decode steps as CUDA graphs (ignored off cuda)."""
        super().__init__(module, weights, compute_dtype, device)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        l2_fetch.set_for_runtime(self.device)   # 128-byte L2 fetches on cuda (l2_fetch.py)
        self.static_context: int | None = None  # set only while a CUDA graph is warmed up / captured
        self.tuning = tuning
        self.target, self.batch_invariant = target, batch_invariant
        self.configs = dict(configs or {})  # bucket_id -> config
        self._kernel: dict[int, KernelTemplate] = {}
        for c in choices:
            if c.template is not None:
                self._kernel[id(module.function(c.function).nodes[c.index])] = c.template
        self.calls: Counter = Counter()  # family -> launches
        self.misses: Counter = Counter()  # bucket_id -> launches that used the heuristic
        self.launch_log: list | None = None  # when a list: (template, key, bucket id, config, op) of each launch
        self._packed: dict[str, PackedMXFP4] = {}
        self._checked: dict = {}  # (value, shape, dtype, env) -> symbols the check bound (see _check)
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._side = self._side_stream
        self._pending: dict[int, torch.cuda.Event] = {}  # id(Value) produced on the side stream -> its event
        self.overlapped = 0  # nodes run on the side stream

    def set_overlap(self, on: bool) -> bool:
        """Run `overlap`-annotated nodes on the side stream (on: the default on CUDA) or in order on the main
        stream (off: benches compare both); returns the previous setting. CUDA graphs captured afterwards
        follow it (drop the captured ones to re-capture)."""
        before = self._side is not None
        self._side = self._side_stream if on else None
        return before

    def run(self, fn, inputs):
        f = self.module.function(fn) if isinstance(fn, str) else fn
        self._token_dim = f.inputs[0].type.shape[0]  # the step's token axis symbol (B, or R for decode)
        outs = super().run(f, inputs)
        if self._pending:  # results returned to the caller (pools) are complete on the main stream
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._pending.clear()
        return outs

    def _check(self, v, t: torch.Tensor, env: dict, what: str):
        """The interpreter's shape/dtype check, memoised: for the same value, shape, dtype and symbol bindings
        it passes again and binds the same symbols, so only a new combination pays for the symbolic check
        (sympy, about half of an eager step's host time otherwise). Failures are never memoised."""
        if not self.check_shapes:
            return
        key = (id(v), tuple(t.shape), t.dtype, frozenset(env.items()))
        bound = self._checked.get(key)
        if bound is None:
            before = set(env)
            super()._check(v, t, env, what)
            if len(self._checked) > 200_000:  # many distinct step shapes: start over rather than grow
                self._checked.clear()
            bound = self._checked[key] = {k: env[k] for k in env if k not in before}
        env.update(bound)

    def _execute(self, n: Node, args: list, env: dict) -> list[torch.Tensor]:
        """Nodes annotated `overlap=...` (the MLA query path beside the indexer, the MoE router and shared
        expert beside the routed experts) run on a second CUDA stream, in program order; the main stream
        waits for them only where a main-stream node first reads their results (a side node reading another
        side node's result is ordered by the side stream itself)."""
        main = torch.cuda.current_stream(self.device) if self._side is not None else None
        on_side = main is not None and "overlap" in n.attrs
        for v in n.inputs:
            ev = None if on_side else self._pending.pop(id(v), None)
            if ev is not None:
                main.wait_event(ev)
        if not on_side:
            return self._dispatch(n, args, env)
        self._side.wait_stream(main)  # its operands were produced on the main stream
        for t in _tensors(args):
            # the main stream may drop an operand right after this launch (its last reader): the allocator
            # must not hand its memory to a main-stream kernel before the side stream has read it
            t.record_stream(self._side)
        with torch.cuda.stream(self._side):
            outs = self._dispatch(n, args, env)
            ev = torch.cuda.Event()
            ev.record(self._side)
        for o, t in zip(n.outputs, outs):
            t.record_stream(main)  # allocated on the side stream, used on the main one
            self._pending[id(o)] = ev
        self.overlapped += 1
        return outs

    def _dispatch(self, n: Node, args: list, env: dict) -> list[torch.Tensor]:
        t = self._kernel.get(id(n))
        graph = None
        if self.static_context is not None:
            from . import cuda_graphs as graph
        if t is None:
            if graph is not None and n.op in graph.GRAPH_SAFE_REFERENCE and n.body is None:
                op = OPS[n.op]
                return [graph.GRAPH_SAFE_REFERENCE[n.op](op.bind(args), op.full_attrs(n.attrs))]
            if self.batch_invariant and n.body is None:
                return self._batch_invariant_reference(n, args, env)
            return super()._execute(n, args, env)
        op = OPS.get(n.op)
        a = op.bind(args) if op is not None and n.body is None else SimpleNamespace(operands=args)
        attrs = op.full_attrs(n.attrs) if op is not None else dict(n.attrs)
        attrs["batch_invariant"] = self.batch_invariant
        if graph is not None:
            attrs["max_context"] = self.static_context  # kernels and their keys read this, not token_pos
        key = t.key_dims(a, attrs)
        bid = bucket_id(t, key)
        config = self.configs.get(bid)
        if config is None:
            if self.tuning is not None:
                config = self.tuning.config(t, key)  # record | heuristic (counted) | tuner | TuningMiss
            else:
                config = t.heuristic(key, self.target)
                self.misses[bid] += 1
        self.calls[t.family] += 1
        if self.launch_log is not None:  # `k31c tune --in-graph` lists a step's sites this way
            self.launch_log.append((t, key, bid, config, n.op))
        try:
            if PLAIN in config:
                out = _launch_plain(t, a, attrs, config)
            else:
                out = t.launch(a, attrs, config)
        except Exception as e:
            raise InterpreterError(f"kernel {t.kernel_name(config, key)} for {n.op} "
                                   f"({', '.join(o.ref for o in n.outputs)}) failed: {e}") from e
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(n.outputs):
            raise InterpreterError(f"kernel {t.family} returned {len(outs)} results for {n.op}, expected {len(n.outputs)}")
        return outs

    def _batch_invariant_reference(self, n: Node, args: list, env: dict) -> list[torch.Tensor]:
        """Run a reference op so that no reduction order depends on the batch: ops over whole requests
        (those taking cu_seqlens) one request at a time, every other op one token at a time. Library
        GEMMs and reductions pick their blocking by problem size, so a batched call is not invariant."""
        decl = [x.rstrip("?").lstrip("*") for x in OPS[n.op].inputs]  # operand names as the op declares them
        names = decl[:len(n.inputs)] + [decl[-1]] * (len(n.inputs) - len(decl))
        token_ix = [i for i, v in enumerate(n.inputs) if not v.is_param and v.type.rank
                    and v.type.shape[0] == self._token_dim and names[i] not in ("block_table", "state_slot")]
        if not token_ix:
            return super()._execute(n, args, env)
        pieces = []
        if "cu_seqlens" in names:
            cu, slot = args[names.index("cu_seqlens")], args[names.index("state_slot")]
            for r in range(cu.numel() - 1):
                lo, hi = int(cu[r]), int(cu[r + 1])
                part = list(args)
                for i in token_ix:
                    part[i] = args[i][lo:hi]
                part[names.index("cu_seqlens")] = torch.tensor([0, hi - lo], dtype=cu.dtype, device=cu.device)
                part[names.index("state_slot")] = slot[r:r + 1]
                pieces.append(super()._execute(n, part, env))
        else:
            tok_req = args[names.index("token_req")] if "token_req" in names else None
            for row in range(args[token_ix[0]].shape[0]):
                part = list(args)
                for i in token_ix:
                    part[i] = args[i][row:row + 1]
                if tok_req is not None:
                    part[names.index("token_req")] = torch.zeros_like(tok_req[:1])
                    if "block_table" in names:
                        tbl = args[names.index("block_table")]
                        part[names.index("block_table")] = tbl[int(tok_req[row]):int(tok_req[row]) + 1]
                pieces.append(super()._execute(n, part, env))
        token_out = [o.type.rank and o.type.shape[0] == self._token_dim for o in n.outputs]
        return [torch.cat([p[j] for p in pieces]) if is_tok else pieces[-1][j] for j, is_tok in enumerate(token_out)]

    def node_param(self, n: Node, name: str):
        """A kernel node takes MXFP4 weights packed (never widened: a widened copy of every expert would
        be cached for nothing, 2-4x the packed bytes); reference fallbacks take them widened."""
        if id(n) in self._kernel and isinstance(self.weights.get(name), PackedMXFP4):
            return self._packed_param(name)
        return self.param(name)

    def _packed_param(self, name: str) -> PackedMXFP4:
        if name not in self._packed:
            self._packed[name] = self.weights[name].to(self.device)
        return self._packed[name]

    def stats(self) -> dict:
        out = {"kernel_launches": dict(self.calls), "config_misses": dict(self.misses),
               "overlapped_nodes": self.overlapped}
        if self.tuning is not None:
            out["tuning"] = self.tuning.stats()
        return out
