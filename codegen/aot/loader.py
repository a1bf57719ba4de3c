"""Run an artifact's kernels from its stored binaries: no JIT compile on the live device.

Mechanism (and why this one): while `use_binaries(...)` is active, `JITFunction._do_compile` — the one
place where Triton's JIT compiles, after its in-memory cache missed — first looks the specialisation up
in the artifact's store, by `record.lookup_key(fn, signature, constexprs, attrs, options)` computed from
exactly what the JIT was about to compile. A hit becomes a `CompiledKernel` built from the stored
metadata + binary (the driver loads the cubin/hsaco; nothing is compiled) and is put in the JIT's
in-memory cache, so the launch path stays Triton's own. A miss is a specialisation the build did not
record (e.g. an integer argument divisible by 16 only at this shape): it is refused with its
description, or, with `jit_fallback=True`, compiled by the JIT and counted.

The alternative — filling a Triton cache directory the JIT consults — needs Triton's on-disk cache key,
which hashes the installed Triton's own files (`triton_key()`: every Python source and the
Python-version-specific `libtriton` shared object) and the ptxas version: a build on another machine,
with another Python, can never produce the key the live JIT computes.

Limits: the live Triton must be the version that built the binaries (`k31c compile --aot-triton DIR`
builds with the deployment's Triton). A `CompiledKernel` is Triton's metadata + binary + the launcher the
live Triton generates from that metadata, whose format and launch arguments may change between versions;
on the H200 (2026-11-29) Triton 3.6.0 did load and run 3.7.1-built GEMM and KDA-gate binaries correctly
when forced, but nothing guarantees it, so a version mismatch is refused. The live kernel sources must be
the built ones (`source_key`, the JIT's own hash of a kernel and the @jit functions it calls, is part of
the lookup key). A specialisation the build's workload never launched is a miss (refused, or JIT-compiled
and counted with `jit_fallback`).
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from .record import describe, lookup_key
from .store import BIN_DIR, AOTError, arch_dir, read_index, verify_files


def live_target() -> dict | None:
    """{backend, arch, warp_size, arch_name, device} of the GPU this process would launch on, or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    from triton.runtime.driver import driver

    t = driver.active.get_current_target()
    name = f"sm_{t.arch}{'a' if int(t.arch) >= 90 else ''}" if t.backend == "cuda" else str(t.arch)
    return {"backend": t.backend, "arch": t.arch, "warp_size": t.warp_size, "arch_name": name,
            "device": torch.cuda.get_device_name(0)}


def stored_archs(artifact: str) -> list[str]:
    root = os.path.join(artifact, BIN_DIR)
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))) if os.path.isdir(root) else []


def live_problems(artifact: str, live: dict | None, triton_version: str) -> list[str]:
    """Why the stored binaries cannot run here ([] when they can): no GPU, another arch, another Triton."""
    archs = stored_archs(artifact)
    if not archs:
        return [f"artifact {artifact} holds no Triton binaries ({BIN_DIR}/ is empty): build them with "
                f"`k31c compile --target T --aot ...`"]
    have = ", ".join(archs)
    if live is None:
        return [f"artifact {artifact} holds Triton binaries for {have} but this machine has no GPU"]
    if live["arch_name"] not in archs:
        return [f"artifact {artifact} holds Triton binaries for {have}, but the live device is "
                f"{live['arch_name']} ({live['device']}): rebuild for it (`k31c compile --target <its target> "
                f"--aot ...`, no GPU needed) or run with JIT fallback to compile on this device"]
    index = read_index(arch_dir(artifact, live["arch_name"]))
    built = index["triton"]["version"]
    if built != triton_version:
        return [f"artifact {artifact}: its {live['arch_name']} binaries were built by Triton {built}, this "
                f"process has Triton {triton_version} (stored binaries are used only by the Triton that built them: "
                f"the metadata and launch arguments are version-specific): rebuild "
                f"with `--aot-triton` pointing at a Triton {triton_version} install, or run with JIT fallback"]
    return []


@dataclass
class BinaryStats:
    """What the stored binaries did in this process."""

    loaded: Counter = field(default_factory=Counter)  # kernel name -> binaries loaded from the artifact
    jit: list = field(default_factory=list)  # specialisations the JIT compiled (misses with fallback)
    refused: list = field(default_factory=list)  # misses without fallback (each raised)

    def summary(self) -> dict:
        return {"loaded": sum(self.loaded.values()), "loaded_by_kernel": dict(sorted(self.loaded.items())),
                "jit_compiles": len(self.jit), "jit": self.jit, "refused": len(self.refused)}


class BinaryStore:
    """The verified index of one arch folder; `load` turns an entry into a launchable CompiledKernel."""

    def __init__(self, artifact: str, arch_name: str):
        self.folder = arch_dir(artifact, arch_name)
        self.index = read_index(self.folder)
        bad = verify_files(self.folder, self.index)
        if bad:
            raise AOTError(f"{self.folder}: {len(bad)} stored binary file(s) rejected:\n" +
                           "\n".join(f"  - {p}" for p in bad) + "\nrebuild the binaries (k31c compile ... --aot)")
        self.entries = {k["key"]: k for k in self.index["kernels"]}

    def load(self, entry: dict, jitfn, signature, constexprs, attrs):
        import json

        from triton.compiler import ASTSource, CompiledKernel

        folder = os.path.join(self.folder, entry["key"])
        group = {f: os.path.join(folder, f) for f in sorted(entry["files"].values())}
        with open(group[entry["files"]["json"]], encoding="utf-8") as f:
            md_hash = json.load(f).get("hash", entry["key"])
        return CompiledKernel(ASTSource(jitfn, signature, constexprs, attrs), group, md_hash)


_INSTALLED: dict = {}  # the original JITFunction._do_compile while a store is installed


def install(artifact: str, jit_fallback: bool = False, live: dict | None = None) -> BinaryStats:
    """From now on, Triton launches in this process use the artifact's binaries for the live device
    (until `uninstall()`); returns the BinaryStats it fills. Refuses (AOTError) when the artifact holds no
    binaries for the live device or Triton, unless `jit_fallback` (then every kernel is JIT-compiled
    and counted)."""
    import triton
    from triton.runtime import jit as jit_mod

    if _INSTALLED:
        raise AOTError(f"stored binaries of {_INSTALLED['artifact']} are already in use in this process")
    live = live if live is not None else live_target()
    problems = live_problems(artifact, live, triton.__version__)
    if problems and not jit_fallback:
        raise AOTError("\n".join(problems))
    store = None if problems else BinaryStore(artifact, live["arch_name"])
    stats = BinaryStats()
    original = jit_mod.JITFunction._do_compile

    def _do_compile(jitfn, key, signature, device, constexprs, options, attrs, warmup):
        k = lookup_key(jitfn, signature, constexprs, attrs, options)
        entry = store.entries.get(k) if store is not None else None
        if entry is not None:
            kernel = store.load(entry, jitfn, signature, constexprs, attrs)
            jitfn.device_caches[device][0][key] = kernel
            stats.loaded[entry["name"]] += 1
            return kernel
        d = describe(jitfn, signature, constexprs, attrs, options)
        what = {"key": k, "function": d["function"], "signature": d["signature"], "attrs": d["attrs"],
                "constexprs": d["constexprs"]}
        if not jit_fallback:
            stats.refused.append(what)
            raise AOTError(f"no stored binary for {d['function']} (key {k}) with signature {d['signature']}, "
                           f"attrs {d['attrs']}: the build's workload did not launch this specialisation; add a "
                           f"scenario with this shape to the build (--aot-workload) or run with JIT fallback")
        stats.jit.append(what)
        return original(jitfn, key, signature, device, constexprs, options, attrs, warmup)

    jit_mod.JITFunction._do_compile = _do_compile
    _INSTALLED.update(artifact=artifact, original=original, stats=stats, fallback=jit_fallback)
    return stats


def installed_summary() -> str | None:
    """One line on what the installed store did so far (None when none is installed)."""
    if not _INSTALLED:
        return None
    s = _INSTALLED["stats"].summary()
    return (f"aot: {s['loaded']} stored binaries loaded from {_INSTALLED['artifact']}, {s['jit_compiles']} JIT "
            f"compiles (JIT fallback {'on' if _INSTALLED['fallback'] else 'off'}), {s['refused']} refused")


def uninstall():
    """Back to the plain JIT (kernels already loaded stay in the JIT's in-memory caches)."""
    from triton.runtime import jit as jit_mod

    if _INSTALLED:
        jit_mod.JITFunction._do_compile = _INSTALLED["original"]
        _INSTALLED.clear()


@contextmanager
def use_binaries(artifact: str, jit_fallback: bool = False, live: dict | None = None):
    """`install` for the body of a with-statement; yields the BinaryStats."""
    stats = install(artifact, jit_fallback, live)
    try:
        yield stats
    finally:
        uninstall()
