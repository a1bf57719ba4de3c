"""Compiled-artifact manifest: write it, and load + validate an artifact against the live machine.

Artifact directory (written by `k31c compile`, DESIGN §7):

    manifest.json              this module's manifest (below)
    plan.json                  `k31c.plan.make_plan` output (per-rank memory, capacity, traffic)
    ir/NNN_<pass>.ir           the text IR after each pass
    kernels/*.py               kernel sources; kernels/configs.json: {kernel_name: {family, op, config, ...}}
    report.txt                 the human-readable report

`manifest.json` keys: schema_version, k31c_version, model {name, config_digest, source}, target
{name, description, device_names, backends, needs_gpu, plan_only}, layout {tp, dcp, ep, dcp_interleave}, options
(free-form JSON from the compiler), passes [names in order], toolchain {python, k31c, torch, triton,
tvm (when installed), cuda (when torch has it)}, files {relative path: sha256} for every file except
manifest.json itself and Python byte-code caches (`__pycache__/`, `*.pyc`, written when kernels are
imported). The JSON is written with sorted keys and no timestamps: identical inputs on the same
toolchain give byte-identical manifests.

`load(dir, check_live=True)` checks the schema, every file's hash (missing, modified, unlisted),
plan.json against the manifest, and — with check_live — the live device against the target (GPU
present, device name, enough devices for the layout) and the toolchain versions (python major.minor,
the others exactly). Every mismatch is collected; one `ArtifactError` lists them all.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from dataclasses import dataclass

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_REQUIRED_KEYS = ("schema_version", "k31c_version", "model", "target", "layout", "passes", "toolchain", "files")


class ArtifactError(ValueError):
    """An artifact that cannot be used here; the message lists every problem found."""

    def __init__(self, problems: list[str], path: str = "artifact"):
        self.problems = list(problems)
        super().__init__(f"{path}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Artifact:
    path: str
    manifest: dict
    plan: dict | None
    kernel_configs: dict | None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def toolchain_versions() -> dict:
    """Versions that change what an artifact's kernels do; absent tools are left out."""
    out = {"python": platform.python_version(), "k31c": _dist_version("k31c") or "unknown"}
    for key, dist in (("torch", "torch"), ("triton", "triton"), ("tvm", "apache-tvm")):
        v = _dist_version(dist)
        if v is not None:
            out[key] = v
    try:
        import torch

        if torch.version.cuda:
            out["cuda"] = torch.version.cuda
        if getattr(torch.version, "hip", None):
            out["hip"] = torch.version.hip
    except ImportError:
        pass
    return out


def live_machine() -> dict:
    """The device this process would run on and its toolchain."""
    dev = {"device": "cpu", "device_count": 0, "capability": None}
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            dev = {"device": torch.cuda.get_device_name(0), "device_count": torch.cuda.device_count(),
                   "capability": f"{major}.{minor}"}
    except ImportError:
        pass
    return {**dev, "toolchain": toolchain_versions()}


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(root: str) -> dict[str, str]:
    """sha256 of every file under root (POSIX relative paths, sorted), except the manifest and byte-code."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(d, name), root).replace(os.sep, "/")
            if rel == MANIFEST or name.endswith(".pyc"):
                continue
            out[rel] = sha256_file(os.path.join(d, name))
    return dict(sorted(out.items()))


def manifest_json(manifest: dict) -> str:
    return json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def build_manifest(root: str, meta: dict) -> dict:
    """meta: config (ModelConfig) or model {name, config_digest}; target (name or Target); layout
    {tp, dcp, ep}; passes [str]; optional: options {}, model_source str, toolchain {} (override)."""
    problems = [f"meta is missing {k!r}" for k in ("target", "layout", "passes") if k not in meta]
    if "config" not in meta and "model" not in meta:
        problems.append("meta needs 'config' (a ModelConfig) or 'model' ({name, config_digest})")
    if problems:
        raise ArtifactError(problems, "write_manifest")
    if "config" in meta:
        cfg = meta["config"]
        model = {"name": cfg.name, "config_digest": cfg.digest()}
    else:
        model = {"name": meta["model"]["name"], "config_digest": meta["model"]["config_digest"]}
    model["source"] = meta.get("model_source", model["name"])
    target = meta["target"]
    if isinstance(target, str):
        from .targets import get_target

        target = get_target(target)
    layout = {k: int(meta["layout"].get(k, 1)) for k in ("tp", "dcp", "ep", "dcp_interleave")}
    return {
        "schema_version": SCHEMA_VERSION,
        "k31c_version": _dist_version("k31c") or "unknown",
        "model": model,
        "target": {"name": target.name, "description": target.description, "device_names": list(target.device_names),
                   "backends": list(target.backends), "needs_gpu": target.needs_gpu, "plan_only": target.plan_only},
        "layout": layout,
        "options": meta.get("options", {}),
        "passes": list(meta["passes"]),
        "toolchain": meta.get("toolchain") or toolchain_versions(),
        "files": file_hashes(root),
    }


def write_manifest(root: str, meta: dict) -> str:
    """Hash every file already in `root` and write root/manifest.json (write it last). Returns its path."""
    if not os.path.isdir(root):
        raise ArtifactError([f"artifact directory {root} does not exist"], "write_manifest")
    text = manifest_json(build_manifest(root, meta))
    path = os.path.join(root, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def read_json(path: str, what: str, problems: list[str]):
    """The parsed JSON file, or None with the reason appended to `problems`."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        problems.append(f"{what} cannot be read: {e}")
        return None


def verify(root: str, check_live: bool = True, live: dict | None = None) -> tuple[dict | None, list[str]]:
    """(manifest, problems): every mismatch found, none raised."""
    problems: list[str] = []
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        return None, [f"{root} is not a directory (run `k31c compile ... -o {root}` first)"]
    if not os.path.isfile(path):
        return None, [f"{MANIFEST} is missing: {root} is not a k31c artifact (or its compile did not finish)"]
    man = read_json(path, MANIFEST, problems)
    if not isinstance(man, dict):
        return None, problems or [f"{MANIFEST} must hold a JSON object"]
    if man.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"schema_version {man.get('schema_version')!r}, this k31c reads {SCHEMA_VERSION} "
                        f"(recompile the artifact with this k31c)")
    problems += [f"{MANIFEST} is missing key {k!r}" for k in _REQUIRED_KEYS if k not in man]
    listed = man.get("files") if isinstance(man.get("files"), dict) else {}
    actual = file_hashes(root)
    for rel in sorted(set(listed) | set(actual)):
        if rel not in actual:
            problems.append(f"file {rel} is listed in the manifest but missing")
        elif rel not in listed:
            problems.append(f"file {rel} is not listed in the manifest (added after compile?)")
        elif listed[rel] != actual[rel]:
            problems.append(f"file {rel} was modified (sha256 {actual[rel][:12]}…, manifest {listed[rel][:12]}…)")
    plan_path = os.path.join(root, "plan.json")
    if os.path.isfile(plan_path):
        plan = read_json(plan_path, "plan.json", problems)
        if isinstance(plan, dict) and isinstance(man.get("layout"), dict):
            pl = {k: plan.get("layout", {}).get(k) for k in ("tp", "dcp", "ep")}
            if pl != {k: man["layout"].get(k) for k in ("tp", "dcp", "ep")}:
                problems.append(f"plan.json layout {pl} differs from the manifest's {man['layout']}")
            digest = plan.get("model", {}).get("config_digest")
            if isinstance(man.get("model"), dict) and digest != man["model"].get("config_digest"):
                problems.append(f"plan.json is for model config {digest}, the manifest for "
                                f"{man['model'].get('config_digest')}")
    structural = [p for p in problems if p.startswith(("schema_version", MANIFEST))]
    if check_live and not structural:  # hash problems do not hide live mismatches: report everything
        problems += live_problems(man, live or live_machine())
    return man, problems


def live_problems(man: dict, live: dict) -> list[str]:
    """Mismatches between the artifact and this machine (device and toolchain)."""
    p = []
    tgt, lay = man.get("target", {}), man.get("layout", {})
    name = tgt.get("name", "?")
    if tgt.get("plan_only"):
        p.append(f"target {name} is plan only (no kernel backend): the artifact has nothing to run")
    elif tgt.get("needs_gpu"):
        names = tgt.get("device_names") or []
        if live["device"] == "cpu":
            p.append(f"artifact built for {name} ({', '.join(names) or 'a GPU'}) but this machine has no GPU")
        else:
            if names and not any(n.lower() in live["device"].lower() for n in names):
                p.append(f"artifact built for {name} (device name containing {' or '.join(names)}) but this "
                         f"machine has {live['device']}")
            if live.get("device_count", 0) < lay.get("tp", 1):
                p.append(f"layout tp={lay.get('tp')} needs {lay.get('tp')} devices, this machine has "
                         f"{live.get('device_count', 0)}")
    built, here = man.get("toolchain", {}), live.get("toolchain", {})
    aot = man.get("options", {}).get("aot") or {}  # {arch: {triton, ...}}: cross-compiled Triton binaries
    for key in sorted(set(built) | set(here)):
        a, b = built.get(key), here.get(key)
        if aot and key in ("python", "torch", "cuda", "hip", "k31c", "tvm"):
            continue  # the build machine's host toolchain; the kernels are the stored binaries
        if aot and key == "triton":
            continue  # checked per arch against the binaries by codegen.aot.install (names both versions)
        if key == "python" and a and b:
            a, b = ".".join(a.split(".")[:2]), ".".join(b.split(".")[:2])
        if a != b:
            p.append(f"toolchain {key}: artifact built with {a or 'none'}, this machine has {b or 'none'}")
    return p


def load(root: str, check_live: bool = True, live: dict | None = None) -> Artifact:
    """Validate everything at once (see the module docstring); raise one ArtifactError listing all."""
    man, problems = verify(root, check_live, live)
    if problems:
        raise ArtifactError(problems, root)
    plan = read_json(os.path.join(root, "plan.json"), "plan.json", []) \
        if os.path.isfile(os.path.join(root, "plan.json")) else None
    cfg_path = os.path.join(root, "kernels", "configs.json")
    kernels = read_json(cfg_path, "kernels/configs.json", []) if os.path.isfile(cfg_path) else None
    return Artifact(root, man, plan, kernels)
