"""Plan options: the flags `k31c compile` and `k31c explain` share, resolved and checked together.

`add_plan_args(parser)` declares them; `resolve_plan_options(args)` turns the parsed namespace into a
`PlanOptions` or raises one `PlanConfigError` listing EVERY problem (DESIGN §9): unknown model or
target, TP not dividing the KDA / MLA heads or a sharded weight dimension, EP not dividing the experts
or TP, DCP not dividing TP, TP larger than the target's scale-up domain, a cache format the target
cannot run, a context longer than the model's, and a plan that does not fit in memory.

Layout relations enforced (one instance = `tp` ranks; DCP and EP groups are made of those ranks):
- TP | KDA heads and TP | MLA heads (heads, gates and output projections are split by head); the DSA
  indexer is replicated under plain TP (issue 8), so index_n_heads need not divide.
- DCP | TP: a DCP group is a subgroup of the TP group (vLLM's rule). Merge-free DCP prefill (T5) gathers
  the context over the DCP group and then runs token-sharded prefill over the TP group.
- EP | TP and EP | num_experts: experts are split over EP ranks of the instance and replicated TP/EP
  times; `--ep` defaults to `--tp` (EP = 1 replicates all experts on every rank).

Formats (decision): a cache format (`--latent-cache`, `--key-cache`) the target has no native support
for is an error unless `--emulate-formats` is given, in which case the plan marks it "emulated"
(dequantised in the kernel: memory saving kept, no native-rate math). Weight formats come from the
checkpoint and are never an error: MXFP4 experts on a target without MXFP4 are weight-only
quantisation dequantised to bf16 in the expert GEMM, and the plan says so. The CPU target emulates
every format exactly (reference and Triton interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from ..model.config import ConfigError, ModelConfig
from ..model.params import param_specs
from ..model.presets import PRESETS, get_preset
from ..targets import Target, TargetError, get_target
from .memory import fit_problems

LATENT_FORMATS = ("fp8", "nvfp4", "bf16")
KEY_FORMATS = ("fp8", "mxfp4")
STATE_FORMATS = ("f32", "bf16")
DEFAULTS = dict(target=None, target_file=None, tp=1, dcp=1, dcp_interleave=1, ep=None, latent_cache="fp8",
                key_cache="fp8", kda_state="f32", max_context=None, max_batched_tokens=8192, max_requests=64,
                block_size=64, emulate_formats=False)


class PlanConfigError(ValueError):
    """Configuration problems found while resolving plan flags; the message lists all of them."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{len(problems)} configuration problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class PlanOptions:
    cfg: ModelConfig
    model_spec: str
    model_source: str
    target: Target
    tp: int = 1
    dcp: int = 1
    ep: int = 1
    dcp_interleave: int = 1  # DCP: rank r stores the runs of this many positions numbered r mod dcp
    latent_cache: str = "fp8"
    key_cache: str = "fp8"
    kda_state: str = "f32"
    max_context: int = 4096
    max_batched_tokens: int = 8192
    max_requests: int = 64
    block_size: int = 64
    emulate_formats: bool = False
    defaulted: tuple = field(default=(), compare=False)  # flags the user did not give

    @property
    def world(self) -> int:
        return self.tp

    def emulated_formats(self) -> list[str]:
        """Cache formats this target runs by emulation (only reachable with --emulate-formats or on cpu)."""
        used = [("latent cache", self.latent_cache)]
        if self.cfg.has_indexer:
            used.append(("index-key cache", self.key_cache))
        return [f"{what} {fmt}" for what, fmt in used
                if fmt not in ("bf16", "f32") and not self.target.is_native(fmt)]

    def flags(self) -> dict:
        """The resolved flags, as `k31c explain` prints them first."""
        return {"model": self.model_spec, "target": self.target.name, "tp": self.tp, "dcp": self.dcp, "ep": self.ep,
                "dcp_interleave": self.dcp_interleave,
                "latent_cache": self.latent_cache, "key_cache": self.key_cache, "kda_state": self.kda_state,
                "max_context": self.max_context, "max_batched_tokens": self.max_batched_tokens,
                "max_requests": self.max_requests, "block_size": self.block_size,
                "emulate_formats": self.emulate_formats, "defaulted": sorted(self.defaulted)}


def add_plan_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags shared by `k31c compile` and `k31c explain` (validated by resolve_plan_options)."""
    p.add_argument("--model", required=True, help="preset name, config.json, or checkpoint directory (only its "
                                                 "config.json is read for planning)")
    p.add_argument("--target", default=None, help="target device (default cpu): b200, b300, cpu, gb300, h100, h200, "
                                                 "mi355x, ppu-810e, ppu-m890, rubin, tpu-v7x, or a target .json")
    p.add_argument("--target-file", default=None, metavar="JSON", help="a user target described in a JSON file")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of one instance (default 1)")
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel group size, divides --tp (default 1)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel group size, divides --tp (default: --tp)")
    p.add_argument("--dcp-interleave", type=int, default=1,
                   help="DCP: rank r stores the runs of this many positions numbered r mod --dcp (default 1)")
    p.add_argument("--latent-cache", default="fp8", metavar="FMT", help="MLA latent cache: fp8 | nvfp4 | bf16")
    p.add_argument("--key-cache", default="fp8", metavar="FMT", help="DSA index-key cache: fp8 | mxfp4")
    p.add_argument("--kda-state", default="f32", metavar="FMT", help="KDA recurrent state: f32 | bf16")
    p.add_argument("--max-context", type=int, default=None, help="longest request context (default: the model's)")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="tokens per step (activation sizing)")
    p.add_argument("--max-requests", type=int, default=64, help="concurrent requests (KDA state slots)")
    p.add_argument("--block-size", type=int, default=64, help="cache block size in tokens (power of two)")
    p.add_argument("--emulate-formats", action="store_true",
                   help="allow cache formats the target has no native support for (dequantised in kernel)")
    return p


def load_model_config(spec: str) -> tuple[ModelConfig, str]:
    """A preset, a config.json, or a checkpoint directory's config.json (weights are not read)."""
    if spec in PRESETS:
        return get_preset(spec), f"preset {spec}"
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError([f"{path} is not valid JSON: {e}"], "--model") from None
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "checkpoint"
        return ModelConfig.from_hf(raw, source=path, name=name), os.path.abspath(path)
    raise ConfigError([f"--model {spec!r} is neither a preset, a config.json, nor a directory with one; "
                       f"presets: {', '.join(sorted(PRESETS))}"], "--model")


def plan_options(model: str, **flags) -> PlanOptions:
    """Programmatic form: `plan_options("k31-pro", target="gb300", tp=8, dcp=8)`."""
    unknown = sorted(set(flags) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"plan_options: unknown flags {unknown}; known: {sorted(DEFAULTS)}")
    ns = argparse.Namespace(model=model, **{**DEFAULTS, **flags})
    ns._given = set(flags)
    return resolve_plan_options(ns)


def resolve_plan_options(args) -> PlanOptions:
    """Every configuration problem is collected; one PlanConfigError lists them all."""
    g = {k: getattr(args, k, v) for k, v in DEFAULTS.items()}
    given = getattr(args, "_given", None)
    defaulted = tuple(k for k, v in DEFAULTS.items() if (k not in given if given is not None else g[k] == v))
    problems: list[str] = []
    cfg = source = target = None
    try:
        cfg, source = load_model_config(args.model)
    except ConfigError as e:
        problems += e.problems
    if g["target"] and g["target_file"]:
        problems.append(f"give --target or --target-file, not both (found {g['target']!r} and {g['target_file']!r})")
    try:
        target = get_target(g["target_file"] or g["target"] or "cpu")
    except TargetError as e:
        problems += [p if "target" in p else f"target: {p}" for p in e.problems]
    tp, dcp = g["tp"], g["dcp"]
    ep = g["ep"] if g["ep"] is not None else tp
    for flag, v in (("--tp", tp), ("--dcp", dcp), ("--ep", ep), ("--dcp-interleave", g["dcp_interleave"]),
                    ("--max-batched-tokens", g["max_batched_tokens"]),
                    ("--max-requests", g["max_requests"]), ("--block-size", g["block_size"])):
        if not isinstance(v, int) or v < 1:
            problems.append(f"{flag} must be a positive integer, found {v!r}")
    layout_ok = all(isinstance(v, int) and v >= 1 for v in (tp, dcp, ep))
    if layout_ok:
        problems += _group_problems(tp, dcp, ep)
    bs = g["block_size"]
    if isinstance(bs, int) and bs >= 1 and bs & (bs - 1):
        problems.append(f"--block-size must be a power of two (prefill and decode instances pair blocks), found {bs}")
    for flag, v, allowed in (("--latent-cache", g["latent_cache"], LATENT_FORMATS),
                             ("--key-cache", g["key_cache"], KEY_FORMATS),
                             ("--kda-state", g["kda_state"], STATE_FORMATS)):
        if v not in allowed:
            problems.append(f"{flag} {v!r} is not one of {', '.join(allowed)}")
    if cfg is not None and layout_ok:
        problems += _model_layout_problems(cfg, tp, ep)
    if target is not None and layout_ok:
        if tp > target.scaleup_size:
            problems.append(f"--tp {tp} exceeds {target.name}'s scale-up domain of {target.scaleup_size} devices "
                            f"({target.topology}): TP collectives would cross the slower scale-out network")
        problems += _format_problems(target, cfg, g)
    max_context = _max_context(cfg, g["max_context"], problems) if cfg is not None else None
    if cfg is None or target is None or problems and not _sizing_ok(g, tp, dcp, ep, max_context):
        raise PlanConfigError(problems)
    opts = PlanOptions(cfg=cfg, model_spec=args.model, model_source=source, target=target, tp=tp, dcp=dcp, ep=ep,
                       dcp_interleave=g["dcp_interleave"],
                       latent_cache=g["latent_cache"], key_cache=g["key_cache"], kda_state=g["kda_state"],
                       max_context=max_context, max_batched_tokens=g["max_batched_tokens"],
                       max_requests=g["max_requests"], block_size=bs, emulate_formats=bool(g["emulate_formats"]),
                       defaulted=defaulted)
    formats_ok = (opts.latent_cache in LATENT_FORMATS and opts.key_cache in KEY_FORMATS
                  and opts.kda_state in STATE_FORMATS)
    if formats_ok:  # sizes are computable: say whether (and by how much) the plan does not fit
        problems += fit_problems(opts)
    if problems:
        raise PlanConfigError(problems)
    return opts


def _group_problems(tp: int, dcp: int, ep: int) -> list[str]:
    p = []
    if tp % dcp:
        p.append(f"--dcp {dcp} does not divide --tp {tp}: a DCP group is a subgroup of the TP ranks "
                 f"(use --dcp in {_divisors(tp)})")
    if tp % ep:
        p.append(f"--ep {ep} does not divide --tp {tp}: EP groups are made of the instance's TP ranks "
                 f"(use --ep in {_divisors(tp)})")
    return p


def _max_context(cfg: ModelConfig, given, problems: list[str]):
    if given is None:
        return cfg.max_position_embeddings
    if not isinstance(given, int) or given < 1:
        problems.append(f"--max-context must be a positive integer, found {given!r}")
    elif given > cfg.max_position_embeddings:
        problems.append(f"--max-context {given} is longer than the model's max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    return given


def _sizing_ok(g, tp, dcp, ep, max_context) -> bool:
    nums = (tp, dcp, ep, g["max_batched_tokens"], g["max_requests"], g["block_size"], max_context)
    return all(isinstance(v, int) and v >= 1 for v in nums)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _model_layout_problems(cfg: ModelConfig, tp: int, ep: int) -> list[str]:
    p = []
    heads = [("KDA heads (kda_num_heads)", cfg.kda_num_heads) if cfg.kda_layers else None,
             ("MLA heads (num_attention_heads)", cfg.num_attention_heads) if cfg.full_attn_layers else None]
    for what, n in filter(None, heads):
        if n % tp:
            p.append(f"--tp {tp} does not divide the {n} {what} (use --tp in {_divisors(n)})")
    if cfg.num_experts % ep:
        p.append(f"--ep {ep} does not divide the {cfg.num_experts} routed experts (use --ep in "
                 f"{_divisors(cfg.num_experts) if cfg.num_experts <= 64 else 'a divisor of ' + str(cfg.num_experts)})")
    if not p:  # heads divide: check every other dimension the TP split cuts
        seen: dict[tuple, str] = {}
        for s in param_specs(cfg):
            if s.shard in ("col", "heads", "row"):
                dim = s.shape[-1] if s.shard == "row" else s.shape[0]
                if dim % tp:
                    seen.setdefault((s.shard, dim), s.name)
        for (shard, dim), name in sorted(seen.items()):
            p.append(f"--tp {tp} does not divide dimension {dim} of {name} ({shard}-sharded)")
    return p


def _format_problems(target: Target, cfg: ModelConfig | None, g: dict) -> list[str]:
    p = []
    used = [("--latent-cache", g["latent_cache"])]
    if cfg is None or cfg.has_indexer:
        used.append(("--key-cache", g["key_cache"]))
    for flag, fmt in used:
        if fmt in LATENT_FORMATS + KEY_FORMATS and not target.can_run(fmt) and not g["emulate_formats"]:
            native = ", ".join(target.native_formats) or "none"
            allowed = LATENT_FORMATS if flag == "--latent-cache" else KEY_FORMATS
            ok = [f for f in allowed if target.can_run(f)]
            fix = f"use {flag} {' or '.join(ok)}, or pass" if ok else f"no {flag[2:]} format is native there: pass"
            p.append(f"{flag} {fmt}: {target.name} has no native {fmt.upper()} (native formats: {native}); "
                     f"{fix} --emulate-formats to dequantise in the kernel")
    return p
