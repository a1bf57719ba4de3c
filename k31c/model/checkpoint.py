"""Checkpoint loader: a Hugging Face style safetensors directory -> canonical parameters (SPEC §8).

`load_checkpoint(path)` reads `config.json` (K3 `text_config` nesting or flat Kimi-Linear keys) and the
safetensors weights (`model.safetensors`, or shards listed by `model.safetensors.index.json`), and
returns exactly the parameters of `param_specs(config)` under their canonical names (see
`k31c/model/params.py`): per-expert tensors stacked to [E, out, in], MXFP4 experts kept packed as
`PackedMXFP4`, conv weights as [P, K], `A_log` as [H].

Safety: only safetensors are read, each shard is opened once with `safetensors.safe_open`; nothing in
the checkpoint directory is ever executed or unpickled (no `trust_remote_code`, no `torch.load`).

Every problem found (missing / mis-shaped / unknown tensors, bad index, bad config, ...) is collected
and raised together as one `CheckpointError`. Shapes are checked from the safetensors headers before
any tensor data is read, so a broken checkpoint fails fast and a good one reads each tensor once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ir.packed import PackedMXFP4

from .config import ConfigError, ModelConfig
from .params import ParamSpec, param_specs

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
K3_PREFIX = "language_model."  # K3: language_model.model.* / language_model.lm_head.weight
BARE_PREFIX = ""  # Kimi-Linear and our presets: model.* / lm_head.weight
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Sub-modules of a multimodal checkpoint that live under `model.` in some layouts but are not text.
_NON_TEXT_UNDER_MODEL = ("model.vision_tower.", "model.vision_model.", "model.visual.", "model.mm_projector.",
                         "model.multi_modal_projector.", "model.audio_tower.")
_MAX_LISTED = 10  # unknown tensors listed by name in one problem line
_MAX_MESSAGE_LINES = 200  # problems shown in the exception message (all kept in .problems)

_EXPERT_RE = re.compile(r"^(?P<layer>.*\.experts\.)(?P<e>\d+)\.(?P<w>w[123])\."
                        r"(?P<kind>weight|weight_packed|weight_scale|weight_blocks|weight_scales)$")

_ST_FLOAT = {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message lists every problem found."""

    def __init__(self, problems: list[str], source: str = "checkpoint"):
        self.problems = list(problems)
        self.source = source
        shown = problems[:_MAX_MESSAGE_LINES]
        lines = "\n".join(f"  - {p}" for p in shown)
        if len(problems) > len(shown):
            lines += f"\n  ... and {len(problems) - len(shown)} more problem(s)"
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


@dataclass
class LoadedCheckpoint:
    config: ModelConfig  # corrected to the experts format actually stored
    weights: dict  # canonical name -> torch.Tensor | PackedMXFP4, exactly param_specs(config)
    path: Path
    ignored: int = 0  # tensors outside the text model (vision tower, projector, ...)
    prefix: str = BARE_PREFIX  # detected text-model prefix: "" (bare model./lm_head.) or "language_model."
    files: tuple[str, ...] = ()  # safetensors files read, relative to path
    notes: list[str] = field(default_factory=list)  # non-fatal corrections (e.g. experts_format)


# ------------------------------------------------------------------------------------ helpers

def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _ranges(ids: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2, 5, 7-8'."""
    out, start, prev = [], None, None
    for i in sorted(ids):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(out)


def _is_float_dtype(st_dtype: str) -> bool:
    return st_dtype in _ST_FLOAT


def _discover_files(root: Path, problems: list[str]) -> tuple[list[str], dict[str, str] | None]:
    """Safetensors files to read (relative names) and the index's weight_map (None without index)."""
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{index_path}: cannot read the shard index: {e}")
            return [], None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            problems.append(f"{index_path}: expected an object with a 'weight_map' of tensor name -> file name")
            return [], None
        files = sorted(set(wm.values()))
        present = []
        for f in files:
            if (root / f).is_file():
                present.append(f)
            else:
                n = sum(1 for v in wm.values() if v == f)
                problems.append(f"{index_path} maps {n} tensor(s) to shard file {f!r}, which does not exist "
                                f"in {root}")
        return present, wm
    if (root / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None
    found = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    if found:
        return found, None
    pickles = sorted(p.name for p in root.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        listed = ", ".join(pickles[:5]) + (", ..." if len(pickles) > 5 else "")
        problems.append(f"{root} holds only pickle weights ({listed}); k31c never unpickles checkpoint code "
                        f"(a pickle can run arbitrary code) -- convert the checkpoint to safetensors "
                        f"(e.g. with transformers' save_pretrained(..., safe_serialization=True)) and retry")
    else:
        problems.append(f"{root}: no weights found (expected {SINGLE_NAME}, or shards listed in {INDEX_NAME})")
    return [], None


def _read_config(root: Path, problems: list[str]) -> ModelConfig | None:
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        problems.append(f"{root}: missing {CONFIG_NAME} (an HF-style checkpoint directory needs it)")
        return None
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        problems.append(f"{cfg_path}: invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})")
        return None
    except (OSError, UnicodeDecodeError) as e:
        problems.append(f"{cfg_path}: cannot read: {e}")
        return None
    try:
        return ModelConfig.from_hf(raw, source=str(cfg_path), name=root.name)
    except ConfigError as e:
        problems += [f"{cfg_path}: {p}" for p in e.problems]
        return None


def _classify(name: str) -> str | None:
    """'k3' / 'bare' for text-model tensor names, None for everything else (vision, projector, ...)."""
    if name.startswith(K3_PREFIX):
        return "k3"
    if name.startswith("lm_head.") or (name.startswith("model.") and not name.startswith(_NON_TEXT_UNDER_MODEL)):
        return "bare"
    return None


# --------------------------------------------------------------------------------------- plan

@dataclass
class _Src:
    """One tensor to read: checkpoint name and file."""
    name: str
    file: str


@dataclass
class _Plan:
    spec: ParamSpec
    kind: str  # plain | conv | a_log | experts_plain | experts_packed
    srcs: list  # plain: [_Src]; experts_plain: [_Src per e]; experts_packed: [(layout, packed/blocks, scale)]


def load_checkpoint(path, dtype: torch.dtype | None = None) -> LoadedCheckpoint:
    """Load an HF-style safetensors checkpoint directory into canonical k31c parameters.

    `dtype`: when given, floating tensors are cast to it (packed MXFP4 experts stay packed); otherwise
    the stored dtypes (bf16 / f32 / u8) are kept. Raises `CheckpointError` listing every problem.
    """
    from safetensors import safe_open

    root = Path(path)
    if not root.exists():
        raise CheckpointError([f"checkpoint directory {root} does not exist"], str(root))
    if not root.is_dir():
        raise CheckpointError([f"{root} is not a directory (expected an HF-style checkpoint directory with "
                               f"{CONFIG_NAME} and safetensors weights)"], str(root))
    problems: list[str] = []
    config = _read_config(root, problems)
    files, weight_map = _discover_files(root, problems)

    # ---- open every shard once, learn where each tensor lives (header only) -----------------
    handles: dict[str, object] = {}
    location: dict[str, str] = {}
    try:
        for f in files:
            try:
                h = safe_open(str(root / f), framework="pt")
                handles[f] = h.__enter__() if hasattr(h, "__enter__") else h
            except Exception as e:  # corrupt header, not a safetensors file, ...
                problems.append(f"{root / f}: not a readable safetensors file: {e}")
                continue
            for k in handles[f].keys():
                if k in location:
                    problems.append(f"tensor {k!r} is stored twice, in {location[k]} and {f}")
                else:
                    location[k] = f
        if config is None or not handles:
            raise CheckpointError(problems, str(root))
        return _load(root, config, files, weight_map, handles, location, problems, dtype)
    finally:
        for h in handles.values():
            if hasattr(h, "__exit__"):
                try:
                    h.__exit__(None, None, None)
                except Exception:
                    pass


def _load(root, config, files, weight_map, handles, location, problems, dtype) -> LoadedCheckpoint:
    notes: list[str] = []
    # ---- text prefix -----------------------------------------------------------------------
    groups: dict[str, list[str]] = {"k3": [], "bare": []}
    ignored = 0
    for k in location:
        c = _classify(k)
        if c is None:
            ignored += 1
        else:
            groups[c].append(k)
    mixed = bool(groups["k3"] and groups["bare"])
    if mixed:
        ex_k3, ex_bare = sorted(groups["k3"])[0], sorted(groups["bare"])[0]
        problems.append(f"checkpoint mixes text-model prefixes: {len(groups['k3'])} tensor(s) under "
                        f"'language_model.' (e.g. {ex_k3!r}) and {len(groups['bare'])} under bare "
                        f"'model.'/'lm_head.' (e.g. {ex_bare!r}); use one of them")
    if not groups["k3"] and not groups["bare"]:
        problems.append(f"{root}: no text-model tensors (expected names under 'model.' / 'lm_head.' or "
                        f"'language_model.model.' / 'language_model.lm_head.'); {ignored} other tensor(s) found")
        raise CheckpointError(problems, str(root))
    prefix = K3_PREFIX if len(groups["k3"]) >= len(groups["bare"]) else BARE_PREFIX
    text_names = set(groups["k3"]) | set(groups["bare"])

    # ---- experts format: decided by what is stored (.weight_packed / .weight_blocks) ---------
    has_packed = has_plain = False
    for k in text_names:
        m = _EXPERT_RE.match(k)
        if m:
            if m["kind"] in ("weight_packed", "weight_blocks"):
                has_packed = True
            elif m["kind"] == "weight":
                has_plain = True
    found_fmt = "mxfp4" if has_packed else ("bf16" if has_plain else config.experts_format)
    if found_fmt != config.experts_format:
        notes.append(f"config says experts_format={config.experts_format!r} but the checkpoint stores "
                     f"{found_fmt!r} routed experts; using {found_fmt!r}")
        config = config.replace(experts_format=found_fmt)
        cfg_problems = config.problems()
        if cfg_problems:
            problems += [f"{root / CONFIG_NAME} (with the stored experts_format={found_fmt!r}): {p}"
                         for p in cfg_problems]
            raise CheckpointError(problems, str(root))

    # ---- plan: match every canonical parameter against the headers -------------------------
    m = _Matcher(root, files, weight_map, handles, location, text_names, prefix, mixed, problems)
    plans = [m.plan(spec) for spec in param_specs(config)]

    unknown = sorted(text_names - m.used)
    if unknown:
        shown = ", ".join(f"{n!r} ({location[n]})" for n in unknown[:_MAX_LISTED])
        more = f", ... and {len(unknown) - _MAX_LISTED} more" if len(unknown) > _MAX_LISTED else ""
        problems.append(f"{len(unknown)} tensor(s) under the text-model prefix match no parameter of "
                        f"{config.name!r} (misnamed, or a config that does not match the weights): {shown}{more}")
    if weight_map is not None:
        stale = sorted(n for n, f in weight_map.items()
                       if (root / f).is_file() and n not in location and n not in m.reported)
        if stale:
            shown = ", ".join(f"{n!r} -> {weight_map[n]}" for n in stale[:_MAX_LISTED])
            more = f", ... and {len(stale) - _MAX_LISTED} more" if len(stale) > _MAX_LISTED else ""
            problems.append(f"{INDEX_NAME} lists {len(stale)} tensor(s) that their shard does not hold: "
                            f"{shown}{more}")
    if problems:
        raise CheckpointError(problems, str(root))

    # ---- read: each tensor once --------------------------------------------------------------
    weights: dict = {}
    for plan in plans:
        weights[plan.spec.name] = _materialise(plan, handles, dtype)
    return LoadedCheckpoint(config=config, weights=weights, path=root, ignored=ignored, prefix=prefix,
                            files=tuple(files), notes=notes)


class _Matcher:
    """Matches canonical parameters to checkpoint tensors by header (shape/dtype), collecting problems."""

    def __init__(self, root, files, weight_map, handles, location, text_names, prefix, mixed, problems):
        self.root, self.files, self.weight_map = root, files, weight_map
        self.handles, self.location, self.text_names = handles, location, text_names
        self.prefix, self.mixed, self.problems = prefix, mixed, problems
        self.used: set[str] = set()
        self.reported: set[str] = set()  # checkpoint names already reported missing

    # -- header access
    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.location[name]].get_slice(name).get_shape())

    def st_dtype(self, name: str) -> str:
        return self.handles[self.location[name]].get_slice(name).get_dtype()

    def src(self, name: str) -> _Src:
        return _Src(name, self.location[name])

    def take(self, canonical: str) -> str | None:
        """Checkpoint key holding `canonical` under the detected prefix (or, in a checkpoint that mixes
        prefixes, under the other one: that is reported once as the mixing problem), else None."""
        candidates = [self.prefix + canonical]
        if self.mixed:
            other = BARE_PREFIX if self.prefix == K3_PREFIX else K3_PREFIX
            candidates.append(other + canonical)
        for key in candidates:
            if key in self.text_names:
                self.used.add(key)
                return key
        return None

    # -- problems
    def where_missing(self, name: str) -> str:
        self.reported.add(name)
        wm = self.weight_map
        if wm is not None and name in wm:
            f = wm[name]
            if (self.root / f).is_file():
                return f"expected in {f} (per {INDEX_NAME}), which lacks it"
            return f"expected in {f} (per {INDEX_NAME}), which is missing"
        files = self.files
        searched = ", ".join(files) if len(files) <= 8 else f"{', '.join(files[:8])}, ... ({len(files)} files)"
        extra = f"not listed in {INDEX_NAME}; " if wm is not None else ""
        return f"{extra}searched {searched}"

    def missing(self, canonical: str, what: str = "") -> None:
        name = self.prefix + canonical
        self.problems.append(f"missing tensor {name!r}{what}: {self.where_missing(name)}")

    def bad_shape(self, name: str, expected: str, found) -> None:
        self.problems.append(f"tensor {name!r} in {self.location[name]} has shape {_fmt_shape(found)}, "
                             f"expected {expected}")

    def bad_dtype(self, name: str, expected: str, found: str) -> None:
        self.problems.append(f"tensor {name!r} in {self.location[name]} has dtype {found}, expected {expected}")

    def check(self, name: str, expected_shape, packed: bool) -> bool:
        ok = True
        st = self.st_dtype(name)
        if packed and st != "U8":
            self.bad_dtype(name, "U8 (packed MXFP4)", st)
            ok = False
        elif not packed and not _is_float_dtype(st):
            self.bad_dtype(name, "a floating dtype (bf16/f32)", st)
            ok = False
        shape = self.shape(name)
        if shape != tuple(expected_shape):
            self.bad_shape(name, _fmt_shape(expected_shape), shape)
            ok = False
        return ok

    # -- one parameter
    def plan(self, spec: ParamSpec) -> _Plan | None:
        if spec.name.endswith((".experts.w1.weight", ".experts.w2.weight", ".experts.w3.weight")):
            return self.plan_experts(spec)
        name = self.take(spec.name)
        if name is None:
            self.missing(spec.name, f" (parameter {spec.name})" if self.prefix else "")
            return None
        shape = self.shape(name)
        if spec.init == "conv":
            P, K = spec.shape
            if shape not in ((P, K), (P, 1, K)):
                self.bad_shape(name, f"{_fmt_shape((P, 1, K))} or {_fmt_shape((P, K))}", shape)
                return None
            return _Plan(spec, "conv", [self.src(name)]) if self.check(name, shape, False) else None
        if spec.init == "a_log":
            (H,) = spec.shape
            if not ((len(shape) == 1 and shape[0] >= H) or shape == (1, 1, H, 1)):
                self.bad_shape(name, f"{_fmt_shape((H,))} (or zero-padded [N>={H}] as in K3, or "
                                     f"{_fmt_shape((1, 1, H, 1))} as in Kimi-Linear)", shape)
                return None
            return _Plan(spec, "a_log", [self.src(name)]) if self.check(name, shape, False) else None
        return _Plan(spec, "plain", [self.src(name)]) if self.check(name, spec.shape, False) else None

    def plan_experts(self, spec: ParamSpec) -> _Plan:
        """Per-expert tensors `...experts.{e}.wN.*` -> one stacked parameter [E, out, in]."""
        E, out_f, in_f = spec.shape
        base = spec.name[: -len("w1.weight")]  # canonical "...experts."
        w = spec.name[-len("w1.weight"):-len(".weight")]
        srcs: list = []
        absent: list[int] = []
        for e in range(E):
            stem = f"{base}{e}.{w}."
            if spec.format != "mxfp4":
                name = self.take(stem + "weight")
                if name is None:
                    absent.append(e)
                elif self.check(name, (out_f, in_f), packed=False):
                    srcs.append(self.src(name))
                continue
            for layout, data, scale, data_shape in (
                    ("compressed", "weight_packed", "weight_scale", (out_f, in_f // 2)),
                    ("gptoss", "weight_blocks", "weight_scales", (out_f, in_f // 32, 16))):
                dname = self.take(stem + data)
                if dname is None:
                    continue
                sname = self.take(stem + scale)
                if sname is None:
                    self.missing(stem + scale, f" (scales of {dname!r} in {self.location[dname]})")
                    break
                ok = self.check(dname, data_shape, packed=True)
                ok = self.check(sname, (out_f, in_f // 32), packed=True) and ok
                if ok:
                    srcs.append((layout, self.src(dname), self.src(sname)))
                break
            else:
                absent.append(e)
                # the scales are implied by the missing data tensor; don't report them again
                self.reported.update(self.prefix + stem + x for x in ("weight_scale", "weight_scales"))
        if absent:
            suffix = "weight_packed" if spec.format == "mxfp4" else "weight"
            names = [f"{self.prefix}{base}{e}.{w}.{suffix}" for e in absent]
            self.reported.update(names)
            if len(absent) <= 3:
                for e, n in zip(absent, names):
                    self.problems.append(f"missing tensor {n!r} (expert {e} of parameter {spec.name}): "
                                         f"{self.where_missing(n)}")
            else:
                self.problems.append(
                    f"missing tensor {names[0]!r} and the same tensor of {len(absent) - 1} more expert(s) "
                    f"(experts {_ranges(absent)} of parameter {spec.name}): {self.where_missing(names[0])}")
        return _Plan(spec, "experts_packed" if spec.format == "mxfp4" else "experts_plain", srcs)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def _materialise(plan: _Plan, handles, dtype):
    spec = plan.spec
    if plan.kind == "plain":
        (s,) = plan.srcs
        return _cast(handles[s.file].get_tensor(s.name), dtype)
    if plan.kind == "conv":
        (s,) = plan.srcs
        return _cast(handles[s.file].get_tensor(s.name).reshape(spec.shape).contiguous(), dtype)
    if plan.kind == "a_log":
        (s,) = plan.srcs
        t = handles[s.file].get_tensor(s.name).reshape(-1)[: spec.shape[0]].clone()
        return _cast(t, dtype)
    if plan.kind == "experts_plain":
        first = handles[plan.srcs[0].file].get_tensor(plan.srcs[0].name)
        out = torch.empty(spec.shape, dtype=dtype if dtype is not None else first.dtype)
        out[0].copy_(first)
        for e, s in enumerate(plan.srcs[1:], start=1):
            out[e].copy_(handles[s.file].get_tensor(s.name))
        return out
    if plan.kind == "experts_packed":
        from ir.formats import gptoss_to_compressed

        E, out_f, in_f = spec.shape
        packed = torch.empty((E, out_f, in_f // 2), dtype=torch.uint8)
        scales = torch.empty((E, out_f, in_f // 32), dtype=torch.uint8)
        for e, (layout, a, b) in enumerate(plan.srcs):
            ta = handles[a.file].get_tensor(a.name)
            tb = handles[b.file].get_tensor(b.name)
            if layout == "gptoss":
                ta, tb = gptoss_to_compressed(ta, tb)
            packed[e].copy_(ta)
            scales[e].copy_(tb)
        return PackedMXFP4(packed, scales)
    raise AssertionError(plan.kind)


def checkpoint_name(canonical: str, prefix: str = BARE_PREFIX) -> str:
    """On-disk name of a non-expert canonical parameter under a text prefix ("" or "language_model.")."""
    return prefix + canonical


__all__ = ["CheckpointError", "LoadedCheckpoint", "load_checkpoint", "checkpoint_name",
           "INDEX_NAME", "SINGLE_NAME", "CONFIG_NAME", "K3_PREFIX", "BARE_PREFIX"]
