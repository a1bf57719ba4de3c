"""k31c/parallel/launch.py + serving.py: ranks started by launch_main serve the sharded model with rank 0
owning the scheduler (logits equal one process), a rank that dies ends every rank with an error within
a timeout (never a hang), and layout / torchrun errors are reported before anything starts."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from k31c.model.build import build_module
from k31c.parallel.launch import add_launch_args, launch_main
from k31c.parallel.serving import LeaderRuntime, parallel_runtime
from k31c.runtime.reference import ReferenceRuntime
from tests.helpers import assert_close_rel
from tests.test_parallel_model import PAR_CFG, STEPS, TOL, full_weights, reference_logits


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="serve")
    add_launch_args(p)
    return p.parse_args(argv)


def serve_main(args) -> int:
    """What a command does: make a runtime through parallel_runtime, run steps, rank 0 writes the result."""
    def build(module, weights):
        return ReferenceRuntime(module, weights, max_rows=128, max_requests=4)

    rt = parallel_runtime(getattr(args, "parallel", None), build_module(PAR_CFG), full_weights(), build)
    assert isinstance(rt, LeaderRuntime)  # ranks > 0 never get here
    rt.add_request("a", 40)
    rt.add_request("b", 40)
    out = {f"step{i}": rt.step(fn, chunks).contiguous() for i, (fn, chunks) in enumerate(STEPS)}
    save_file(out, args.out)
    print("rank 0 done")
    return 0


def dying_main(args) -> int:
    """Rank 1 is killed by SIGKILL while rank 0 waits for it in a collective."""
    if args.parallel.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return 0


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--tp", "2", "--dcp", "2", "--dcp-interleave", "2"],
                                    ["--tp", "4", "--dcp", "2", "--ep", "2"]])
def test_launched_ranks_give_single_process_logits(tmp_path, capfd, layout):
    want = reference_logits()
    out = tmp_path / "logits.safetensors"
    args = parse(layout + ["--out", str(out)])
    assert launch_main(args, serve_main) == 0
    got = load_file(str(out))
    for i, w in enumerate(want):
        assert_close_rel(got[f"step{i}"], w, TOL, f"launched {' '.join(layout)} step {i}")
    assert capfd.readouterr().out.count("rank 0 done") == 1  # only rank 0 prints


def test_a_dead_rank_ends_the_run_on_every_rank(capfd):
    args = parse(["--tp", "2", "--collective-timeout", "60"])
    t0 = time.monotonic()
    code = launch_main(args, dying_main)
    elapsed = time.monotonic() - t0
    err = capfd.readouterr().err
    assert code == 1
    assert elapsed < 30, f"the run took {elapsed:.1f} s to end after a rank died"
    # rank 0 ends with an error: its watchdog's (the parent saw rank 1 die first) or gloo's own
    assert "k31c rank 0: error:" in err, err
    assert "k31c: error: rank 1 of 2 failed (exit -9)" in err, err


def usage_error_main(args) -> int:
    print("k31c run: error: a bad argument", file=sys.stderr)
    return 2


def test_every_rank_failing_alike_returns_its_code(capfd):
    assert launch_main(parse(["--tp", "2"]), usage_error_main) == 2
    err = capfd.readouterr().err
    assert err.count("a bad argument") == 1  # rank 1's stderr is silenced; rank 0 speaks
    assert "the run was ended on every rank" not in err


def test_layout_errors_before_start(capfd, monkeypatch):
    assert launch_main(parse(["--tp", "4", "--dcp", "3", "--ep", "3"]), serve_main) == 2
    err = capfd.readouterr().err
    assert "--dcp 3 does not divide --tp 4" in err and "--ep 3 does not divide --tp 4" in err  # reported together
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(k, v)
    assert launch_main(parse(["--tp", "2"]), serve_main) == 2
    assert "torchrun started 3 ranks, --tp is 2" in capfd.readouterr().err


def bad_model_main(args) -> int:
    """A model whose 9 experts the default --ep (= --tp 2) does not divide: every rank refuses alike."""
    parallel_runtime(args.parallel, build_module(PAR_CFG.replace(num_experts=9).validate()), {}, None)
    return 0


def test_model_layout_errors_are_reported_once_as_a_usage_error(capfd):
    assert launch_main(parse(["--tp", "2"]), bad_model_main) == 2
    err = capfd.readouterr().err
    assert err.count("k31c: error: parallel layout: --ep 2 does not divide the 9 experts") == 1, err
    assert "Traceback" not in err and "the run was ended on every rank" not in err


def test_tp1_runs_the_command_unchanged():
    seen = []
    assert launch_main(parse([]), lambda a: seen.append(getattr(a, "parallel", None)) or 0) == 0
    assert seen == [None]
    rt = parallel_runtime(None, build_module(PAR_CFG), full_weights(), lambda m, w: ("local", m))
    assert rt[0] == "local" and torch.is_tensor(full_weights()["model.norm.weight"])


def test_dcp_interleave_is_a_compile_decision_and_launch_must_match(tmp_path):
    """`k31c compile --tp 2 --dcp 2 --dcp-interleave 2` shards the module for that interleave (module attrs,
    manifest layout); launching it with another interleave is refused, naming both layouts."""
    from k31c.cli import main
    from k31c.compiler import load_artifact
    from k31c.parallel.serving import ParallelLayout, shard_module
    from passes.base import PassError

    out = tmp_path / "dcp"
    assert main(["compile", "--model", "k31-tiny", "--tp", "2", "--dcp", "2", "--dcp-interleave", "2",
                 "-o", str(out)]) == 0
    art = load_artifact(str(out), with_weights=False)
    assert (art.module.attrs["dcp"], art.module.attrs["dcp_interleave"]) == (2, 2)
    assert art.manifest["layout"]["dcp_interleave"] == 2
    assert shard_module(art.module, ParallelLayout(tp=2, dcp=2, ep=2, rank=0, dcp_interleave=2)) is art.module
    with pytest.raises(PassError, match=r"compiled for tp/ep/dcp/dcp-interleave = \(2, 2, 2, 2\), launched with "
                                        r"\(2, 2, 2, 1\)"):
        shard_module(art.module, ParallelLayout(tp=2, dcp=2, ep=2, rank=0, dcp_interleave=1))
    assert main(["compile", "--model", "k31-tiny", "--dcp-interleave", "0", "-o", str(tmp_path / "bad")]) == 2
