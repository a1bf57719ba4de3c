"""The `k31c explain`, `k31c inspect` and `k31c export-onnx` sub-commands (wired into k31c/cli.py).

    k31c explain --model k31-pro --target gb300 --tp 8 --dcp 8 [--json]
    k31c inspect build/k31-gb300 [--check-live] [--json]
    k31c export-onnx --model k31-pro --function decode -o k31-pro.decode.onnx
    k31c export-onnx --model k31-tiny --phase fuse --function prefill -o fused.onnx   # IR after a phase
    k31c export-onnx --artifact build/k31-gb300 --phase value_gate -o vg.onnx        # an artifact's IR dump

Each command prints its own errors (`k31c <cmd>: error: ...`, every problem listed) and returns 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from .options import PlanConfigError, add_plan_args, resolve_plan_options
from .report import format_cache_layout, format_plan, make_plan, nbytes, plan_json, table

_FMT = argparse.RawDescriptionHelpFormatter


def _fail(cmd: str, e: Exception) -> int:
    msg = str(e)
    print(f"k31c {cmd}: error:\n{msg}" if "\n" in msg else f"k31c {cmd}: error: {msg}", file=sys.stderr)
    return 2


# ---- explain -------------------------------------------------------------------------------------
def add_explain_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="plan memory, capacity, traffic and layout without building anything",
                       formatter_class=_FMT, epilog="examples:\n  k31c explain --model k31-pro --target gb300 --tp 8 "
                       "--dcp 8\n  k31c explain --model ckpt/config.json --target h200 --tp 8 --json")
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document (keys: k31c.plan)")
    p.set_defaults(func=cmd_explain)
    return p


def cmd_explain(args) -> int:
    try:
        opts = resolve_plan_options(args)
    except PlanConfigError as e:
        return _fail("explain", e)
    plan = make_plan(opts)
    sys.stdout.write(plan_json(plan) if args.json else format_plan(plan))
    return 0


# ---- inspect -------------------------------------------------------------------------------------
def add_inspect_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="show an artifact: manifest, per-rank memory, kernels and configs",
                       formatter_class=_FMT, epilog="examples:\n  k31c inspect build/k31-gb300\n"
                       "  k31c inspect build/k31-tiny --check-live")
    p.add_argument("artifact", help="artifact directory written by k31c compile")
    p.add_argument("--check-live", action="store_true", help="also check this machine's device and toolchain")
    p.add_argument("--json", action="store_true", help="print manifest, plan memory, kernels and problems as JSON")
    p.set_defaults(func=cmd_inspect)
    return p


def cmd_inspect(args) -> int:
    from ..artifact import verify

    man, problems = verify(args.artifact, check_live=args.check_live)
    if man is None:
        return _fail("inspect", ValueError("\n".join(f"  - {p}" for p in problems)))
    plan = _optional_json(os.path.join(args.artifact, "plan.json"), problems)
    kernels = _optional_json(os.path.join(args.artifact, "kernels", "configs.json"), problems)
    if args.json:
        doc = {"manifest": man, "memory": (plan or {}).get("memory"), "kernels": kernels, "problems": problems}
        sys.stdout.write(json.dumps(doc, sort_keys=True, indent=1) + "\n")
    else:
        sys.stdout.write(format_inspect(args.artifact, man, plan, kernels, problems))
    return 1 if problems else 0


def _optional_json(path: str, problems: list[str]):
    from ..artifact import read_json

    return read_json(path, os.path.basename(path), problems) if os.path.isfile(path) else None


def format_inspect(path: str, man: dict, plan: dict | None, kernels: dict | None, problems: list[str]) -> str:
    model, tgt, lay = man.get("model", {}), man.get("target", {}), man.get("layout", {})
    tc = man.get("toolchain", {})
    files = man.get("files", {})
    sizes = sum(os.path.getsize(os.path.join(path, f)) for f in files if os.path.isfile(os.path.join(path, f)))
    out = [f"artifact {path}", table(["", ""], [
        ["schema", f"{man.get('schema_version')} (k31c {man.get('k31c_version')})"],
        ["model", f"{model.get('name')} (config {model.get('config_digest')}; {model.get('source')})"],
        ["target", f"{tgt.get('name')}: {tgt.get('description', '')}"],
        ["kernel backends", ", ".join(tgt.get("backends", [])) or "none (plan only)"],
        ["layout", " ".join(f"{k}={lay.get(k)}" for k in ("tp", "dcp", "ep"))],
        ["options", json.dumps(man.get("options", {}), sort_keys=True)],
        ["passes", f"{len(man.get('passes', []))}: {', '.join(man.get('passes', []))}"],
        ["toolchain", ", ".join(f"{k} {v}" for k, v in sorted(tc.items()))],
        ["files", f"{len(files)} files, {nbytes(sizes)}"]])]
    out += ["", "integrity: OK" if not problems else f"integrity: {len(problems)} problem(s)"]
    out += [f"  - {p}" for p in problems]
    mem = (plan or {}).get("memory")
    out += ["", "per-rank memory (plan.json)"]
    if mem:
        rows = [["weights", nbytes(mem["weights_bytes"])], ["activations", nbytes(mem["activations_bytes"])]]
        rows += [[f"workspace: {k}", nbytes(v)] for k, v in mem.get("workspaces", {}).items()]
        rows += [[f"reserve: {k}", nbytes(v)] for k, v in mem.get("reserves", {}).items()]
        rows += [["free for cache", nbytes(mem["free_for_cache_bytes"])],
                 ["device memory", nbytes(mem["capacity_bytes"])]]
        out.append(table(["component", "bytes"], rows))
        cap = (plan.get("capacity") or {}).get("chosen")
        if cap:
            out.append(f"  capacity: {cap['tokens']:,} cache tokens, {cap['concurrent_contexts']} concurrent "
                       f"{cap['context_tokens']:,}-token contexts")
    else:
        out.append("  no plan.json")
    if (plan or {}).get("cache_layout"):
        out += ["", "packed cache block row (plan.json cache_layout; the runtime allocates one pool of these)"]
        out += format_cache_layout(plan["cache_layout"])
    out += ["", "kernels (kernels/configs.json)"]
    if kernels:
        # entries: kernel name (or a shape-bucket id with `kernel_name`) -> {family, op, config, source, ...}
        rows = [[k.get("kernel_name", name), k.get("family", ""), k.get("op", ""),
                 json.dumps(k.get("config", {}), sort_keys=True), k.get("source", "")]
                for name, k in sorted(kernels.items())]
        out.append(table(["kernel", "family", "op", "config", "config from"], rows))
    else:
        out.append("  no kernels/configs.json" if kernels is None else "  no kernels")
    return "\n".join(out) + "\n"


# ---- export-onnx ---------------------------------------------------------------------------------
def add_export_onnx_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export-onnx", help="write an IR function as ONNX (custom domain ai.k31c)",
                       formatter_class=_FMT, epilog="examples:\n  k31c export-onnx --model k31-pro --function "
                       "decode -o k31-pro.decode.onnx\n  k31c export-onnx --artifact build/k31-tiny --phase fuse "
                       "--function prefill -o fused.onnx")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="preset, config.json or checkpoint directory: the IR as the model builds it")
    src.add_argument("--artifact", help="artifact directory: export the IR dumped after a pass (ir/NNN_<pass>.ir)")
    p.add_argument("--function", default="decode", help="entry function: prefill, decode or verify (default decode)")
    p.add_argument("--phase", default=None, help="with --model: 'model' (as built, default), a pipeline phase or "
                                                 "pass (the IR after it); with --artifact: the IR dump of a pass "
                                                 "(name or NNN_name; default the last)")
    p.add_argument("-o", "--out", required=True, help="output .onnx file")
    p.set_defaults(func=cmd_export_onnx)
    return p


def cmd_export_onnx(args) -> int:
    problems: list[str] = []
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        problems.append(f"-o {args.out}: folder {folder} does not exist (mkdir -p {folder})")
    module = None
    try:
        if args.model is not None:
            module = _module_after(args.model, args.phase)
        else:
            module = _artifact_module(args.artifact, args.phase)
    except ValueError as e:
        problems += getattr(e, "problems", [str(e)])
    if module is not None and args.function not in module.functions:
        problems.append(f"--function {args.function!r}: the module has {', '.join(module.functions)}")
    if problems:
        return _fail("export-onnx", ValueError("\n".join(f"  - {p}" for p in problems)) if len(problems) > 1
                     else ValueError(problems[0]))
    from ir.onnx_export import export_function

    model = export_function(module, args.function, args.out)
    print(f"wrote {args.out}: @{module.name}.{args.function}, {len(model.graph.node)} nodes, "
          f"{os.path.getsize(args.out):,} bytes (params as inputs, no data)", file=sys.stderr)
    return 0


def _module_after(spec: str, phase: str | None):
    """The model's IR as built ('model'), or after a pass-pipeline phase or pass (the pipeline runs up to
    and including it, every later pass disabled)."""
    from ..model.build import build_module
    from .options import load_model_config

    if phase not in (None, "model"):
        from passes.pipeline import PHASES, pass_names

        names, phases = pass_names(), dict(PHASES)
        if phase not in names and phase not in phases:
            raise ValueError(f"--phase {phase!r} is neither 'model', a phase ({', '.join(phases)}) nor a pass "
                             f"({', '.join(names)})")
    cfg, _ = load_model_config(spec)
    module = build_module(cfg)
    if phase in (None, "model"):
        return module
    from passes.pipeline import run_pipeline

    last = phases[phase][-1] if phase in phases else phase
    try:
        run_pipeline(module, disable=tuple(names[names.index(last) + 1:]))
    except ImportError as e:
        raise ValueError(f"--phase {phase}: the pass pipeline cannot run here ({e})") from None
    return module


def _artifact_module(root: str, phase: str | None):
    from ir.parser import parse_module

    dumps = sorted(glob.glob(os.path.join(root, "ir", "*.ir")))
    if not dumps:
        raise ValueError(f"{root}/ir has no IR dumps (*.ir); is {root} a k31c artifact?")
    stems = [os.path.splitext(os.path.basename(d))[0] for d in dumps]
    if phase is None:
        pick = dumps[-1]
    else:
        hits = [d for d, s in zip(dumps, stems) if s == phase or s.split("_", 1)[-1] == phase]
        if not hits:
            raise ValueError(f"--phase {phase!r}: no such IR dump in {root}/ir; available: {', '.join(stems)}")
        pick = hits[-1]
    with open(pick, encoding="utf-8") as f:
        return parse_module(f.read())
