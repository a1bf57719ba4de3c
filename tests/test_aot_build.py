"""Ahead-of-time Triton binaries (codegen/aot): cross-compilation for sm_90a / sm_100a / gfx950 without a
GPU, the store's index and integrity checks, the refusal of a foreign device, the worker's time-out, and
the runtime hook loading a stored binary instead of compiling (driver faked: no GPU here)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from codegen.aot import (AOTError, AOTTimeout, compile_callable, embedded_arch, live_problems, read_index,
                         use_binaries, verify_files)
from codegen.aot.build import REPO_ROOT, run_worker
from codegen.aot.loader import BinaryStore
from codegen.aot.store import arch_dir, index_json, triton_target, write_index
from k31c.targets import get_target

TARGETS = {"h200": "sm_90a", "b200": "sm_100a", "mi355x": "gfx950"}
CUOBJDUMP = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin", "cuobjdump")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The probe launches (a bf16 GEMM and the KDA gate) compiled for three targets, as artifacts."""
    root = tmp_path_factory.mktemp("aot")
    out = {}
    for name, arch in TARGETS.items():
        tgt = triton_target(get_target(name))
        assert tgt["arch_name"] == arch
        art = root / name
        index = compile_callable("codegen.aot.probe:record", tgt, arch_dir(str(art), arch), timeout_s=300)
        out[name] = (str(art), index)
    return out


def _entry(index, name):
    hits = [k for k in index["kernels"] if k["name"] == name]
    assert hits, f"{name} not built: built {[k['name'] for k in index['kernels']]}, errors {index['errors']}"
    return hits[0]


@pytest.mark.parametrize("name", ["h200", "b200"])
def test_cubin_and_ptx_declare_the_target(stores, name):
    art, index = stores[name]
    arch = TARGETS[name]
    folder = arch_dir(art, arch)
    for kname in ("_gemm_kernel", "_kda_gate_kernel"):
        e = _entry(index, kname)
        cubin = os.path.join(folder, e["key"], e["files"]["cubin"])
        assert embedded_arch(cubin) == arch == e["embedded_arch"]
        ptx = open(os.path.join(folder, e["key"], e["files"]["ptx"])).read()
        assert f".target {arch}" in ptx.splitlines()[:40] or f".target {arch}\n" in ptx
        meta = json.load(open(os.path.join(folder, e["key"], e["files"]["json"])))
        assert meta["target"] == {"backend": "cuda", "arch": int(arch[3:-1]), "warp_size": 32}
        if os.path.isfile(CUOBJDUMP):  # NVIDIA's own reading of the ELF header agrees with ours
            head = subprocess.run([CUOBJDUMP, "--dump-elf", cubin], capture_output=True, text=True).stdout[:300]
            assert f"sm={arch[3:]}" in head, head
    assert index["errors"] == []


def test_hsaco_and_amdgcn_declare_gfx950(stores):
    art, index = stores["mi355x"]
    assert index["errors"] == [], index["errors"]
    for kname in ("_gemm_kernel", "_kda_gate_kernel"):  # the GEMM's dot precision is spelled for AMD (no tf32)
        e = _entry(index, kname)
        folder = os.path.join(arch_dir(art, "gfx950"), e["key"])
        assert embedded_arch(os.path.join(folder, e["files"]["hsaco"])) == "gfx950"
        assert '.amdgcn_target "amdgcn-amd-amdhsa--gfx950"' in open(os.path.join(folder, e["files"]["amdgcn"])).read()


def test_index_round_trips_and_verifies(stores, tmp_path):
    art, index = stores["h200"]
    folder = arch_dir(art, "sm_90a")
    text = open(os.path.join(folder, "index.json")).read()
    again = read_index(folder)
    assert again == json.loads(text) and index_json(again) == text
    assert again["triton"]["version"] == __import__("triton").__version__
    assert {k["key"] for k in again["kernels"]} == set(os.listdir(folder)) - {"index.json"}
    assert verify_files(folder, again) == []
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    write_index(str(copy), again)
    assert open(copy / "index.json").read() == text


def test_corrupted_or_swapped_binaries_are_rejected(stores, tmp_path):
    art, index = stores["h200"]
    bad_art = tmp_path / "bad"
    shutil.copytree(art, bad_art)
    folder = arch_dir(str(bad_art), "sm_90a")
    e = _entry(index, "_gemm_kernel")
    cubin = os.path.join(folder, e["key"], e["files"]["cubin"])
    data = bytearray(open(cubin, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(cubin, "wb").write(bytes(data))
    problems = verify_files(folder, read_index(folder))
    assert len(problems) == 1 and "corrupted" in problems[0] and e["key"] in problems[0]
    with pytest.raises(AOTError, match="rejected"):
        BinaryStore(str(bad_art), "sm_90a")
    # a binary for another architecture under this folder, with its sha256 updated, is caught by its ELF header
    b200_art, b200_index = stores["b200"]
    other = _entry(b200_index, "_gemm_kernel")
    shutil.copyfile(os.path.join(arch_dir(b200_art, "sm_100a"), other["key"], other["files"]["cubin"]), cubin)
    idx = read_index(folder)
    from codegen.aot.store import sha256_file
    next(k for k in idx["kernels"] if k["key"] == e["key"])["sha256"][e["files"]["cubin"]] = sha256_file(cubin)
    write_index(folder, idx)
    problems = verify_files(folder, read_index(folder))
    assert len(problems) == 1 and "built for sm_100a" in problems[0]
    # a structurally broken index names what is missing
    json.dump({"schema": 1, "arch": "sm_90a"}, open(os.path.join(folder, "index.json"), "w"))
    with pytest.raises(AOTError, match="missing key 'kernels'"):
        read_index(folder)


def test_a_mismatched_live_device_is_refused(stores):
    art, _ = stores["h200"]
    import triton
    v = triton.__version__
    b200 = {"backend": "cuda", "arch": 100, "warp_size": 32, "arch_name": "sm_100a", "device": "NVIDIA B200"}
    h200 = {"backend": "cuda", "arch": 90, "warp_size": 32, "arch_name": "sm_90a", "device": "NVIDIA H200"}
    [msg] = live_problems(art, b200, v)
    assert "sm_90a" in msg and "sm_100a (NVIDIA B200)" in msg and "rebuild" in msg and "JIT fallback" in msg
    with pytest.raises(AOTError, match="live device is sm_100a"):
        with use_binaries(art, live=b200):
            pass
    [msg] = live_problems(art, None, v)
    assert "no GPU" in msg
    [msg] = live_problems(art, h200, "3.6.0" if v != "3.6.0" else "3.7.1")
    assert f"built by Triton {v}" in msg and "--aot-triton" in msg
    assert live_problems(art, h200, v) == []
    assert "holds no Triton binaries" in live_problems(os.path.dirname(art), h200, v)[0]


def test_worker_time_out_kills_it(tmp_path):
    tgt = triton_target(get_target("h200"))
    req = {"mode": "callable", "callable": "codegen.aot.probe:record", "target_name": "h200",
           "target": {k: tgt[k] for k in ("backend", "arch", "warp_size")}, "out": str(tmp_path / "w"), "compile": True}
    t0 = time.perf_counter()
    with pytest.raises(AOTTimeout, match="time limit of 0.5 s"):
        run_worker(req, timeout_s=0.5)
    assert time.perf_counter() - t0 < 5
    assert not os.path.exists(tmp_path / "w" / "worker.json")


_HOOK_SCRIPT = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from codegen.aot.record import FakeDriver
from codegen.aot.loader import use_binaries
from codegen.aot.store import AOTError

class Launcher:  # reached only with a CompiledKernel in hand: the stored binary, not a compile
    def __init__(self, src, metadata):
        raise RuntimeError(f"LAUNCH {metadata.name} {metadata.target.arch}")

class Driver(FakeDriver):
    launcher_cls = Launcher

driver.set_active(Driver(GPUTarget("cuda", 90, 32)))
live = {"backend": "cuda", "arch": 90, "warp_size": 32, "arch_name": "sm_90a", "device": "NVIDIA H200 (fake)"}
from codegen.aot import probe
out = {}
with use_binaries(sys.argv[1], live=live) as stats:
    try:
        probe.record()
    except RuntimeError as e:
        out["hit"] = str(e)
    out["stats"] = stats.summary()
with use_binaries(sys.argv[2], live=live) as stats:  # a store without the KDA gate: refused, named
    from codegen.triton import gemm
    gemm._gemm_kernel.device_caches.clear()
    try:
        probe.record()
    except RuntimeError as e:
        out["gemm_hit"] = str(e)
    from codegen.triton._kda_common import kda_gate
    import torch
    try:
        kda_gate(torch.randn(4, 8), torch.randn(2), None, -5.0)
    except AOTError as e:
        out["miss"] = str(e)
    out["stats2"] = stats.summary()
print(json.dumps(out))
"""


def test_runtime_hook_loads_stored_binaries_and_refuses_misses(stores, tmp_path):
    art, index = stores["h200"]
    partial = tmp_path / "partial"
    shutil.copytree(art, partial)
    folder = arch_dir(str(partial), "sm_90a")
    idx = read_index(folder)
    idx["kernels"] = [k for k in idx["kernels"] if k["name"] != "_kda_gate_kernel"]
    write_index(folder, idx)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=REPO_ROOT, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-c", _HOOK_SCRIPT, art, str(partial)], env=env, capture_output=True,
                       text=True, timeout=120, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["hit"] == "LAUNCH _gemm_kernel 90"
    assert out["stats"]["loaded_by_kernel"] == {"_gemm_kernel": 1} and out["stats"]["jit_compiles"] == 0
    assert out["gemm_hit"] == "LAUNCH _gemm_kernel 90"
    assert "no stored binary for codegen.triton._kda_common:_kda_gate_kernel" in out["miss"]
    assert out["stats2"]["refused"] == 1 and out["stats2"]["jit_compiles"] == 0
    assert not any(f.endswith((".cubin", ".ptx")) for _, _, fs in os.walk(tmp_path / "cache") for f in fs)


@pytest.mark.parametrize("name", ["h200", "b200", "mi355x"])
def test_pdl_is_built_in_for_cuda_sm90_and_later_only(stores, name):
    """Programmatic dependent launch (codegen/triton/_pdl.py): for a CUDA sm_90+ build target the probe's
    GEMM and decode GEMV are specialised with PDL=True and launch_pdl, and their PTX holds the grid dependency
    wait and trigger; for gfx950 they are built without (no such launch on AMD)."""
    import importlib

    art, index = stores[name]
    folder = arch_dir(art, TARGETS[name])
    gemms = [k for k in index["kernels"] if k["name"] == "_gemm_kernel"]
    assert len(gemms) == 2, [k["name"] for k in index["kernels"]]  # the tile GEMM and the one-row GEMV
    mod, qual = gemms[0]["function"].split(":")
    pdl_index = importlib.import_module(mod).__dict__[qual].arg_names.index("PDL")
    cuda = name != "mi355x"
    for k in gemms:
        pdl = [v for i, v in k["constexprs"] if i == [pdl_index]]
        assert pdl == [cuda], (name, pdl)
        assert bool(k["options"].get("launch_pdl")) is cuda
        asm = open(os.path.join(folder, k["key"], k["files"]["ptx" if cuda else "amdgcn"])).read()
        assert ("griddepcontrol.wait" in asm and "griddepcontrol.launch_dependents" in asm) is cuda
