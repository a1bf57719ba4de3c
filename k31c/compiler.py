"""`k31c compile`: model -> passes -> kernel selection -> artifact directory; and loading it back.

Artifact layout (same inputs give byte-identical files: no timestamps, sorted keys):
    manifest.json            schema, model config hash, target, layout, passes, toolchain, sha256 of every file
    config.json              the model's configuration (K3 keys)
    plan.json                memory/capacity/traffic plan (k31c/plan), cache row layout, kernel list
    module.ir                the final IR (parseable text)
    ir/NNN_<pass>.ir         the IR after every pass (000_input.ir first)
    kernels/<family>.py      source of every kernel template used
    kernels/selection.json   [{function, index, op, kernel}] for every node (kernel or "reference"/"view")
    kernels/configs.json     bucket id -> {family, kernel_name, config, source} for representative shapes
    weights/model.safetensors  canonical weights (MXFP4 as `<name>.__packed` / `<name>.__scales`), when present
    report.txt               passes, kernels, reference fallbacks
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import torch

from codegen.select import Choice, fallback_table, select_kernels
from codegen.registry import all_templates
from ir.core import Module
from ir.packed import PackedMXFP4
from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import verify
from passes.base import PassContext
from passes.pipeline import run_pipeline

from .artifact import ArtifactError
from .model.build import BuildOptions, build_module
from .runtime.block_layout import plan_block_layout
from .model.config import ModelConfig

MAX_WEIGHTS_BYTES = 4 << 30  # presets bigger than this compile without weights (plan only)
REPRESENTATIVE = {"prefill": {"B": 256, "R": 4}, "decode": {"R": 8}, "verify": {"B": 32, "R": 8}}
POOL_SIZES = {"N": 4096, "S": 8, "MB": 64}


@dataclass
class CompileOptions:
    plan: object  # k31c.plan.PlanOptions: model config, target, layout, cache formats
    batch_invariant: bool = False
    disable: tuple[str, ...] = ()
    print_after: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return self.plan.target.name

    @property
    def backends(self) -> tuple[str, ...]:
        """Kernel backends of the target ("triton", "tvm"); empty for plan-only targets."""
        return tuple(sorted({b.split(":")[0].split("-")[0] for b in self.plan.target.backends}))


IR_LATENT_CACHE = {"fp8": "f8e4m3", "nvfp4": "nvfp4", "bf16": "bf16"}  # --latent-cache -> the IR latent pools


def build_options(plan) -> BuildOptions:
    """The model-build options a plan asks for: block size and the cache formats (SPEC §7)."""
    if plan.latent_cache not in IR_LATENT_CACHE:
        raise ArtifactError([f"--latent-cache {plan.latent_cache}: the IR builds {' or '.join(IR_LATENT_CACHE)} latent "
                             f"caches ({plan.latent_cache} is planned by `k31c explain` but has no IR path yet); "
                             f"use --latent-cache fp8"], "compile")
    return BuildOptions(block_size=plan.block_size, latent_cache_dtype=IR_LATENT_CACHE[plan.latent_cache],
                        key_cache=plan.key_cache)


@dataclass
class Artifact:
    path: str
    module: Module
    choices: list[Choice]
    configs: dict
    weights: dict | None
    manifest: dict = field(default_factory=dict)
    config_sources: dict = field(default_factory=dict)  # bucket id -> "heuristic" (compile) | "tuned" (k31c tune)


def compile_model(config: ModelConfig, weights: dict | None, out_dir: str, opts: CompileOptions,
                  model_source: str = "") -> tuple[Artifact, str]:
    """Build, optimise, select kernels, plan, and write the artifact. Returns (artifact, summary)."""
    from .artifact import write_manifest
    from .plan import make_plan, plan_json
    from .plan.sharding_cost import prefill_sharding

    if os.path.exists(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "manifest.json")):
        raise ArtifactError(["exists, is not empty and is not a k31c artifact; choose another folder"], f"-o {out_dir}")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    module = build_module(config, build_options(opts.plan))
    p = opts.plan
    crossover = prefill_sharding(p)["crossover_tokens"] if p.tp > 1 else None
    ctx = PassContext(target=opts.target, batch_invariant=opts.batch_invariant,
                      options={"tp": p.tp, "ep": p.ep, "dcp": p.dcp, "dcp_interleave": p.dcp_interleave,
                               "token_shard_min_tokens": crossover if crossover is not None else 2**62})
    result = run_pipeline(module, ctx, disable=opts.disable, dump_dir=os.path.join(out_dir, "ir"),
                          print_after=opts.print_after)
    verify(module)
    _write(out_dir, "module.ir", print_module(module))
    _write(out_dir, "config.json", json.dumps(config.to_hf(), indent=1, sort_keys=True) + "\n")
    choices = select_kernels(module, opts.target, opts.backends) if opts.backends else []
    configs = _representative_configs(module, choices, opts)
    _write_kernels(out_dir, choices, configs)
    plan = make_plan(opts.plan, _kernel_list(choices, configs))
    plan["cache_layout"] = _cache_layout(module, config, opts.plan)
    _write(out_dir, "plan.json", plan_json(plan))
    if weights is not None:
        save_weights(weights, os.path.join(out_dir, "weights", "model.safetensors"))
    report = _report(result.records, choices, opts)
    _write(out_dir, "report.txt", report)
    write_manifest(out_dir, {"config": config, "model_source": model_source, "target": p.target,
                             "layout": {"tp": p.tp, "dcp": p.dcp, "ep": p.ep, "dcp_interleave": p.dcp_interleave}, "passes": [r.name for r in result.records],
                             "options": {"batch_invariant": opts.batch_invariant, "has_weights": weights is not None,
                                         "latent_cache": p.latent_cache, "key_cache": p.key_cache}})
    summary = f"{result.table()}\n{report}"  # with pass timings; the artifact itself has none
    art = _artifact(out_dir, module, choices, configs, weights,
                    json.load(open(os.path.join(out_dir, "manifest.json"), encoding="utf-8")))
    return art, summary


def _cache_layout(module, config, p) -> dict | None:
    """plan.json's `cache_layout`: the packed row the `plan_cache_layout` pass planned from the per-rank IR
    (what the runtime allocates), checked against the memory planner's formats (`plan_block_layout` from
    the config) — one row, byte for byte, or a compile error naming where they part."""
    text = module.attrs.get("cache_layout")
    if text is None:
        return None  # flat pools or the pass disabled: the runtime derives its pools from the IR
    planned = json.loads(text)
    expected = plan_block_layout(config, p.block_size, p.latent_cache, p.key_cache, tp=p.tp,
                                 state_fmt=p.kda_state).to_json()
    diff = sorted(k for k in set(planned) | set(expected) if planned.get(k) != expected.get(k))
    if diff:
        raise ValueError(f"cache layout of the IR pools differs from the memory plan in {diff}: "
                         + "; ".join(f"{k}: IR {planned.get(k)!r} vs plan {expected.get(k)!r}" for k in diff[:3]))
    return planned


def _kernel_list(choices: list[Choice], configs: dict) -> list[dict]:
    from codegen.registry import all_templates

    backend = {t.family: t.backend for t in all_templates()}
    out = [{"name": v["kernel_name"], "op": v["op"], "family": v["family"], "backend": backend.get(v["family"], "triton"),
            "config": v["config"], "cache": v["source"]} for _, v in sorted(configs.items())]
    fallback = sorted({c.op for c in choices if c.template is None and c.kernel == "reference"})
    out += [{"name": f"reference:{op}", "op": op, "family": "reference", "backend": "torch", "config": {},
             "cache": "fallback"} for op in fallback]
    return out


def load_artifact(path: str, with_weights: bool = True, check_live: bool = True) -> Artifact:
    """Validate the artifact (hashes, schema, live machine: every mismatch at once) and load it."""
    from .artifact import verify as verify_artifact

    manifest, problems = verify_artifact(path, check_live=check_live)
    if manifest is None:
        raise ArtifactError(problems, path)
    if manifest["target"].get("plan_only"):
        problems.append(f"target {manifest['target']['name']} has no kernel backend: the artifact is a plan only")
    if problems:
        raise ArtifactError(problems, path)
    module = parse_module(open(os.path.join(path, "module.ir"), encoding="utf-8").read())
    verify(module)
    selection = json.load(open(os.path.join(path, "kernels", "selection.json"), encoding="utf-8"))
    configs = json.load(open(os.path.join(path, "kernels", "configs.json"), encoding="utf-8"))
    by_family = {t.family: t for t in all_templates()}
    choices = []
    for s in selection:
        fam = s["kernel"]
        t = by_family.get(fam) if fam not in ("reference", "view") else None
        if fam not in ("reference", "view") and t is None:
            problems.append(f"kernel family {fam!r} used by {s['function']}:{s['index']} is not in this k31c")
            continue
        if t is not None and t.source() != open(os.path.join(path, "kernels", f"{fam}.py"), encoding="utf-8").read():
            problems.append(f"kernel family {fam}: the installed template source differs from the artifact's copy; "
                            f"recompile with this k31c")
        choices.append(Choice(s["function"], s["index"], s["op"], "", t, ""))
    if problems:
        raise ArtifactError(sorted(set(problems)), path)
    weights = None
    wpath = os.path.join(path, "weights", "model.safetensors")
    if with_weights and os.path.isfile(wpath):
        weights = load_weights(wpath)
    return _artifact(path, module, choices, configs, weights, manifest)


def _artifact(path: str, module: Module, choices: list[Choice], configs: dict, weights, manifest: dict) -> Artifact:
    """An Artifact from kernels/configs.json's entries (bucket id -> {config, source, ...})."""
    return Artifact(path, module, choices, {k: v["config"] for k, v in configs.items()}, weights, manifest,
                    {k: v.get("source", "heuristic") for k, v in configs.items()})


def artifact_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return ModelConfig.from_hf(json.load(f), source=os.path.join(path, "config.json"))


# ---- weights -----------------------------------------------------------------------------------
def save_weights(weights: dict, path: str):
    from safetensors.torch import save_file

    flat = {}
    for name, w in weights.items():
        if isinstance(w, PackedMXFP4):
            flat[name + ".__packed"], flat[name + ".__scales"] = w.packed.contiguous(), w.scales.contiguous()
        else:
            flat[name] = w.contiguous()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: flat[k] for k in sorted(flat)}, path, metadata={"format": "k31c-canonical"})


def load_weights(path: str) -> dict:
    from safetensors.torch import load_file

    flat = load_file(path)
    out = {}
    for name, t in flat.items():
        if name.endswith(".__packed"):
            base = name[: -len(".__packed")]
            out[base] = PackedMXFP4(t, flat[base + ".__scales"])
        elif not name.endswith(".__scales"):
            out[name] = t
    return out


# ---- kernels -----------------------------------------------------------------------------------
def _meta_operands(module: Module, c: Choice, env: dict, target: str = "cpu"):
    """Meta tensors of a node's operands as the executor will hold them on `target`: the CPU path computes
    bf16/f16/f32 values in fp32 (so the tuning bucket, keyed by dtypes, is the one the executor looks up)."""
    from ir.dtypes import WIDENED_FLOATS
    from ir.shapes import evaluate

    node = module.function(c.function).nodes[c.index]
    out = []
    for v in node.inputs:
        dims = [evaluate(d, env) for d in v.type.shape]
        dt = v.type.dtype.torch_dtype or torch.uint8
        if target == "cpu" and v.type.dtype.name in WIDENED_FLOATS:
            dt = torch.float32
        out.append(torch.empty(dims, dtype=dt, device="meta"))
    return node, out


def _representative_configs(module: Module, choices: list[Choice], opts: CompileOptions) -> dict:
    from types import SimpleNamespace

    from ir.ops import OPS

    from .runtime.executor import bucket_id

    configs = {}
    for c in choices:
        if c.template is None:
            continue
        env = {**POOL_SIZES, "NB": POOL_SIZES["N"] // int(module.attrs.get("block_size", 1)),
               **REPRESENTATIVE.get(c.function, {"B": 64, "R": 4})}
        node, metas = _meta_operands(module, c, env, opts.target)
        op = OPS.get(node.op)
        a = op.bind(metas) if op is not None and node.body is None else SimpleNamespace(operands=metas)
        attrs = {**(op.full_attrs(node.attrs) if op else node.attrs), "batch_invariant": opts.batch_invariant}
        key = c.template.key_dims(a, attrs)
        cfg = c.template.heuristic(key, opts.target)
        configs[bucket_id(c.template, key)] = {"family": c.template.family, "op": c.op,
                                               "kernel_name": c.template.kernel_name(cfg, key),
                                               "config": cfg, "source": "heuristic"}
    return configs


def _write_kernels(out_dir: str, choices: list[Choice], configs: dict):
    kdir = os.path.join(out_dir, "kernels")
    os.makedirs(kdir, exist_ok=True)
    for t in {c.template.family: c.template for c in choices if c.template is not None}.values():
        _write(kdir, f"{t.family}.py", t.source())
    selection = [{"function": c.function, "index": c.index, "op": c.op, "kernel": c.kernel} for c in choices]
    _write(kdir, "selection.json", json.dumps(selection, indent=0) + "\n")
    _write(kdir, "configs.json", json.dumps(configs, indent=1, sort_keys=True) + "\n")


def _report(records, choices: list[Choice], opts: CompileOptions) -> str:
    used: dict = {}
    for c in choices:
        if c.template is not None:
            used[c.template.family] = used.get(c.template.family, 0) + 1
    p = opts.plan
    lines = [f"target {opts.target} (kernel backends: {', '.join(opts.backends) or 'none: plan only'}); "
             f"layout tp={p.tp} dcp={p.dcp} ep={p.ep}; batch-invariant {'on' if opts.batch_invariant else 'off'}"]
    if p.tp > 1 or p.dcp > 1 or p.ep > 1:
        lines.append("note: the IR is the unsharded model; the parallel-layout passes (TP/DCP/EP) are not "
                     "written yet, so this layout is planned (plan.json) but not materialised")
    lines.append("passes (rewrites):")
    lines += [f"  {r.phase:<8} {r.name:<28} {r.rewrites:>5}" for r in records]
    lines.append("kernels (nodes per family):")
    lines += [f"  {n:>4} x {fam}" for fam, n in sorted(used.items())] or ["  none"]
    lines += ["reference fallbacks:", *("  " + ln for ln in fallback_table(choices).splitlines())]
    return "\n".join(lines) + "\n"


def _write(folder: str, name: str, text: str):
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        f.write(text)
