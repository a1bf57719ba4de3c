"""`k31c init-weights`: write a random, well-conditioned checkpoint in K3's on-disk layout.

The output is exactly what `load_checkpoint` reads (shared/CHECKPOINT.md): `config.json`,
`model.safetensors` or `model-0000i-of-0000N.safetensors` shards plus `model.safetensors.index.json`,
per-expert routed-expert tensors (bf16 `weight`, or MXFP4 `weight_packed` + `weight_scale`), conv
weights [P, 1, K] (or [P, K]), `A_log` padded to 128 under K3 names. Dtypes follow `ParamSpec.format`
(bf16, f32 where K3 stores f32). The values are drawn per `ParamSpec.init` so that a deep tiny model
stays numerically healthy; each tensor is seeded from (seed, canonical name), so files are byte
identical for the same seed and a tensor's values do not depend on which other tensors exist.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import torch

from .checkpoint import CONFIG_NAME, INDEX_NAME, K3_PREFIX, SINGLE_NAME, CheckpointError
from .config import ModelConfig
from .params import ParamSpec, param_specs

LINEAR_GAIN = 0.7  # linear ~ N(0, 1/in) * gain: keeps activations O(1) through the residual stream
K3_A_LOG_PAD = 128  # K3 stores A_log as f32 [128], the first `heads` values used
K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"  # top level of a nested (K3-style) config.json
K3_MODEL_TYPE = "kimi_k3"

_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def _generator(seed: int, name: str) -> torch.Generator:
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return torch.Generator().manual_seed((h ^ (int(seed) * 0x9E3779B97F4A7C15)) % (1 << 63))


def _draw(spec: ParamSpec, seed: int) -> torch.Tensor:
    """float32 values of one parameter at its logical shape (stacked experts: [E, out, in])."""
    g = _generator(seed, spec.name)
    shape = spec.shape
    init = spec.init
    if init == "linear":
        fan_in = shape[-1]
        return torch.randn(shape, generator=g) * (LINEAR_GAIN / math.sqrt(fan_in))
    if init == "embed":
        return torch.randn(shape, generator=g)
    if init == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if init == "zeros":
        return torch.zeros(shape)
    if init == "small":
        return 0.1 * torch.randn(shape, generator=g)
    if init == "a_log":  # A in [1, 16): decays exp(A)·... stay in a useful range
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=g))
    if init == "dt_bias":  # softplus(dt_bias) ~ U(1e-3, 1e-1) per channel
        dt = 1e-3 + (1e-1 - 1e-3) * torch.rand(shape, generator=g, dtype=torch.float64)
        return torch.log(torch.expm1(dt)).to(torch.float32)
    if init == "conv":
        return torch.randn(shape, generator=g) * (0.5 / math.sqrt(shape[-1]))
    raise ValueError(f"init_weights: unknown ParamSpec.init {init!r} for {spec.name}")


def _is_expert(spec: ParamSpec) -> bool:
    return spec.name.endswith((".experts.w1.weight", ".experts.w2.weight", ".experts.w3.weight"))


def _on_disk(spec: ParamSpec, seed: int, prefix: str, conv_shape: str) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs for one canonical parameter, in the on-disk layout."""
    values = _draw(spec, seed)
    if _is_expert(spec):
        base = prefix + spec.name[: -len("w1.weight")]  # "...experts."
        w = spec.name[-len("w1.weight"):-len(".weight")]
        out = []
        if spec.format == "mxfp4":
            from ir.formats import quantize_mxfp4

            packed, scales = quantize_mxfp4(values.to(torch.bfloat16))
            for e in range(spec.shape[0]):
                out.append((f"{base}{e}.{w}.weight_packed", packed[e].clone()))
                out.append((f"{base}{e}.{w}.weight_scale", scales[e].clone()))
        else:
            vb = values.to(_DTYPES[spec.format])
            for e in range(spec.shape[0]):
                out.append((f"{base}{e}.{w}.weight", vb[e].clone()))
        return out
    t = values.to(_DTYPES[spec.format])
    if spec.init == "conv" and conv_shape == "3d":
        P, K = spec.shape
        t = t.reshape(P, 1, K).contiguous()
    elif spec.init == "a_log" and prefix == K3_PREFIX:
        padded = torch.zeros(max(K3_A_LOG_PAD, spec.shape[0]), dtype=t.dtype)
        padded[: spec.shape[0]] = t
        t = padded
    return [(prefix + spec.name, t)]


def _shard_assignment(sizes: list[int], num_shards: int) -> list[int]:
    """Contiguous split of tensors (in order) into `num_shards` non-empty shards of similar bytes."""
    total = max(sum(sizes), 1)
    out, prev, cum, n = [], 0, 0, len(sizes)
    for i, s in enumerate(sizes):
        want = int(num_shards * (cum + s / 2) / total)
        idx = min(want, prev + 1, num_shards - 1)
        idx = max(idx, prev, num_shards - (n - i))  # leave one tensor for every later shard
        out.append(idx)
        prev, cum = idx, cum + s
    return out


def init_weights(cfg: ModelConfig, out_dir, seed: int = 0, prefix: str = "model.", conv_shape: str = "3d",
                 experts_format: str | None = None, num_shards: int = 1, nest_text_config: bool = False) -> Path:
    """Write a random checkpoint for `cfg` into `out_dir` (created if missing) and return its path.

    prefix: "model." (bare `model.*` / `lm_head.weight`, Kimi-Linear and our presets) or
    "language_model." (K3 names `language_model.model.*`, `language_model.lm_head.weight`; A_log
    padded to [128]). conv_shape: "3d" ([P, 1, K]) or "2d" ([P, K]). experts_format: None keeps
    `cfg.experts_format`, else "bf16" / "mxfp4". nest_text_config: write the model keys under
    `text_config` as K3 does. Stale `model*.safetensors` / index files in `out_dir` are removed.
    """
    if prefix in ("model.", ""):
        disk_prefix = ""
    elif prefix == K3_PREFIX:
        disk_prefix = K3_PREFIX
    else:
        raise ValueError(f"init_weights: prefix must be 'model.' or {K3_PREFIX!r}, found {prefix!r}")
    if conv_shape not in ("3d", "2d"):
        raise ValueError(f"init_weights: conv_shape must be '3d' ([P, 1, K]) or '2d' ([P, K]), found {conv_shape!r}")
    if int(num_shards) < 1:
        raise ValueError(f"init_weights: num_shards must be >= 1, found {num_shards}")
    if experts_format is not None and experts_format != cfg.experts_format:
        cfg = cfg.replace(experts_format=experts_format)
    cfg = cfg.validate(f"init-weights {cfg.name}")

    tensors: list[tuple[str, torch.Tensor]] = []
    for spec in param_specs(cfg):
        tensors += _on_disk(spec, seed, disk_prefix, conv_shape)
    if num_shards > len(tensors):
        raise ValueError(f"init_weights: {num_shards} shards for only {len(tensors)} tensors")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / SINGLE_NAME, out / INDEX_NAME, *out.glob("model-*-of-*.safetensors")]:
        if stale.is_file():
            stale.unlink()

    hf = cfg.to_hf()
    if nest_text_config:
        top = {"architectures": [K3_ARCHITECTURE], "model_type": K3_MODEL_TYPE, "torch_dtype": "bfloat16"}
        if "quantization_config" in hf:
            top["quantization_config"] = hf.pop("quantization_config")
        top["text_config"] = hf
        hf = top
    (out / CONFIG_NAME).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

    _write_weights(out, tensors, int(num_shards))
    return out


def _write_weights(out: Path, tensors: list[tuple[str, torch.Tensor]], num_shards: int) -> None:
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(dict(sorted(tensors)), str(out / SINGLE_NAME), metadata=metadata)
        return
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    assign = _shard_assignment(sizes, num_shards)
    weight_map: dict[str, str] = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = sorted((n, t) for (n, t), a in zip(tensors, assign) if a == k)
        save_file(dict(part), str(out / fname), metadata=metadata)
        weight_map.update((n, fname) for n, _ in part)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------- CLI

_EXAMPLE = """examples:
  k31c init-weights --preset k31-tiny -o /tmp/k31-tiny
  k31c init-weights --preset k31-tiny -o /tmp/k31-tiny-k3 --mxfp4 --k3-names --shards 3 --seed 1
"""


def add_init_weights_parser(subparsers) -> argparse.ArgumentParser:
    """Register `init-weights` on an argparse subparsers object; sets `func=run_init_weights`."""
    p = subparsers.add_parser(
        "init-weights", help="write a random checkpoint for a preset (K3 on-disk layout)",
        description="Write a random, well-conditioned safetensors checkpoint (config.json + weights) for a "
                    "built-in preset, in the on-disk layout `k31c` loads (shared/CHECKPOINT.md).",
        epilog=_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="preset name (see k31c.model.presets), e.g. k31-tiny")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory (its parent must exist)")
    p.add_argument("--mxfp4", action="store_true", help="store routed experts as MXFP4 (weight_packed/weight_scale)")
    p.add_argument("--k3-names", action="store_true",
                   help="K3 names (language_model.model.*), A_log padded to 128, config nested under text_config")
    p.add_argument("--shards", type=int, default=1, metavar="N", help="number of safetensors shards (default 1)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--force", action="store_true", help="write into an existing non-empty directory")
    p.set_defaults(func=run_init_weights)
    return p


def run_init_weights(args) -> int:
    from .presets import get_preset

    cfg = get_preset(args.preset)
    out = Path(args.out)
    problems = []
    parent = out.absolute().parent
    if not parent.is_dir():
        problems.append(f"-o {out}: parent directory {parent} does not exist (create it first)")
    elif out.exists() and not out.is_dir():
        problems.append(f"-o {out}: exists and is not a directory")
    elif out.is_dir() and any(out.iterdir()) and not getattr(args, "force", False):
        problems.append(f"-o {out}: directory exists and is not empty (pass --force to write into it)")
    if getattr(args, "shards", 1) < 1:
        problems.append(f"--shards must be >= 1, found {args.shards}")
    if problems:
        raise CheckpointError(problems, "init-weights")
    path = init_weights(cfg, out, seed=args.seed, prefix=K3_PREFIX if args.k3_names else "model.",
                        experts_format="mxfp4" if args.mxfp4 else None, num_shards=args.shards,
                        nest_text_config=bool(args.k3_names))
    fmt = "mxfp4" if args.mxfp4 else cfg.experts_format
    print(f"wrote {args.preset} checkpoint (seed {args.seed}, experts {fmt}, {args.shards} shard(s)) to {path}")
    return 0


__all__ = ["init_weights", "add_init_weights_parser", "run_init_weights"]


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict:
    """The canonical weights `load_checkpoint(init_weights(cfg, dir, seed))` would return, built in
    memory (same values, same storage dtypes; MXFP4 experts as `PackedMXFP4`)."""
    from ir.formats import quantize_mxfp4
    from ir.packed import PackedMXFP4

    out: dict = {}
    for spec in param_specs(cfg):
        values = _draw(spec, seed)
        if spec.format == "mxfp4":
            out[spec.name] = PackedMXFP4(*quantize_mxfp4(values.to(torch.bfloat16)))
        else:
            out[spec.name] = values.to(_DTYPES[spec.format])
    return out
