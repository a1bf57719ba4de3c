"""Artifact manifest: byte-identical for identical inputs, and one `load()` that reports every
mismatch at once (schema, file hashes, plan.json, live device, toolchain). Uses a small fake artifact
with the layout `k31c compile` writes."""

from __future__ import annotations

import functools
import json
import os

import pytest

from k31c.artifact import (MANIFEST, SCHEMA_VERSION, ArtifactError, file_hashes, load, toolchain_versions,
                           write_manifest)
from k31c.model.presets import get_preset

KERNELS = {"rms_norm_D256_BLOCK256_w4": {"family": "rms_norm", "op": "rms_norm", "backend": "triton",
                                         "config": {"BLOCK": 256, "num_warps": 4}},
           "kda_decode_H4_D64_BV64_w4": {"family": "kda_decode", "op": "kda", "backend": "triton",
                                         "config": {"BV": 64, "num_warps": 4}},
           "decode/R8": {"family": "gemm", "kernel_name": "gemm_M8_N512_BN64_w4", "config": {"BN": 64},
                         "source": "heuristic"}}  # the compiler's bucket-keyed form


@functools.lru_cache(maxsize=None)
def tiny_texts() -> tuple[str, str, str]:
    from ir.printer import print_module
    from k31c.model.build import build_module
    from k31c.plan import format_plan, make_plan, plan_json, plan_options

    plan = make_plan(plan_options("k31-tiny"))
    return plan_json(plan), format_plan(plan), print_module(build_module(get_preset("k31-tiny")))


def live(device="cpu", count=0, **toolchain) -> dict:
    return {"device": device, "device_count": count, "capability": None,
            "toolchain": {**toolchain_versions(), **toolchain}}


def make_artifact(root, target="cpu", layout=None, plan=True) -> str:
    """A fake artifact directory laid out as `k31c compile` writes it, manifest last."""
    root = str(root)
    plan_text, report, ir_text = tiny_texts()
    os.makedirs(os.path.join(root, "ir"), exist_ok=True)
    os.makedirs(os.path.join(root, "kernels"), exist_ok=True)
    files = {"ir/000_model.ir": ir_text, "report.txt": report,
             "kernels/rms_norm.py": "# generated kernel source\n", "kernels/kda_decode.py": "# generated\n",
             "kernels/configs.json": json.dumps(KERNELS, sort_keys=True, indent=1) + "\n"}
    if plan:
        files["plan.json"] = plan_text
    for rel, text in files.items():
        with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
            f.write(text)
    write_manifest(root, {"config": get_preset("k31-tiny"), "target": target,
                          "layout": layout or {"tp": 1, "dcp": 1, "ep": 1},
                          "passes": ["annotate", "fuse_packed_projection", "select_kernels"],
                          "options": {"batch_invariant": False}, "model_source": "preset k31-tiny"})
    return root


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_manifest_is_byte_identical_for_identical_inputs(tmp_path):
    a, b = make_artifact(tmp_path / "a"), make_artifact(tmp_path / "b")
    first = read(os.path.join(a, MANIFEST))
    assert read(os.path.join(b, MANIFEST)) == first
    make_artifact(a)  # rewrite everything in place
    assert read(os.path.join(a, MANIFEST)) == first
    man = json.loads(first)
    assert man["schema_version"] == SCHEMA_VERSION
    assert man["model"]["config_digest"] == get_preset("k31-tiny").digest()
    assert man["target"]["name"] == "cpu" and man["layout"] == {"tp": 1, "dcp": 1, "ep": 1, "dcp_interleave": 1}
    assert man["passes"] == ["annotate", "fuse_packed_projection", "select_kernels"]
    assert {"python", "torch", "triton", "k31c"} <= set(man["toolchain"])
    assert sorted(man["files"]) == ["ir/000_model.ir", "kernels/configs.json", "kernels/kda_decode.py",
                                    "kernels/rms_norm.py", "plan.json", "report.txt"]
    assert man["files"] == file_hashes(a)
    assert "time" not in first.decode() and first.decode() == json.dumps(man, sort_keys=True, indent=1) + "\n"


def test_load_accepts_a_sound_artifact(tmp_path):
    root = make_artifact(tmp_path / "a")
    os.makedirs(os.path.join(root, "kernels", "__pycache__"))
    with open(os.path.join(root, "kernels", "__pycache__", "rms_norm.cpython-311.pyc"), "wb") as f:
        f.write(b"\0")  # byte-code written when the runtime imports kernels: ignored
    art = load(root, check_live=True, live=live())
    assert art.plan["layout"]["tp"] == 1 and art.kernel_configs == KERNELS
    assert art.manifest["target"]["name"] == "cpu"


def test_every_file_mismatch_is_reported_at_once(tmp_path):
    root = make_artifact(tmp_path / "a")
    with open(os.path.join(root, "report.txt"), "a") as f:
        f.write("edited\n")
    os.remove(os.path.join(root, "kernels", "rms_norm.py"))
    with open(os.path.join(root, "extra.txt"), "w") as f:
        f.write("x")
    with pytest.raises(ArtifactError) as e:
        load(root, check_live=True, live=live(triton="0.0.1"))
    p = e.value.problems
    assert any("report.txt was modified" in x for x in p)
    assert any("kernels/rms_norm.py is listed in the manifest but missing" in x for x in p)
    assert any("extra.txt is not listed" in x for x in p)
    assert any("toolchain triton" in x and "0.0.1" in x for x in p)
    assert len(p) == 4


def test_live_device_and_toolchain_mismatches_all_reported(tmp_path):
    root = make_artifact(tmp_path / "h", target="h200", layout={"tp": 8, "dcp": 8, "ep": 8}, plan=False)
    with pytest.raises(ArtifactError) as e:
        load(root, live=live(torch="0.1", cuda="99.0"))
    p = "\n".join(e.value.problems)
    assert "built for h200 (H200) but this machine has no GPU" in p
    assert "toolchain torch: artifact built with" in p and "toolchain cuda: artifact built with none" in p
    with pytest.raises(ArtifactError) as e:
        load(root, live=live("NVIDIA H100 80GB HBM3", 1))
    p = "\n".join(e.value.problems)
    assert "this machine has NVIDIA H100 80GB HBM3" in p and "tp=8 needs 8 devices, this machine has 1" in p
    art = load(root, live=live("NVIDIA H200", 8))
    assert art.plan is None and art.manifest["layout"]["tp"] == 8
    assert load(root, check_live=False).manifest["target"]["needs_gpu"]


def test_plan_only_target_has_nothing_to_run(tmp_path):
    root = make_artifact(tmp_path / "t", target="tpu-v7x", plan=False)
    with pytest.raises(ArtifactError, match="tpu-v7x is plan only"):
        load(root, live=live())


def test_schema_and_plan_mismatches(tmp_path):
    root = make_artifact(tmp_path / "a")
    man = json.loads(read(os.path.join(root, MANIFEST)))
    man["schema_version"] = 999
    man["layout"]["tp"] = 2
    del man["passes"]
    with open(os.path.join(root, MANIFEST), "w") as f:
        json.dump(man, f)
    with pytest.raises(ArtifactError) as e:
        load(root, live=live())
    p = "\n".join(e.value.problems)
    assert "schema_version 999" in p and "missing key 'passes'" in p and "plan.json layout" in p
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load(str(tmp_path / "a" / "ir"))
    with pytest.raises(ArtifactError, match="not a directory"):
        load(str(tmp_path / "nowhere"))


def test_write_manifest_needs_its_metadata(tmp_path):
    with pytest.raises(ArtifactError) as e:
        write_manifest(str(tmp_path), {"layout": {}})
    assert "missing 'target'" in str(e.value) and "missing 'passes'" in str(e.value) and "'config'" in str(e.value)
