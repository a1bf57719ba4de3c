"""Run a module's distributed checks in one gloo process group per world size (one spawn each).

`run_checks(module_name, world)` forks `world` processes, joins them in a gloo group, and in every process
calls each function listed in the module's `DIST_CHECKS` as fn(rank, world) -> dict. Exceptions are caught
per check (and the group is then torn down, since the collectives may be out of step). Returns
{check_name: {"ok": bool, "error": str, "info": dict from rank 0}}. A hang ends with a timeout error.
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k31c.parallel.launch import reap

TIMEOUT_S = 120


def _worker(rank: int, world: int, init_file: str, module_name: str, results):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        checks = importlib.import_module(module_name).DIST_CHECKS
        for fn in checks:
            try:
                info = fn(rank, world) or {}
                results.put((rank, fn.__name__, True, "", info))
            except Exception:  # report and stop: the other ranks' collectives are now out of step
                results.put((rank, fn.__name__, False, traceback.format_exc(), {}))
                break
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "<process group>", False, traceback.format_exc(), {}))
    results.put((rank, "<done>", True, "", {}))


def run_checks(module_name: str, world: int) -> dict:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="k31c_gloo_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, module_name, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    done = 0
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    try:
        while done < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, name, ok, err, info = results.get(timeout=max(left, 0.1))
            except queue.Empty:
                out["<timeout>"] = {"ok": False, "error": f"no progress within {TIMEOUT_S} s", "info": {}}
                break
            if name == "<done>":
                done += 1
                continue
            entry = out.setdefault(name, {"ok": True, "error": "", "info": {}})
            entry["ok"] &= ok
            if err:
                entry["error"] += f"[rank {rank}] {err}\n"
            if rank == 0:
                entry["info"] = info
    finally:
        reap(procs, init_file)
    return out


def results_per_world(module_name: str, prepare=None):
    """`get(world)`: the module's check results at that world size, one process group each, run once
    (`prepare()` first, so forked ranks inherit what it computes)."""
    if prepare is not None:
        prepare()
    cache: dict = {}

    def get(world):
        if world not in cache:
            cache[world] = run_checks(module_name, world)
        return cache[world]
    return get


def check_result(res: dict, check: str, world: int) -> dict:
    """The named check's result, asserting the group started, the check ran and passed."""
    assert "<process group>" not in res, res["<process group>"]["error"]
    assert check in res, f"{check} did not run at W={world}: {res.get('<timeout>', {}).get('error', '')}"
    assert res[check]["ok"], res[check]["error"]
    return res[check]
