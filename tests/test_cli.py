"""The command line: logits (prefill and --decode-from), run, ir, init-weights + loading it back, and
the bad-input errors the foundation issue lists (each a clear message, several reported together)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from k31c.cli import main
from tests.helpers import assert_close_rel


def _err(capsys):
    return capsys.readouterr().err


def test_logits_prefill_and_decode_from_agree(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    toks = "5,300,17,42,99,7,256,1,2,3"
    assert main(["logits", "--model", "k31-tiny", "--tokens", toks, "--out", str(a)]) == 0
    assert main(["logits", "--model", "k31-tiny", "--tokens", toks, "--out", str(b), "--decode-from", "4"]) == 0
    la, lb = load_file(str(a))["logits"], load_file(str(b))["logits"]
    assert la.dtype == torch.float32 and la.shape == (10, 512)
    assert_close_rel(lb, la, 2e-5, "--decode-from 4 vs prefill")


def test_checkpoint_written_by_init_weights_gives_the_preset_logits(tmp_path):
    ck = tmp_path / "ck"
    assert main(["init-weights", "--preset", "k31-tiny-mxfp4", "-o", str(ck), "--k3-names", "--shards", "3",
                 "--seed", "4"]) == 0
    out_ck, out_pr = tmp_path / "ck.safetensors", tmp_path / "pr.safetensors"
    toks = "1,2,3,4,5,6,7,8"
    assert main(["logits", "--model", str(ck), "--tokens", toks, "--out", str(out_ck)]) == 0
    assert main(["logits", "--model", "k31-tiny-mxfp4", "--seed", "4", "--tokens", toks, "--out", str(out_pr)]) == 0
    torch.testing.assert_close(load_file(str(out_ck))["logits"], load_file(str(out_pr))["logits"], rtol=0, atol=0)


def test_run_generates_greedy_deterministically(capsys):
    args = ["run", "--model", "k3-tiny", "--prompt", "Kimi", "--max-new-tokens", "5", "--json"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and '"output_tokens"' in first


def test_run_batch_from_file(tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\nsecond, longer prompt\n")
    assert main(["run", "--model", "k31-tiny", "--prompts-file", str(f), "--max-new-tokens", "3", "--json",
                 "--prefill-chunk", "5"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


def test_ir_command_prints_and_verifies(tmp_path, capsys):
    out = tmp_path / "m.ir"
    assert main(["ir", "--model", "k31-tiny", "--function", "decode", "-o", str(out), "--verify"]) == 0
    text = out.read_text()
    assert text.lstrip().startswith("func @decode(") and "indexer_topk" in text and "mla_attention" in text


def test_unknown_preset_lists_presets(capsys):
    assert main(["run", "--model", "k9-huge", "--prompt", "x"]) == 2
    err = _err(capsys)
    assert "k9-huge" in err and "k31-tiny" in err and "kimi-linear-tiny" in err


def test_bad_logits_inputs_are_reported_together(tmp_path, capsys):
    rc = main(["logits", "--model", "k31-tiny", "--tokens", "1,512,9999", "--out",
               str(tmp_path / "missing" / "x.safetensors")])
    assert rc == 2
    err = _err(capsys)
    assert "[512, 9999]" in err and "outside the model's vocabulary [0, 512)" in err
    assert "does not exist" in err and "mkdir -p" in err


def test_empty_prompt_and_empty_tokens(tmp_path, capsys):
    assert main(["run", "--model", "k31-tiny", "--prompt", ""]) == 2
    assert "--prompt is empty" in _err(capsys)
    assert main(["logits", "--model", "k31-tiny", "--tokens", " , ", "--out", str(tmp_path / "x")]) == 2
    assert "--tokens is empty" in _err(capsys)


def test_bad_sampling_and_decode_from(tmp_path, capsys):
    assert main(["run", "--model", "k31-tiny", "--prompt", "x", "--temperature", "-1", "--top-p", "2"]) == 2
    err = _err(capsys)
    assert "temperature must be >= 0" in err and "top_p must be in (0, 1]" in err
    assert main(["logits", "--model", "k31-tiny", "--tokens", "1,2", "--decode-from", "5",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--decode-from 5 must be in 1..2" in _err(capsys)


def test_contradicting_config_keys(tmp_path, capsys):
    import json

    from k31c.model.init_weights import init_weights
    from k31c.model.presets import get_preset

    ck = init_weights(get_preset("k3-tiny"), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["n_routed_experts"] = cfg["num_experts"] + 1
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["logits", "--model", str(ck), "--tokens", "1", "--out", str(tmp_path / "x")]) == 2
    err = _err(capsys)
    assert "contradict" in err and "n_routed_experts" in err and "num_experts" in err


def test_help_has_examples():
    for cmd in ("run", "logits", "init-weights", "ir"):
        out = subprocess.run([sys.executable, "-m", "k31c", cmd, "--help"], capture_output=True, text=True,
                             check=True).stdout
        assert "example" in out.lower(), cmd


def test_cuda_graphs_flag_needs_cuda_and_an_artifact(capsys):
    assert main(["run", "--model", "k31-tiny", "--prompt-tokens", "1,2", "--cuda-graphs"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graphs needs --device cuda (found --device cpu)" in err
    assert "give an artifact directory" in err


def test_cuda_graphs_and_async_decode_default_on_for_one_gpu_rank_only():
    from types import SimpleNamespace

    from k31c.cli_serve import default_async_decode, default_cuda_graphs

    gpu, cpu = SimpleNamespace(device="cuda:0"), SimpleNamespace(device="cpu")
    assert default_cuda_graphs(gpu, "build/x") and not default_cuda_graphs(gpu, None)  # --model: no kernels
    assert not default_cuda_graphs(cpu, "build/x")
    ranks = SimpleNamespace(device="cuda", parallel=SimpleNamespace(world=2))
    assert not default_cuda_graphs(ranks, "build/x")
    fed, unfed = SimpleNamespace(token_feed=[0]), SimpleNamespace()
    assert default_async_decode(gpu, fed) and not default_async_decode(gpu, unfed)
    assert not default_async_decode(cpu, fed)


def test_serving_flags_can_be_turned_off(capsys):
    assert main(["run", "--model", "k31-tiny", "--prompt-tokens", "1,2", "--max-new-tokens", "1",
                 "--no-cuda-graphs", "--no-async-decode"]) == 0
