"""The binary store inside an artifact: `kernels/bin/<arch>/index.json` + one folder per specialisation.

    kernels/bin/sm_90a/index.json
    kernels/bin/sm_90a/<key>/<kernel>.json      Triton's metadata (target, shared memory, num_warps, ...)
    kernels/bin/sm_90a/<key>/<kernel>.cubin     the binary the driver loads (hsaco on AMD)
    kernels/bin/sm_90a/<key>/<kernel>.ptx       its assembly (amdgcn on AMD), for inspection

`<key>` is `record.lookup_key(...)` of the specialisation. index.json (sorted keys, no timestamps):
{schema, arch, target {name, backend, arch, warp_size}, triton {version, path}, python, workload,
dtypes, kernels: [{key, function, name, source_key, signature, constexprs, attrs, options, kernel_name,
files {ext: file}, sha256 {file: hex}, shared, num_warps, num_stages, launches, first_seen}],
errors: [{key, function, error}]}.

`read_index` validates the structure; `verify_files` checks every file's sha256 (a corrupted or
swapped binary is rejected, never loaded); `arch_name` maps a k31c target to its binary folder.
"""

from __future__ import annotations

import json
import os
import re

from k31c.artifact import sha256_file

SCHEMA = 1
BIN_DIR = os.path.join("kernels", "bin")
INDEX = "index.json"
_KERNEL_KEYS = ("key", "function", "name", "source_key", "signature", "constexprs", "attrs", "options",
                "kernel_name", "files", "sha256")


class AOTError(ValueError):
    """Stored binaries that cannot be used here; the message names what was wrong and what to do."""


def triton_target(target) -> dict:
    """{name, arch_name, backend, arch, warp_size} of the first Triton GPU backend of a k31c target
    (`triton-nvidia:sm_90a` -> cuda 90, `triton-amd:gfx950` -> hip gfx950); AOTError if it has none."""
    for b in target.backends:
        m = re.fullmatch(r"triton-nvidia:sm_(\d+)(a?)", b)
        if m:
            return {"name": target.name, "arch_name": f"sm_{m.group(1)}{m.group(2)}", "backend": "cuda",
                    "arch": int(m.group(1)), "warp_size": 32}
        m = re.fullmatch(r"triton-amd:(gfx[0-9a-f]+)", b)
        if m:
            return {"name": target.name, "arch_name": m.group(1), "backend": "hip", "arch": m.group(1),
                    "warp_size": 64}
    raise AOTError(f"target {target.name} has no Triton GPU backend ({target.backend_summary()}): "
                   f"nothing to compile ahead of time")


_EM_CUDA, _EM_AMDGPU = 190, 224
_AMDGPU_MACH = {0x040: "gfx1030", 0x04C: "gfx942", 0x04F: "gfx950"}  # EF_AMDGPU_MACH values (LLVM ELF.h)


def embedded_arch(path: str) -> str:
    """The architecture a cubin / hsaco declares in its ELF header: 'sm_90a', 'sm_100a', 'gfx950'.

    cubin (e_machine EM_CUDA): ELF ABI 7 keeps the SM in e_flags bits 0-7 and the arch-specific 'a'
    variant as 0x800; ABI 8 (sm_100 and later) keeps the SM in bits 8-15 and 'a' as 0x2 (both as
    `cuobjdump --dump-elf` prints them). hsaco (EM_AMDGPU): EF_AMDGPU_MACH in e_flags bits 0-7."""
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 52 or head[:4] != b"\x7fELF":
        raise AOTError(f"{path} is not an ELF file")
    machine = int.from_bytes(head[18:20], "little")
    flags = int.from_bytes(head[48:52], "little")
    if machine == _EM_CUDA:
        if head[8] >= 8:
            return f"sm_{(flags >> 8) & 0xFF}{'a' if flags & 0x2 else ''}"
        return f"sm_{flags & 0xFF}{'a' if flags & 0x800 else ''}"
    if machine == _EM_AMDGPU:
        mach = flags & 0xFF
        return _AMDGPU_MACH.get(mach, f"amdgpu-mach-0x{mach:03x}")
    raise AOTError(f"{path}: ELF machine {machine} is neither CUDA ({_EM_CUDA}) nor AMDGPU ({_EM_AMDGPU})")


def arch_dir(artifact: str, arch_name: str) -> str:
    return os.path.join(artifact, BIN_DIR, arch_name)


def index_json(index: dict) -> str:
    return json.dumps(index, indent=1, sort_keys=True, ensure_ascii=True) + "\n"


def write_index(folder: str, index: dict) -> str:
    path = os.path.join(folder, INDEX)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(index_json(index))
    os.replace(tmp, path)
    return path


def read_index(folder: str) -> dict:
    """The parsed index of one arch folder; AOTError naming every structural problem."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        raise AOTError(f"{path} is missing: this artifact has no binaries for {os.path.basename(folder)}")
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise AOTError(f"{path} cannot be read: {e}") from None
    problems = []
    if not isinstance(index, dict):
        raise AOTError(f"{path} must hold a JSON object")
    if index.get("schema") != SCHEMA:
        problems.append(f"schema {index.get('schema')!r}, this k31c reads {SCHEMA} (rebuild the binaries)")
    for k in ("arch", "target", "triton", "kernels"):
        if k not in index:
            problems.append(f"missing key {k!r}")
    for i, k in enumerate(index.get("kernels", [])):
        missing = [x for x in _KERNEL_KEYS if x not in k]
        if missing:
            problems.append(f"kernels[{i}] lacks {missing}")
    if problems:
        raise AOTError(f"{path}: " + "; ".join(problems))
    return index


def verify_files(folder: str, index: dict) -> list[str]:
    """Problems with the stored files: missing, sha256 different from the index, or a binary whose ELF
    header names another architecture than the folder's."""
    problems = []
    for k in index["kernels"]:
        bad = []
        for name, want in sorted(k["sha256"].items()):
            p = os.path.join(folder, k["key"], name)
            if not os.path.isfile(p):
                bad.append(f"{k['key']}/{name} ({k['name']}) is missing")
            elif sha256_file(p) != want:
                bad.append(f"{k['key']}/{name} ({k['name']}) is corrupted: sha256 {sha256_file(p)[:12]}… "
                           f"differs from the index's {want[:12]}…")
        binary = k["files"].get("cubin") or k["files"].get("hsaco")
        found = embedded_arch(os.path.join(folder, k["key"], binary)) if not bad and binary else index["arch"]
        if found != index["arch"]:
            bad.append(f"{k['key']}/{binary} ({k['name']}) is built for {found}, not for this folder's {index['arch']}")
        problems += bad
    return problems


def index_from_worker(result: dict, target: dict, folder: str, workload, dtypes) -> dict:
    """The index of `folder` (binaries already moved there) from the worker's report."""
    kernels = []
    for k in result["kernels"]:
        entry = {x: v for x, v in k.items() if x != "compile_s"}  # the index is deterministic: no timings
        entry["sha256"] = {f: sha256_file(os.path.join(folder, k["key"], f)) for f in sorted(k["files"].values())}
        binary = os.path.join(folder, k["key"], k["files"].get("cubin") or k["files"]["hsaco"])
        entry["embedded_arch"] = embedded_arch(binary)
        if entry["embedded_arch"] != target["arch_name"]:
            raise AOTError(f"{binary} declares {entry['embedded_arch']}, the build asked for {target['arch_name']}")
        kernels.append(entry)
    kernels.sort(key=lambda k: (k["function"], k["key"]))
    return {"schema": SCHEMA, "arch": target["arch_name"],
            "target": {x: target[x] for x in ("name", "backend", "arch", "warp_size")},
            "triton": {"version": result["triton"]}, "python": result["python"],
            "workload": workload, "dtypes": list(dtypes), "kernels": kernels,
            "errors": [{x: e[x] for x in ("key", "function", "error")} for e in result["errors"]]}
