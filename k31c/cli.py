"""`k31c` command line: thin — parse, resolve, say what will happen, call the library.

    k31c run --model k31-tiny --prompt "hello" --max-new-tokens 16
    k31c logits --model k31-tiny --tokens 1,2,3 --out logits.safetensors [--decode-from 2]
    k31c init-weights --preset k31-tiny -o ckpt/ [--mxfp4] [--k3-names] [--shards 3]
    k31c ir --model k31-tiny [--function decode] [-o model.ir]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from .cli_common import UsageError, _say, check_out_path
from .cli_serve import cmd_logits, cmd_run

EXAMPLES = {
    "run": "examples:\n  k31c run --model k31-tiny --prompt 'Kimi says' --max-new-tokens 16\n"
           "  k31c run --model ckpt/ --prompt-tokens 1,2,3 --temperature 0.8 --top-p 0.9 --seed 1",
    "logits": "examples:\n  k31c logits --model k31-tiny --tokens 1,2,3,4 --out /tmp/logits.safetensors\n"
              "  k31c logits --model ckpt/ --tokens 1,2,3,4 --decode-from 2 --out /tmp/dec.safetensors",
    "compile": "examples:\n  k31c compile --model k31-tiny --target cpu -o build/tiny\n"
               "  k31c compile --model ckpt/ --target h200 -o build/x --dump-ir /tmp/ir --print-after packed_projection",
    "ir": "examples:\n  k31c ir --model k31-pro --function decode -o k31-pro.decode.ir\n  k31c ir --model ckpt/ --verify",
}



def _add_model_args(p: argparse.ArgumentParser, required: bool = True):
    p.add_argument("--model", required=required, help="checkpoint directory or preset name (random weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    p.add_argument("--dtype", choices=("fp32", "fp64", "bf16"), default="fp32",
                   help="compute dtype (fp32/fp64 on CPU; bf16 on a GPU runs kernels on bf16 weights)")
    p.add_argument("--device", default="cpu", help="torch device for the reference interpreter (cpu, cuda)")


def _add_tuning_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("kernel configs (artifacts): tuned in the artifact > tuning store record > miss policy")
    g.add_argument("--miss-policy", choices=("readonly", "fallback", "tune"), default=None,
                   help="a kernel shape bucket with no tuned config and no record: readonly = stop with the "
                        "`k31c tune` command that makes it (default for an artifact compiled for a GPU target: "
                        "a deployment runs tuned kernels or says which are missing); fallback = the kernel's "
                        "declared heuristic, counted and reported (default for --target cpu, the development "
                        "path); tune = tune it now and store the record")
    g.add_argument("--tuning-store", default=None,
                   help="tuning records (JSON lines; default: this device's store, autotune_cache/records/"
                        "<device>.jsonl or $K31C_TUNING_CACHE)")


def build_parser() -> argparse.ArgumentParser:
    from .model.init_weights import add_init_weights_parser
    from .parallel.launch import add_launch_args
    from .plan import add_plan_args
    from .plan.cli import add_explain_parser, add_export_onnx_parser, add_inspect_parser

    ap = argparse.ArgumentParser(prog="k31c", description="k31c: compiler and runtime for Kimi K3 / K3.1 Pro models",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("run", help="generate from a prompt", epilog=EXAMPLES["run"], formatter_class=fmt)
    p.add_argument("artifact", nargs="?", default=None, help="compiled artifact directory (from k31c compile)")
    _add_model_args(p, required=False)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (byte-level tokenizer)")
    src.add_argument("--prompt-tokens", help="comma-separated token ids")
    src.add_argument("--prompts-file", help="file with one prompt per line (served together by the engine: "
                                            "continuous batching)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill in chunks of this many tokens")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once (default: all prompts)")
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget of one engine step")
    p.add_argument("--prefix-caching", action="store_true", help="reuse cached prompt prefixes (T8)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--jit-fallback", action="store_true",
                   help="on a GPU, JIT-compile kernels the artifact has no stored binary for (else refuse)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on a GPU, replay decode steps as CUDA graphs per batch-size bucket (artifacts only; "
                        "default: on with --device cuda and an artifact on one rank)")
    p.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="launch decode step N+1 on step N's device-side token ids before the host reads them "
                        "(overlaps host and device; same tokens; default: on with --device cuda)")
    _add_tuning_args(p)
    add_launch_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("logits", help="write the logits of a prompt to a safetensors file",
                       epilog=EXAMPLES["logits"], formatter_class=fmt)
    _add_model_args(p, required=False)
    p.add_argument("--artifact", default=None, help="run a compiled artifact (its kernels) instead of --model")
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .safetensors (tensor `logits`, fp32 [T, vocab])")
    p.add_argument("--jit-fallback", action="store_true",
                   help="on a GPU, JIT-compile kernels the artifact has no stored binary for (else refuse)")
    p.add_argument("--decode-from", type=int, default=None,
                   help="prefill the first N tokens, compute the rest by decode steps")
    _add_tuning_args(p)
    add_launch_args(p)
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("ir", help="print the model's IR (text form)", epilog=EXAMPLES["ir"], formatter_class=fmt)
    p.add_argument("--model", required=True, help="checkpoint directory, config.json, or preset name")
    p.add_argument("--function", default=None, help="print only this entry function (prefill, decode, verify)")
    p.add_argument("-o", "--out", default=None, help="write to this file instead of stdout")
    p.add_argument("--verify", action="store_true", help="run the verifier and report")
    p.set_defaults(func=cmd_ir)

    p = sub.add_parser("compile", help="compile a model into an artifact directory", epilog=EXAMPLES["compile"],
                       formatter_class=fmt)
    add_plan_args(p)
    p.add_argument("-o", "--out", required=True, help="artifact directory to write")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every kernel's reduction order independent of batch size and composition")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="skip a pass (repeatable)")
    p.add_argument("--print-after", action="append", default=[], metavar="NAME", help="print the IR after a pass")
    p.add_argument("--dump-ir", default=None, metavar="DIR",
                   help="also copy the IR after every pass (NNN_<pass>.ir) to DIR (the artifact always has ir/)")
    p.add_argument("--aot", action="store_true",
                   help="also build every Triton kernel ahead of time for the target (no GPU needed): "
                        "kernels/bin/<arch>/ (see codegen/aot)")
    from codegen.aot.__main__ import add_build_args

    add_build_args(p)
    p.set_defaults(func=cmd_compile)

    add_explain_parser(sub)
    add_inspect_parser(sub)
    add_export_onnx_parser(sub)
    add_init_weights_parser(sub)
    from autotune_cache.cli import add_cache_parser
    from autotune_cache.tune_cli import add_tune_parser

    add_cache_parser(sub)
    add_tune_parser(sub)
    return ap


# ---- helpers -----------------------------------------------------------------------------------
def cmd_compile(args) -> int:
    from .compiler import MAX_WEIGHTS_BYTES, CompileOptions, compile_model
    from .model import load_model
    from .plan import PlanConfigError, resolve_plan_options
    from .plan.memory import param_bytes

    try:
        plan = resolve_plan_options(args)
    except PlanConfigError as e:
        raise UsageError(e.problems) from None
    cfg = plan.cfg
    from .model.params import param_specs

    weight_bytes = sum(param_bytes(math.prod(s.shape), s.format) for s in param_specs(cfg))
    weights, source = None, plan.model_source
    if os.path.isdir(args.model) or (not os.path.isfile(args.model) and weight_bytes <= MAX_WEIGHTS_BYTES):
        model = load_model(args.model, args.seed)
        cfg, weights, source = model.config, model.weights, model.source
    else:
        _say(f"k31c compile: {cfg.name} without weights ({weight_bytes / 2**30:.0f} GiB of parameters): "
             f"the artifact can be inspected and planned, not run")
    opts = CompileOptions(plan=plan, batch_invariant=args.batch_invariant, disable=tuple(args.disable_pass),
                          print_after=tuple(args.print_after))
    _say(f"k31c compile: {source} -> {args.out} (target {opts.target}, tp={plan.tp} dcp={plan.dcp} ep={plan.ep}"
         f"{', batch-invariant' if args.batch_invariant else ''})")
    art, summary = compile_model(cfg, weights, args.out, opts, model_source=source)
    if args.dump_ir:
        import shutil

        shutil.copytree(os.path.join(args.out, "ir"), args.dump_ir, dirs_exist_ok=True)
    _say(summary)
    if args.aot:
        from codegen.aot import AOTError
        from codegen.aot.__main__ import run_build

        if weights is None:
            raise UsageError([f"--aot needs the model's weights (its launches are recorded by running it); "
                              f"{cfg.name} was compiled without them"])
        try:
            run_build(args.out, args)
        except AOTError as e:
            raise UsageError([str(e)]) from None
    _say(f"wrote {args.out}")
    return 0


def cmd_ir(args) -> int:
    from ir.printer import print_function, print_module
    from ir.verifier import verify

    from .model.build import build_module
    from .plan.options import load_model_config

    m = build_module(load_model_config(args.model)[0])
    if args.function is not None and args.function not in m.functions:
        raise UsageError([f"--function {args.function!r}: the module has {', '.join(m.functions)}"])
    text = print_function(m.functions[args.function]) + "\n" if args.function else print_module(m)
    if args.verify:
        verify(m)
        _say(f"verified @{m.name}: {sum(m.op_counts().values())} nodes, {len(m.params)} params")
    if args.out:
        problems: list[str] = []
        check_out_path(args.out, problems)
        if problems:
            raise UsageError(problems)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        _say(f"wrote {args.out} ({len(text.splitlines())} lines)")
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("run", "logits"):  # --tp N: N ranks (or this rank under torchrun); rank 0 prints
        from .parallel.launch import launch_main

        return launch_main(args, dispatch)
    return dispatch(args)


def dispatch(args) -> int:
    """Run the parsed command, turning the library's configuration errors into exit code 2."""
    from ir.verifier import VerifyError

    from .model.checkpoint import CheckpointError
    from .model.config import ConfigError
    from autotune_cache import TuningMiss
    from passes.base import PassError

    from .compiler import ArtifactError
    from .plan import PlanConfigError
    from .targets import TargetError
    from .runtime.reference import RequestError

    try:
        return args.func(args)
    except (UsageError, ConfigError, CheckpointError, RequestError, VerifyError, ArtifactError, PassError,
            PlanConfigError, TargetError, TuningMiss) as e:
        print(f"k31c {args.command}: error:\n{e}" if "\n" in str(e) else f"k31c {args.command}: error: {e}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
