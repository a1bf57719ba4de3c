"""Build an artifact's Triton binaries ahead of time for its target, on a machine without that GPU.

    report = build_binaries("build/tiny-h200")              # target from the artifact's manifest
    report = build_binaries(art, triton_path="/opt/triton36")  # compile with the deployment's Triton
    print(report.text())

Steps: (1) start `codegen.aot.worker` in a subprocess (its own session, `TRITON_INTERPRET=0`, a private
`TRITON_CACHE_DIR`, `PYTHONPATH` led by `triton_path` when given) with a time-out — on expiry the whole
process group is killed and `AOTTimeout` names the limit; (2) the worker records every specialisation
the artifact's kernels launch over `workload` for each compute dtype and compiles each for the target;
(3) the binaries move into `kernels/bin/<arch>/` with `index.json` (store.py) and the manifest's file
hashes are refreshed, so `k31c` artifact verification covers them.

The workload decides which integer/alignment specialisations exist (Triton specialises integers equal
to 1 or divisible by 16, pointers aligned to 16 bytes): the default covers single and batched prefill,
decode and verify steps at small, odd and multiple-of-16 token counts; the runtime refuses (or, with JIT
fallback, compiles and counts) any specialisation outside it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .store import AOTError, arch_dir, index_from_worker, triton_target, write_index
from .workload import DEFAULT_WORKLOAD, check_scenario

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DTYPES = ("bf16",)


class AOTTimeout(AOTError):
    """The build worker ran past its time limit and was killed."""


@dataclass
class BuildReport:
    arch: str
    folder: str
    triton: str
    kernels: int
    errors: list
    record_s: float
    total_s: float
    compile_s: float  # summed over the parallel compile jobs

    def text(self) -> str:
        lines = [f"aot: {self.kernels} Triton binaries for {self.arch} (Triton {self.triton}) in {self.folder}: "
                 f"recorded in {self.record_s:.1f} s, {self.compile_s:.1f} s of compiling, {self.total_s:.1f} s in all"]
        lines += [f"aot: FAILED {e['function']} ({e['key']}): {_error_summary(e['error'])}" for e in self.errors]
        return "\n".join(lines)


def _error_summary(error: str) -> str:
    """One line for a failed compile: Triton's CompilationError puts the position on its first line and
    the reason on its last, so both are kept."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    if not lines:
        return "(no message)"
    head, tail = lines[0], lines[-1]
    return (head if head == tail else f"{head} ... {tail}")[:400]


def run_worker(request: dict, timeout_s: float, triton_path: str | None = None, python: str | None = None) -> dict:
    """Run the worker on `request` (request['out'] must be a fresh folder); its worker.json as a dict."""
    out = request["out"]
    os.makedirs(out, exist_ok=True)
    req_path = os.path.join(out, "request.json")
    with open(req_path, "w", encoding="utf-8") as f:
        json.dump(request, f, indent=1, sort_keys=True)
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"
    env["TRITON_CACHE_DIR"] = os.path.join(out, ".triton_cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, REPO_ROOT, env.get("PYTHONPATH")) if p)
    log_path = os.path.join(out, "worker.log")
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([python or sys.executable, "-m", "codegen.aot.worker", req_path], cwd=REPO_ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AOTTimeout(f"the AOT build worker ran past its time limit of {timeout_s:g} s and was killed "
                             f"(log: {log_path}); raise the limit (--aot-timeout) or build fewer scenarios") from None
    if rc != 0:
        tail = open(log_path, encoding="utf-8", errors="replace").read()[-3000:]
        raise AOTError(f"the AOT build worker failed (exit {rc}); the end of its log {log_path}:\n{tail}")
    with open(os.path.join(out, "worker.json"), encoding="utf-8") as f:
        return json.load(f)


def install_store(result: dict, work: str, folder: str, target: dict, workload, dtypes) -> dict:
    """Move the worker's binaries from `work` into `folder` (replaced) and write its index."""
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    for k in result["kernels"]:
        shutil.move(os.path.join(work, k["key"]), os.path.join(folder, k["key"]))
    index = index_from_worker(result, target, folder, list(workload), dtypes)
    write_index(folder, index)
    return index


def refresh_manifest(artifact: str, aot: dict | None = None):
    """Re-hash every file of the artifact into its manifest (the binaries were added after compile) and
    record `options.aot` = {arch: {triton, kernels, failures}} (the toolchain that built the binaries)."""
    from k31c.artifact import MANIFEST, file_hashes, manifest_json

    path = os.path.join(artifact, MANIFEST)
    with open(path, encoding="utf-8") as f:
        man = json.load(f)
    if aot is not None:
        man.setdefault("options", {}).setdefault("aot", {}).update(aot)
    man["files"] = file_hashes(artifact)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(manifest_json(man))
    os.replace(tmp, path)


def drop_binaries(artifact: str, arch_name: str):
    """Remove kernels/bin/<arch>/ and its entries from the manifest (other entries are left as they are,
    so tampering elsewhere is still caught when the worker loads the artifact)."""
    from k31c.artifact import MANIFEST, manifest_json

    folder = arch_dir(artifact, arch_name)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    path = os.path.join(artifact, MANIFEST)
    with open(path, encoding="utf-8") as f:
        man = json.load(f)
    prefix = f"kernels/bin/{arch_name}/"
    man["files"] = {k: v for k, v in man.get("files", {}).items() if not k.startswith(prefix)}
    man.get("options", {}).get("aot", {}).pop(arch_name, None)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(manifest_json(man))


def build_binaries(artifact: str, target_name: str | None = None, *, workload=DEFAULT_WORKLOAD,
                   dtypes=DEFAULT_DTYPES, triton_path: str | None = None, timeout_s: float = 3600,
                   python: str | None = None) -> BuildReport:
    """Compile every Triton specialisation the artifact launches over `workload` for its target."""
    from k31c.targets import get_target

    bad = [p for sc in workload for p in check_scenario(sc)]
    bad += [f"dtype {d!r}: AOT builds bf16 or fp32" for d in dtypes if d not in ("bf16", "fp32")]
    if bad:
        raise AOTError("AOT build request: " + "; ".join(bad))
    with open(os.path.join(artifact, "manifest.json"), encoding="utf-8") as f:
        man = json.load(f)
    tgt = triton_target(get_target(target_name or man["target"]["name"]))
    drop_binaries(artifact, tgt["arch_name"])  # a rebuild starts from the artifact without them
    work = tempfile.mkdtemp(prefix="k31c-aot-")
    try:
        t0 = time.perf_counter()
        request = {"mode": "artifact", "artifact": os.path.abspath(artifact), "target_name": tgt["name"],
                   "target": {k: tgt[k] for k in ("backend", "arch", "warp_size")}, "out": work,
                   "dtypes": list(dtypes), "workload": [dict(s) for s in workload], "compile": True}
        result = run_worker(request, timeout_s, triton_path, python)
        folder = arch_dir(artifact, tgt["arch_name"])
        index = install_store(result, work, folder, tgt, workload, dtypes)
        refresh_manifest(artifact, {tgt["arch_name"]: {"triton": result["triton"], "kernels": len(index["kernels"]),
                                                       "failures": len(index["errors"])}})
        compile_s = sum(k.get("compile_s", 0.0) for k in result["kernels"])
        return BuildReport(tgt["arch_name"], folder, result["triton"], len(result["kernels"]), result["errors"],
                           result["record_s"], time.perf_counter() - t0, compile_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compile_callable(spec: str, target: dict, folder: str, *, timeout_s: float = 600,
                     triton_path: str | None = None, compile: bool = True) -> dict:
    """Record the launches made by calling `module:function` (CPU tensors) and compile them for
    `target` ({name, arch_name, backend, arch, warp_size}) into the store `folder`; its index."""
    work = tempfile.mkdtemp(prefix="k31c-aot-")
    try:
        request = {"mode": "callable", "callable": spec, "target_name": target["name"],
                   "target": {k: target[k] for k in ("backend", "arch", "warp_size")}, "out": work,
                   "compile": compile}
        result = run_worker(request, timeout_s, triton_path)
        if not compile:
            return result
        return install_store(result, work, folder, target, [{"callable": spec}], [])
    finally:
        shutil.rmtree(work, ignore_errors=True)
