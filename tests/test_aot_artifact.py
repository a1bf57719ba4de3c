"""`build_binaries` on a real artifact (k31-tiny for the H200): the worker records the launches of every
kernel node the compiler selected (Triton's own specialisation, device faked), compiles them for sm_90a,
installs them under kernels/bin/sm_90a/ and re-hashes the manifest so artifact verification covers them."""

import json
import os
import subprocess
import sys

import pytest

from codegen.aot import AOTError, build_binaries, embedded_arch, read_index, verify_files
from codegen.aot.build import REPO_ROOT
from k31c.artifact import verify as verify_artifact

WORKLOAD = [{"prompts": [1], "decode": 0, "verify": 0}]  # prefill of one token: every prefill kernel, once


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("art") / "tiny-h200")
    p = subprocess.run([sys.executable, "-m", "k31c", "compile", "--model", "k31-tiny", "--target", "h200", "-o", out],
                       cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    report = build_binaries(out, workload=WORKLOAD, timeout_s=600)
    return out, report


def test_every_selected_kernel_node_was_recorded_and_built(artifact):
    art, report = artifact
    folder = os.path.join(art, "kernels", "bin", "sm_90a")
    index = read_index(folder)
    assert report.kernels == len(index["kernels"]) > 10 and report.arch == "sm_90a"
    assert index["errors"] == [], index["errors"]
    assert index["workload"] == WORKLOAD and index["dtypes"] == ["bf16"]
    selection = json.load(open(os.path.join(art, "kernels", "selection.json")))
    prefill_ops = {s["op"] for s in selection
                   if s["function"] == "prefill" and s["kernel"] not in ("reference", "view")}
    seen_ops = {k["first_seen"].rsplit(" ", 1)[-1] for k in index["kernels"]}
    assert prefill_ops <= seen_ops, f"kernel nodes with no recorded launch: {sorted(prefill_ops - seen_ops)}"
    for k in index["kernels"]:
        assert embedded_arch(os.path.join(folder, k["key"], k["files"]["cubin"])) == "sm_90a"
        assert k["signature"] and k["options"]["num_warps"] == k["num_warps"]
        assert k["launches"] >= 1
    assert verify_files(folder, index) == []


def test_manifest_covers_the_binaries(artifact):
    art, _ = artifact
    man, problems = verify_artifact(art, check_live=False)
    assert problems == []
    assert any(f.startswith("kernels/bin/sm_90a/") and f.endswith(".cubin") for f in man["files"])
    assert man["options"]["aot"]["sm_90a"]["kernels"] > 10
    cubin = next(f for f in man["files"] if f.endswith(".cubin"))
    with open(os.path.join(art, cubin), "ab") as f:
        f.write(b"\0")
    _, problems = verify_artifact(art, check_live=False)
    assert any(cubin in p and "modified" in p for p in problems)


def test_bad_requests_are_refused_before_any_work(artifact):
    art, _ = artifact
    with pytest.raises(AOTError, match="prompts must be a non-empty list"):
        build_binaries(art, workload=[{"prompts": [], "decode": 1}])
    with pytest.raises(AOTError, match="dtype 'fp8'"):
        build_binaries(art, dtypes=("fp8",))


def test_every_prefill_kernel_builds_for_gfx950(tmp_path):
    """mi355x: every selected Triton kernel compiles for gfx950 (dot precisions spelled for AMD, no tf32)."""
    out = str(tmp_path / "tiny-mi355x")
    p = subprocess.run([sys.executable, "-m", "k31c", "compile", "--model", "k31-tiny", "--target", "mi355x", "-o", out],
                       cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    report = build_binaries(out, workload=WORKLOAD, timeout_s=600)
    folder = os.path.join(out, "kernels", "bin", "gfx950")
    index = read_index(folder)
    assert index["errors"] == [] and report.arch == "gfx950" and report.kernels > 10, index["errors"]
    for k in index["kernels"]:
        assert embedded_arch(os.path.join(folder, k["key"], k["files"]["hsaco"])) == "gfx950"
