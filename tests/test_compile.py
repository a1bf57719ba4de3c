"""`k31c compile` and the artifact: pipeline dumps, determinism, selection listing, and running the
artifact (through its selected kernels) gives the reference interpreter's logits."""

from __future__ import annotations

import filecmp
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ir.parser import parse_module
from ir.printer import print_module
from k31c.cli import main
from k31c.compiler import ArtifactError, load_artifact
from tests.helpers import assert_close_rel


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny"
    assert main(["compile", "--model", "k31-tiny", "--target", "cpu", "-o", str(out)]) == 0
    return out


def test_artifact_layout_and_dumps_reparse(artifact):
    for f in ("manifest.json", "module.ir", "report.txt", "kernels/selection.json", "kernels/configs.json",
              "weights/model.safetensors", "ir/000_input.ir", "ir/005_packed_projection.ir"):
        assert (artifact / f).is_file(), f
    for f in sorted((artifact / "ir").iterdir()):
        text = f.read_text()
        assert print_module(parse_module(text)) == text, f.name
    report = (artifact / "report.txt").read_text()
    assert "packed_projection" in report and "reference fallbacks:" in report


def test_plan_cache_layout_is_what_the_runtime_allocates(artifact, capsys):
    """plan.json's `cache_layout` (SPEC §7 totals, row bytes, pages, alignment) is exactly the packed pool a
    runtime of the artifact allocates, the IR's MLA pools are block views of it, and inspect shows it."""
    from k31c.runtime.reference import ReferenceRuntime

    plan = json.loads((artifact / "plan.json").read_text())
    cl = plan["cache_layout"]
    art = load_artifact(str(artifact))
    rt = ReferenceRuntime(art.module, art.weights, max_rows=128, max_requests=2)
    assert rt.block_pool.layout.to_json() == cl
    assert rt.layout_source == "the module's planned cache_layout (plan.json)"  # the pass's plan, not re-derived
    assert cl["bytes_per_token"] == plan["cache"]["per_token"] and cl["alignment"] == 128
    assert rt.block_pool.rows.shape[1] == cl["row_bytes"] == cl["block_size"] * cl["row_bytes_per_token"]
    lat = art.module.function("decode").input("latent.3").type
    assert str(lat.shape[0]) == "NB" and int(lat.shape[1]) == cl["block_size"]
    assert main(["inspect", str(artifact)]) == 0
    out = capsys.readouterr().out
    assert f"one row = {cl['row_bytes']:,} B" in out and f"{cl['bytes_per_token']:,} B per token" in out
    assert "keys e4m3[B, 32] @0, scales f32[B]" in out


def test_compiling_twice_is_byte_identical(artifact, tmp_path):
    again = tmp_path / "again"
    assert main(["compile", "--model", "k31-tiny", "--target", "cpu", "-o", str(again)]) == 0
    cmp = filecmp.dircmp(artifact, again)

    def diffs(c):
        return c.diff_files + c.left_only + c.right_only + [d for sub in c.subdirs.values() for d in diffs(sub)]
    assert diffs(cmp) == []


def test_artifact_logits_equal_reference(artifact, tmp_path):
    toks = "3,141,59,265,358,97,93,238,46,264,338,327,95,28,84,197,169,399,375,105"
    ref, comp = tmp_path / "ref.safetensors", tmp_path / "comp.safetensors"
    assert main(["logits", "--model", "k31-tiny", "--tokens", toks, "--out", str(ref)]) == 0
    assert main(["logits", "--artifact", str(artifact), "--tokens", toks, "--out", str(comp)]) == 0
    assert main(["logits", "--artifact", str(artifact), "--tokens", toks, "--out", str(tmp_path / "dec.st"),
                 "--decode-from", "17"]) == 0
    r = load_file(str(ref))["logits"]
    assert_close_rel(load_file(str(comp))["logits"], r, 1e-5, "compiled prefill vs reference")
    assert_close_rel(load_file(str(tmp_path / "dec.st"))["logits"], r, 2e-5, "compiled decode vs reference")


def test_disable_and_print_after(tmp_path, capsys):
    out = tmp_path / "nofuse"
    assert main(["compile", "--model", "k3-tiny", "-o", str(out), "--disable-pass", "packed_projection",
                 "--dump-ir", str(tmp_path / "dump")]) == 0
    assert "fused.packed_linear" not in (out / "module.ir").read_text()
    dumps = sorted(os.listdir(tmp_path / "dump"))
    assert dumps[0] == "000_input.ir" and not any("packed_projection" in d for d in dumps)
    assert main(["compile", "--model", "k3-tiny", "-o", str(tmp_path / "p"), "--print-after", "packed_projection"]) == 0
    assert "// IR after packed_projection" in capsys.readouterr().err
    assert main(["compile", "--model", "k3-tiny", "-o", str(tmp_path / "q"), "--disable-pass", "no_such_pass"]) == 2
    err = capsys.readouterr().err
    assert "no_such_pass" in err and "packed_projection" in err


def test_full_size_compiles_without_weights(tmp_path, capsys):
    """The issue-9 command: full K3.1 Pro, no weights, planned for 8 GB300s with DCP 8."""
    out = tmp_path / "pro"
    assert main(["compile", "--model", "k31-pro", "--target", "gb300", "--tp", "8", "--dcp", "8", "-o", str(out)]) == 0
    assert not (out / "weights").exists()
    assert "fused.packed_linear" in (out / "module.ir").read_text()
    plan = json.loads((out / "plan.json").read_text())
    assert plan and "not materialised" in (out / "report.txt").read_text()
    assert main(["run", str(out), "--prompt", "x"]) == 2  # built for GB300, no weights: refused with a reason
    err = capsys.readouterr().err
    assert "gb300" in err and ("no GPU" in err or "no weights" in err)


def test_plan_only_target_and_bad_artifact(tmp_path, capsys):
    out = tmp_path / "tpu"
    assert main(["compile", "--model", "k31-tiny", "--target", "tpu-v7x", "-o", str(out)]) == 0
    assert "none: plan only" in (out / "report.txt").read_text()
    assert main(["run", str(out), "--prompt", "x"]) == 2
    assert "plan only" in capsys.readouterr().err
    with pytest.raises(ArtifactError, match="not a k31c artifact"):
        load_artifact(str(tmp_path))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    assert main(["compile", "--model", "k31-tiny", "-o", str(tmp_path / "junk")]) == 2
    assert "not a k31c artifact" in capsys.readouterr().err
    assert main(["compile", "--model", "k31-pro", "--target", "h200", "-o", str(tmp_path / "t")]) == 2
    assert "fit" in capsys.readouterr().err  # 1.4 TB of weights on one H200: the planner says by how much


def test_compiled_verify_and_decode_equal_reference(artifact, tiny):
    """prefill, then verify drafts of 1..8 tokens, then decode: the artifact's kernels vs the reference."""
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import ReferenceRuntime

    cfg, module, weights = tiny("k31-tiny")
    art = load_artifact(str(artifact))
    assert sum(c.template is not None for c in art.choices) > 100  # really through kernels
    toks = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(21)).tolist()
    outs = []
    for rt in (ReferenceRuntime(module, weights, max_rows=64, max_requests=1),
               ReferenceRuntime(art.module, art.weights, max_rows=64, max_requests=1,
                                engine=Executor(art.module, art.weights, art.choices, configs=art.configs))):
        rt.add_request("r", 40)
        rows = [rt.prefill({"r": toks[:18]}), rt.verify({"r": toks[18:19]}), rt.verify({"r": toks[19:27]})]
        rows += [rt.decode({"r": t}) for t in toks[27:]]
        outs.append(torch.cat(rows))
    assert_close_rel(outs[1], outs[0], 2e-5, "compiled prefill + verify + decode vs reference")


def test_quantised_cache_formats_compile_and_run_through_kernels(tmp_path):
    """--latent-cache nvfp4 --key-cache mxfp4: the IR stores NVFP4 latent rows and MXFP4 index keys, the
    sparse-MLA and indexer kernels read them, and the compiled run equals the interpreter on that module."""
    from k31c.runtime.executor import Executor
    from k31c.runtime.reference import ReferenceRuntime

    out = tmp_path / "q"
    assert main(["compile", "--model", "k31-tiny", "--latent-cache", "nvfp4", "--key-cache", "mxfp4",
                 "-o", str(out)]) == 0
    art = load_artifact(str(out))
    kernels = {c.op: c.kernel for c in art.choices}
    assert kernels["mla_attention"] == "mla_sparse" and kernels["fused.indexer_select"] == "indexer_select_rows"
    latent = art.module.function("decode").input("latent.3").type
    assert latent.dtype.name == "u8" and str(latent.shape[0]) == "NB"  # a block view of the packed pool
    assert int(latent.shape[1]) == 64 and int(latent.shape[2]) == 64 // 2 + 64 // 16 + 16
    toks = list(range(3, 31))
    outs = []
    for eng in (None, Executor(art.module, art.weights, art.choices, configs=art.configs)):
        rt = ReferenceRuntime(art.module, art.weights, max_rows=64, max_requests=1, engine=eng)
        rt.add_request("r", 40)
        outs.append(torch.cat([rt.prefill({"r": toks[:20]}), rt.verify({"r": toks[20:24]})]
                              + [rt.decode({"r": t}) for t in toks[24:]]))
    assert_close_rel(outs[1], outs[0], 2e-5, "nvfp4/mxfp4 caches: compiled vs interpreter")
