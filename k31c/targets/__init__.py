"""Hardware targets (DESIGN §5 T13): what the planner and codegen know about a device.

    get_target("gb300")             # a built-in entry of `database.TARGET_SPECS`
    get_target("my-npu.json")       # a user's target: one JSON object with the keys below
    load_target_file("my-npu.json")

A target's keys (the same for built-in dicts and user JSON files; units bytes, bytes/s, FLOP/s dense):

| key | type | meaning |
|---|---|---|
| name | str | short id (`--target NAME`); a JSON file without it takes its file stem |
| vendor, description, source | str | who makes it, what it is, where the figures come from |
| memory_bytes | int > 0 | device memory (HBM) visible to programs |
| hbm_bandwidth | number > 0 | device memory bandwidth |
| compute_units | int > 0 or null | SMs / CUs / cores (null: not published) |
| compute_unit_kind | str | "SM", "CU", "TensorCore", "core" |
| peak_flops | {format: number} | dense peak per format; formats fp32, bf16, fp8, mxfp4, nvfp4; bf16 required |
| native_formats | [str] | subset of fp8, mxfp4, nvfp4 the matrix units take directly |
| link_bandwidth | number > 0 | scale-up interconnect, per device and per direction |
| scaleup_size | int > 0 | devices in one scale-up (NVLink / Infinity Fabric / ICI) domain |
| topology | str | the scale-up fabric in words |
| backends | [str] | triton-nvidia:sm_XX, triton-amd:gfxNNN, tvm:cuda/rocm/llvm, triton-interpreter; [] = plan only |
| core_kinds (optional) | {str: int} | kinds of cores, e.g. TPU {"TensorCore": 2, "SparseCore": 4} |
| device_names (optional) | [str] | substrings of the live device name (`torch.cuda.get_device_name`) |
| measured (optional) | {key: number} | figures measured on a real machine: hbm_bandwidth or a format's rate |
| estimates (optional) | [str] | keys (e.g. "peak_flops.fp8") whose figures are estimates |
| emulates_all_formats (optional) | bool | every format is emulated exactly (the CPU reference) |
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field

from .database import TARGET_SPECS

FORMATS = ("fp8", "mxfp4", "nvfp4")  # low-precision formats a target may take natively
RATE_FORMATS = ("fp32", "bf16", "fp8", "mxfp4", "nvfp4")
_BACKEND_RE = re.compile(r"^(triton-nvidia:sm_\d+a?|triton-amd:gfx[0-9a-f]+|tvm:(cuda|rocm|llvm)|triton-interpreter)$")


class TargetError(ValueError):
    """A target that cannot be used; the message lists every problem found."""

    def __init__(self, problems: list[str], source: str = "--target"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}" if len(problems) > 1
                         else f"{source}: {problems[0]}")


@dataclass(frozen=True)
class Target:
    name: str
    vendor: str
    description: str
    source: str
    memory_bytes: int
    hbm_bandwidth: float
    compute_units: int | None
    compute_unit_kind: str
    peak_flops: dict
    native_formats: tuple
    link_bandwidth: float
    scaleup_size: int
    topology: str
    backends: tuple
    core_kinds: dict = field(default_factory=dict)
    device_names: tuple = ()
    measured: dict = field(default_factory=dict)
    estimates: tuple = ()
    emulates_all_formats: bool = False

    @property
    def plan_only(self) -> bool:
        """No kernel backend: the planner works, nothing is compiled."""
        return not self.backends

    @property
    def needs_gpu(self) -> bool:
        return any(b.startswith(("triton-nvidia", "triton-amd", "tvm:cuda", "tvm:rocm")) for b in self.backends) \
            or (not self.backends and self.name != "cpu")

    def is_native(self, fmt: str) -> bool:
        return fmt in self.native_formats

    def can_run(self, fmt: str) -> bool:
        """bf16/f32 run everywhere; a low-precision format natively or where everything is emulated."""
        return fmt in ("bf16", "f32", "fp32") or self.is_native(fmt) or self.emulates_all_formats

    def rate(self, fmt: str) -> float:
        """FLOP/s used by the cost model: measured if known, else the datasheet peak; a format
        without its own rate runs at the bf16 rate (dequantised)."""
        for key in (fmt, "bf16"):
            if key in self.measured:
                return float(self.measured[key])
            if key in self.peak_flops and (key == "bf16" or self.is_native(key) or key == "fp32"):
                return float(self.peak_flops[key])
        return float(self.peak_flops["bf16"])

    @property
    def bandwidth(self) -> float:
        """Memory bandwidth used by the cost model: measured if known, else the datasheet figure."""
        return float(self.measured.get("hbm_bandwidth", self.hbm_bandwidth))

    def backend_summary(self) -> str:
        return ", ".join(self.backends) if self.backends else f"none (plan only: no kernel backend for {self.name})"

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("native_formats", "backends", "device_names", "estimates"):
            d[k] = list(d[k])
        return d


_REQUIRED = {"vendor": str, "description": str, "memory_bytes": (int, float), "hbm_bandwidth": (int, float),
             "compute_units": (int, type(None)), "compute_unit_kind": str, "peak_flops": dict,
             "native_formats": list, "link_bandwidth": (int, float), "scaleup_size": int, "topology": str,
             "backends": list}
_OPTIONAL = {"name": str, "source": str, "core_kinds": dict, "device_names": list, "measured": dict,
             "estimates": list, "emulates_all_formats": bool}


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def target_from_dict(raw, name: str | None = None, source: str = "target") -> Target:
    """Validate one target dict (built-in or user JSON) and build it; every problem is reported."""
    if not isinstance(raw, dict):
        raise TargetError([f"a target must be a JSON object, found {type(raw).__name__}"], source)
    p: list[str] = []
    for k in sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL)):
        p.append(f"unknown key {k!r} (known keys: {', '.join(sorted([*_REQUIRED, *_OPTIONAL]))})")
    for k, kinds in _REQUIRED.items():
        if k not in raw:
            p.append(f"missing key {k!r}")
    for k, kinds in {**_REQUIRED, **_OPTIONAL}.items():
        if k in raw and (not isinstance(raw[k], kinds) or (isinstance(raw[k], bool) and kinds in (int, (int, float)))):
            want = "/".join(t.__name__ for t in (kinds if isinstance(kinds, tuple) else (kinds,)))
            p.append(f"key {k!r} must be {want}, found {raw[k]!r}")
    if p:
        raise TargetError(p, source)
    for k in ("memory_bytes", "hbm_bandwidth", "link_bandwidth", "scaleup_size"):
        if not _positive(raw[k]):
            p.append(f"{k} must be positive, found {raw[k]!r}")
    if raw["compute_units"] is not None and not _positive(raw["compute_units"]):
        p.append(f"compute_units must be a positive integer or null, found {raw['compute_units']!r}")
    for f, v in raw["peak_flops"].items():
        if f not in RATE_FORMATS:
            p.append(f"peak_flops: unknown format {f!r} (formats: {', '.join(RATE_FORMATS)})")
        elif not _positive(v):
            p.append(f"peak_flops.{f} must be a positive number, found {v!r}")
    if "bf16" not in raw["peak_flops"]:
        p.append("peak_flops needs a 'bf16' rate (the rate of everything not native)")
    for f in raw["native_formats"]:
        if f not in FORMATS:
            p.append(f"native_formats: {f!r} is not one of {', '.join(FORMATS)}")
        elif f not in raw["peak_flops"]:
            p.append(f"native format {f} has no peak_flops.{f} rate")
    for b in raw["backends"]:
        if not isinstance(b, str) or not _BACKEND_RE.match(b):
            p.append(f"backends: {b!r} is not triton-nvidia:sm_XX, triton-amd:gfxNNN, tvm:cuda|rocm|llvm "
                     f"or triton-interpreter")
    for k, v in raw.get("measured", {}).items():
        if k not in ("hbm_bandwidth", *RATE_FORMATS):
            p.append(f"measured: unknown key {k!r} (hbm_bandwidth or a format: {', '.join(RATE_FORMATS)})")
        elif not _positive(v):
            p.append(f"measured.{k} must be a positive number, found {v!r}")
    for k, v in raw.get("core_kinds", {}).items():
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            p.append(f"core_kinds.{k} must be a positive integer, found {v!r}")
    known_keys = {*_REQUIRED, *_OPTIONAL} | {f"peak_flops.{f}" for f in RATE_FORMATS}
    for k in raw.get("estimates", []):
        if k not in known_keys:
            p.append(f"estimates: {k!r} names no target key")
    tname = raw.get("name", name)
    if not tname or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(tname)):
        p.append(f"name {tname!r} must be a short id (letters, digits, - _ .)")
    if p:
        raise TargetError(p, source)
    return Target(
        name=str(tname), vendor=raw["vendor"], description=raw["description"], source=raw.get("source", source),
        memory_bytes=int(raw["memory_bytes"]), hbm_bandwidth=float(raw["hbm_bandwidth"]),
        compute_units=raw["compute_units"], compute_unit_kind=raw["compute_unit_kind"],
        peak_flops={k: float(v) for k, v in sorted(raw["peak_flops"].items())},
        native_formats=tuple(raw["native_formats"]), link_bandwidth=float(raw["link_bandwidth"]),
        scaleup_size=raw["scaleup_size"], topology=raw["topology"], backends=tuple(raw["backends"]),
        core_kinds=dict(sorted(raw.get("core_kinds", {}).items())), device_names=tuple(raw.get("device_names", ())),
        measured={k: float(v) for k, v in sorted(raw.get("measured", {}).items())},
        estimates=tuple(raw.get("estimates", ())), emulates_all_formats=bool(raw.get("emulates_all_formats", False)))


TARGETS: dict[str, Target] = {n: target_from_dict(spec, n, f"built-in target {n}") for n, spec in TARGET_SPECS.items()}


def known_targets() -> list[str]:
    return sorted(TARGETS)


def load_target_file(path: str) -> Target:
    if not os.path.isfile(path):
        raise TargetError([f"target file {path} does not exist"], "--target-file")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise TargetError([f"{path} is not valid JSON: {e}"], "--target-file") from None
    stem = os.path.splitext(os.path.basename(path))[0]
    return target_from_dict(raw, stem, f"target file {path}")


def get_target(spec: str) -> Target:
    """A built-in target by name, or a user target from a `.json` path."""
    if spec in TARGETS:
        return TARGETS[spec]
    if spec.endswith(".json") or os.path.sep in spec or os.path.isfile(spec):
        return load_target_file(spec)
    raise TargetError([f"unknown target {spec!r}; known targets: {', '.join(known_targets())} "
                       f"(or give a JSON file: --target-file my-target.json)"])


__all__ = ["FORMATS", "TARGETS", "Target", "TargetError", "get_target", "known_targets", "load_target_file",
           "target_from_dict"]
