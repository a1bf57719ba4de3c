"""`k31c run` and `k31c logits`: resolve a model or artifact into a runtime (one rank or several) and
serve prompts through the engine, or write the logits of a token list."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from .cli_common import UsageError, _say, _torch_dtype, check_out_path, check_tokens, parse_token_list


@dataclass
class _Source:
    """What runs a step: a model through the reference interpreter, or a compiled artifact's kernels."""

    config: object
    description: str
    make_runtime: Callable


def default_cuda_graphs(args, artifact: str | None) -> bool:
    """`k31c run`'s --cuda-graphs when not given: on for an artifact served on a CUDA device by one rank
    (graphs replay compiled kernels; parallel runs keep eager steps)."""
    layout = getattr(args, "parallel", None)
    return bool(artifact) and args.device.startswith("cuda") and (layout is None or layout.world == 1)


def default_async_decode(args, runtime) -> bool:
    """`k31c run`'s --async-decode when not given: on where it overlaps host and device work, i.e. on a CUDA
    device with a runtime that keeps sampled ids on the device (same tokens either way)."""
    return args.device.startswith("cuda") and getattr(runtime, "token_feed", None) is not None


def _resolve_source(args, artifact: str | None, problems: list[str]) -> _Source | None:
    from .compiler import ArtifactError, artifact_config, load_artifact
    from .model import load_model
    from .model.build import build_module
    from .parallel.serving import parallel_runtime
    from .runtime.executor import Executor
    from .runtime.cuda_graphs import GraphedRuntime
    from .runtime.reference import ReferenceRuntime

    dtype = _torch_dtype(args.dtype)
    _POLICIES.clear()  # this command's policies only (a process may run several commands)
    if hasattr(args, "cuda_graphs") and args.cuda_graphs is None:  # `run`'s default
        args.cuda_graphs = default_cuda_graphs(args, artifact)
    if getattr(args, "cuda_graphs", False):
        if not args.device.startswith("cuda"):
            problems.append(f"--cuda-graphs needs --device cuda (found --device {args.device})")
        if not artifact:
            problems.append("--cuda-graphs replays a compiled artifact's kernels: give an artifact directory "
                            "(k31c compile), not --model")
    if artifact and args.model:
        problems.append(f"give either an artifact ({artifact}) or --model ({args.model}), not both")
        return None
    if artifact:
        try:
            art = load_artifact(artifact)
        except (ArtifactError, OSError) as e:
            problems.append(str(e))
            return None
        if art.weights is None:
            problems.append(f"artifact {artifact} has no weights (compiled from a config alone): it can be "
                            f"inspected, not run; compile from a checkpoint or a tiny preset")
            return None
        cfg = artifact_config(artifact)
        target = art.manifest["target"]["name"]
        if args.device.startswith("cuda"):
            from codegen.aot import AOTError, install, stored_archs

            if stored_archs(artifact):  # compiled with --aot (without: the plain JIT, as before)
                try:  # launches use kernels/bin/<arch>/; a foreign arch / Triton is refused unless --jit-fallback
                    install(artifact, jit_fallback=args.jit_fallback)
                except AOTError as e:
                    problems.append(str(e))
                    return None

        def make(rows, requests):
            def build(module, weights):
                policy = _miss_policy(args, artifact, target, module, weights, art.choices, dtype)
                engine = Executor(module, weights, art.choices, target=target, configs=_tuned_configs(art),
                                  batch_invariant=art.manifest["options"].get("batch_invariant", False),
                                  compute_dtype=dtype, device=args.device, tuning=policy,
                                  cuda_graphs=bool(getattr(args, "cuda_graphs", False)))
                runtime = GraphedRuntime if engine.cuda_graphs else ReferenceRuntime
                return runtime(module, weights, max_rows=rows, max_requests=requests, engine=engine)
            return parallel_runtime(getattr(args, "parallel", None), art.module, art.weights, build)

        return _Source(cfg, f"artifact {artifact} (target {target}, compiled kernels)", make)
    if not args.model:
        problems.append("give a compiled artifact directory or --model DIR|PRESET")
        return None
    try:
        model = load_model(args.model, args.seed)
    except ValueError as e:
        problems.append(str(e))
        return None

    def make(rows, requests):
        def build(module, weights):
            return ReferenceRuntime(module, weights, max_rows=rows, max_requests=requests,
                                    compute_dtype=dtype, device=args.device)
        return parallel_runtime(getattr(args, "parallel", None), build_module(model.config), model.weights, build)

    return _Source(model.config, f"{model.source}, reference interpreter ({args.dtype}, {args.device})", make)


_POLICIES: list = []  # the running command's miss policies, reported when it ends (_say_tuning)


def _tuned_configs(art) -> dict:
    """The artifact's configs that `k31c tune` measured; its compile-time entries are the declared
    heuristics at representative shapes, which the store's records (and the miss policy) override."""
    return {b: c for b, c in art.configs.items() if art.config_sources.get(b) == "tuned"}


def default_miss_policy(target: str) -> str:
    """--miss-policy when not given: `readonly` for a GPU target (deployment: every config tuned or named as
    missing, issue 6), `fallback` for the CPU target (development and the demo)."""
    return "fallback" if target == "cpu" else "readonly"


def _miss_policy(args, artifact: str, target: str, module, weights, choices, dtype):
    """The MissPolicy of --miss-policy (default `default_miss_policy`) over --tuning-store (a `tune` policy
    tunes on this device)."""
    from autotune_cache import CacheStore, MissPolicy

    mode = args.miss_policy or default_miss_policy(target)
    tuner = None
    if mode == "tune":
        from autotune_cache.tuner import make_tuner

        tuner = make_tuner(module, weights, choices, target=target, device=args.device, compute_dtype=dtype,
                           study_db=os.path.join(artifact, "tuning", "studies.db"))
    store = CacheStore(args.tuning_store) if args.tuning_store else CacheStore()
    policy = MissPolicy(mode, store, target=target, artifact=artifact, tuner=tuner)
    _POLICIES.append(policy)
    return policy


def _say_tuning():
    """Where the kernel configs came from: records, heuristics (misses, with the command that tunes them)."""
    for pol in _POLICIES:
        st = pol.stats()
        hits, misses = sum(st["record_launches"].values()), st["config_misses"]
        line = (f"kernel configs: {hits} launches from {len(st['record_launches'])} tuning records in {st['store']}, "
                f"{sum(misses.values())} from declared heuristics ({len(misses)} buckets without a record)")
        if st["tuned"]:
            line += f", {len(st['tuned'])} buckets tuned now"
        if misses:
            line += f"; tune them: k31c tune {pol.artifact}"
        _say(line)


def _say_aot():
    """What the artifact's stored Triton binaries did (loaded, JIT fallbacks), when they were in use."""
    if "codegen.aot" in sys.modules:
        from codegen.aot import installed_summary

        line = installed_summary()
        if line:
            _say(line)


# ---- commands ----------------------------------------------------------------------------------
def cmd_logits(args) -> int:
    import torch
    from safetensors.torch import save_file

    problems: list[str] = []
    tokens = parse_token_list(args.tokens, "--tokens", problems)
    check_out_path(args.out, problems)
    if args.decode_from is not None and tokens and not 1 <= args.decode_from <= len(tokens):
        problems.append(f"--decode-from {args.decode_from} must be in 1..{len(tokens)} (number of prompt tokens)")
    src = _resolve_source(args, args.artifact, problems)
    if src is not None:
        check_tokens(tokens, src.config.vocab_size, "--tokens", problems)
    if problems:
        raise UsageError(problems)
    _say(f"k31c logits: {src.description}, {len(tokens)} tokens")
    rt = src.make_runtime(len(tokens), 1)
    rt.add_request("r", len(tokens))
    n = len(tokens) if args.decode_from is None else args.decode_from
    rows = [rt.prefill({"r": tokens[:n]})]
    rows += [rt.decode({"r": t}) for t in tokens[n:]]
    logits = torch.cat(rows).to("cpu", torch.float32).contiguous()
    save_file({"logits": logits}, args.out, metadata={"model": src.description, "tokens": ",".join(map(str, tokens)),
                                                      "decode_from": str(n)})
    _say(f"wrote {args.out}: logits fp32 {list(logits.shape)}")
    _say_tuning()
    _say_aot()
    return 0


def cmd_run(args) -> int:
    from .runtime.engine import Engine
    from .runtime.sampling import SamplingParams
    from .runtime.tokenizer import ByteTokenizer

    problems: list[str] = []
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.sample_seed,
                            max_new_tokens=args.max_new_tokens)
    problems += params.problems()
    for flag, v in (("--prefill-chunk", args.prefill_chunk), ("--max-num-seqs", args.max_num_seqs),
                    ("--max-batched-tokens", args.max_batched_tokens)):
        if v is not None and v <= 0:
            problems.append(f"{flag} must be positive, found {v}")
    src = _resolve_source(args, args.artifact, problems)
    tok = None
    if src is not None:
        try:
            tok = ByteTokenizer(src.config.vocab_size)
        except ValueError as e:
            problems.append(str(e))
    prompts: list[list[int]] = []
    if args.prompt_tokens is not None:
        prompts = [parse_token_list(args.prompt_tokens, "--prompt-tokens", problems)]
    elif args.prompts_file is not None:
        if not os.path.isfile(args.prompts_file):
            problems.append(f"--prompts-file {args.prompts_file}: no such file")
        else:
            lines = [ln.rstrip("\n") for ln in open(args.prompts_file, encoding="utf-8")]
            prompts = [tok.encode(ln) for ln in lines if ln] if tok else []
            if not any(lines):
                problems.append(f"--prompts-file {args.prompts_file} has no non-empty line")
    elif args.prompt is not None:
        if args.prompt == "":
            problems.append("--prompt is empty; give at least one character")
        elif tok:
            prompts = [tok.encode(args.prompt)]
    if src is not None:
        for i, p in enumerate(prompts):
            check_tokens(p, src.config.vocab_size, f"prompt {i}", problems)
    if problems:
        raise UsageError(problems)
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    _say(f"k31c run: {src.description}; {len(prompts)} prompt(s), up to {args.max_new_tokens} new tokens, "
         f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}, top-p {args.top_p}'}")
    seqs = min(len(prompts), args.max_num_seqs or len(prompts))
    rt = src.make_runtime(longest * seqs, seqs)
    async_decode = default_async_decode(args, rt) if args.async_decode is None else args.async_decode
    eng = Engine(rt, max_num_seqs=seqs, max_batched_tokens=args.max_batched_tokens, prefill_chunk=args.prefill_chunk,
                 prefix_caching=args.prefix_caching, tokenizer=tok, async_decode=async_decode)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                                    seed=args.sample_seed + i, max_new_tokens=args.max_new_tokens),
                        stop=args.stop)
    final = eng.run_to_completion()
    outs = [final[f"p{i}"].tokens for i in range(len(prompts))]
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt_tokens": p, "output_tokens": o, "text": tok.decode(o)}))
        else:
            print(f"{tok.decode(p)}\x1b[1m{tok.decode(o)}\x1b[0m" if sys.stdout.isatty() else tok.decode(p) + tok.decode(o))
            print(f"  tokens: {o}")
    st = eng.stats()
    _say(f"generated {sum(map(len, outs))} tokens in {dt:.2f} s ({st['steps']} engine steps, "
         f"{st['preemptions']} preemptions" + (f", prefix-cache hit rates {st['prefix_cache']['hit_rate']}"
                                                if "prefix_cache" in st else "") + ")")
    _say_tuning()
    _say_aot()
    return 0
