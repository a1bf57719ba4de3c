"""Launching a command on TP ranks: `k31c run ARTIFACT --tp N --dcp M`, `k31c logits ... --tp N` (issue 8).

    add_launch_args(parser)                 --tp, --dcp, --dcp-interleave, --ep, --collective-timeout
    launch_main(args, single_rank_main)     -> exit code

With --tp 1 `single_rank_main(args)` runs as before. Otherwise the ranks are
- started here: N processes (fork on CPU, spawn when CUDA is used), joined in one process group through
  a file store (gloo on CPU, NCCL when args.device is cuda; rank r uses cuda:r);
- or, when torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are set, this
  process is one rank of the group torchrun made (WORLD_SIZE must equal --tp).
Every rank runs `single_rank_main(args)` with `args.parallel = ParallelLayout(...)`: the command's runtime
factory passes it to `k31c.parallel.serving.parallel_runtime`, so rank 0 owns the scheduler and prints,
and ranks > 0 replay rank 0's steps with their stdout and stderr silenced (their own failure is still
reported: see below).

A layout that does not fit the model (serving.LayoutError: heads, experts; raised alike on every rank) is
said once by rank 0 and every rank exits 2, like a usage error; the layout alone is checked before any
rank starts (every problem named together).

Failure: a rank that dies (exception, signal, os._exit) ends the run on every rank, never a hang:
- under launch_main's own spawn, the parent polls the ranks; when one is killed by a signal, or exits
  non-zero while others are still running after SETTLE_S (all ranks failing alike on a bad argument just
  return its code), it sets a shared abort flag with the reason; every surviving rank's watchdog thread
  (polling the flag every 0.2 s) prints "k31c rank r: error: <reason>" and exits with ABORT_EXIT, the
  parent kills any rank still alive after `ABORT_GRACE_S` and returns 1 naming the failed rank (a rank
  killed by a signal before the lowest failed one); a rank that fails on its own (gloo notices a dead peer
  at once) prints "k31c rank r: error: ..." too;
- under torchrun, the collectives' timeout (--collective-timeout, default 120 s) raises on the survivors
  and torchrun's agent tears the group down.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .serving import FollowerDone, LayoutError, ParallelLayout, stop_followers

ABORT_EXIT = 3
ABORT_GRACE_S = 10.0
SETTLE_S = 2.0
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def add_launch_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("parallel layout (started here, or one rank under torchrun)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (heads split; default 1)")
    g.add_argument("--dcp", type=int, default=1,
                   help="decode-context-parallel group size, divides --tp: runs of --dcp consecutive ranks each "
                        "hold one interleaved copy of the context (default 1)")
    g.add_argument("--dcp-interleave", type=int, default=1,
                   help="DCP: rank r stores the blocks of this many positions numbered r mod W (default 1)")
    g.add_argument("--ep", type=int, default=None,
                   help="expert-parallel group size, divides --tp and the experts: runs of --ep consecutive ranks "
                        "split the experts, replicated once per group (default --tp)")
    g.add_argument("--collective-timeout", type=float, default=120.0,
                   help="seconds a collective may wait before the rank fails (default 120)")


def layout_of(args, rank: int = 0) -> ParallelLayout:
    ep = args.tp if getattr(args, "ep", None) is None else args.ep
    return ParallelLayout(tp=args.tp, dcp=getattr(args, "dcp", 1), ep=ep, rank=rank,
                          dcp_interleave=getattr(args, "dcp_interleave", 1))


def reap(procs, init_file: str | None = None, grace_s: float = 5.0):
    """Join rank processes, killing any still alive after `grace_s`, and remove the rendezvous file."""
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()
    if init_file and os.path.exists(init_file):
        os.unlink(init_file)


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def _backend(args) -> str:
    return "nccl" if str(getattr(args, "device", "cpu")).startswith("cuda") else "gloo"


def launch_main(args, single_rank_main) -> int:
    problems = layout_of(args).problems()
    if problems:
        print("k31c: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.tp == 1:
        return single_rank_main(args)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != args.tp:
            print(f"k31c: error: torchrun started {world} ranks, --tp is {args.tp}", file=sys.stderr)
            return 2
        timeout = datetime.timedelta(seconds=args.collective_timeout)
        dist.init_process_group(_backend(args), timeout=timeout)
        return _run_rank(args, single_rank_main, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
    return _spawn(args, single_rank_main)


# ---- one rank ---------------------------------------------------------------------------------------
def _run_rank(args, single_rank_main, rank: int, local_rank: int) -> int:
    args.parallel = layout_of(args, rank)
    if _backend(args) == "nccl":
        torch.cuda.set_device(local_rank)
        args.device = f"cuda:{local_rank}"
    quiet = contextlib.ExitStack()
    if rank:  # rank 0 speaks for the run; a failure on another rank still reports (see _child)
        quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
        quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
    code = 1
    try:
        with quiet:
            code = single_rank_main(args)
    except FollowerDone:
        code = 0
    except LayoutError as e:  # the same on every rank: rank 0 says it once, every rank exits as a usage error
        if rank == 0:
            print(f"k31c: error: {e}", file=sys.stderr, flush=True)
        code = 2
    finally:
        if rank == 0:
            try:
                stop_followers()
            except Exception as e:  # the followers are gone already: report, keep rank 0's own code
                print(f"k31c rank 0: could not release the other ranks: {e}", file=sys.stderr)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return code


def _child(rank, world, init_file, args, single_rank_main, abort, reason, timeout_s):
    def watchdog():  # polls a shared flag: an mp.Event would hang its setter on a dead waiter
        while not abort.value:
            time.sleep(0.2)
        msg = bytes(reason[:]).rstrip(b"\0").decode(errors="replace")
        print(f"k31c rank {rank}: error: {msg}", file=sys.stderr, flush=True)
        os._exit(ABORT_EXIT)

    threading.Thread(target=watchdog, daemon=True).start()
    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    try:
        dist.init_process_group(_backend(args), init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        code = _run_rank(args, single_rank_main, rank, rank)
    except BaseException as e:  # noqa: BLE001  a failing rank reports and dies; the parent aborts the rest
        if not isinstance(e, SystemExit):
            traceback.print_exc()
            print(f"k31c rank {rank}: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  file=sys.stderr, flush=True)
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cause(dead: list[tuple[int, int]]) -> tuple[int, int]:
    """(rank, exit code) that caused a failure: a signal death first, then the lowest rank."""
    return min(dead, key=lambda d: (d[1] >= 0, d[0]))


def _spawn(args, single_rank_main) -> int:
    world = args.tp
    cuda = _backend(args) == "nccl"
    ctx = mp.get_context("spawn" if cuda else "fork")
    abort = ctx.RawValue("i", 0)
    reason = ctx.RawArray("c", 512)
    fd, init_file = tempfile.mkstemp(prefix="k31c_launch_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_child, args=(r, world, init_file, args, single_rank_main, abort, reason,
                                               args.collective_timeout), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    failed, abort_at, kill_at = None, None, None
    try:
        while True:
            now = time.monotonic()
            alive = [p.is_alive() for p in procs]
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if not alive[r] and p.exitcode not in (0, None)]
            if dead and not abort.value:
                # the cause: a rank killed by a signal (the others followed it), else the lowest failed rank;
                # re-chosen until the abort, since a killed rank may be reaped after the peer it broke
                failed = _cause(dead)
                # a rank that returned an error code may be one of many reporting the same problem: let the
                # others finish on their own for SETTLE_S; a rank killed by a signal aborts the rest at once
                soon = now + (0.0 if failed[1] < 0 else SETTLE_S)
                abort_at = soon if abort_at is None else min(abort_at, soon)
            if failed is not None and not abort.value and any(alive) and now >= abort_at:
                how = f"signal {-failed[1]}" if failed[1] < 0 else f"exit code {failed[1]}"
                msg = f"rank {failed[0]} of {world} died ({how}); ending the run".encode()[:511]
                reason[:len(msg)] = msg
                abort.value = 1
                kill_at = now + ABORT_GRACE_S
            if not any(alive):
                break
            if kill_at is not None and now > kill_at:
                for p in procs:
                    if p.is_alive():
                        p.kill()
            time.sleep(0.05)
    finally:
        reap(procs, init_file)
    codes = [p.exitcode for p in procs]
    if abort.value or any(c < 0 for c in codes):
        failed = _cause([(r, c) for r, c in enumerate(codes) if c != 0])
        print(f"k31c: error: rank {failed[0]} of {world} failed (exit {failed[1]}); the run was ended on "
              f"every rank",
              file=sys.stderr)
        return 1
    # every rank ended on its own: rank 0 speaks for the run
    return codes[0] if codes[0] != 0 else next((c for c in codes if c != 0), 0)
