"""`python -m codegen.aot build|show ARTIFACT`: build an artifact's Triton binaries, or list and verify them.

    python -m codegen.aot build build/tiny-h200 [--aot-triton DIR] [--aot-dtypes bf16,fp32]
                                   [--aot-workload '[{"prompts": [5], "decode": 3}]'] [--aot-timeout 3600]
    python -m codegen.aot show build/tiny-h200     # per arch: Triton version, kernels, integrity, this machine
"""

from __future__ import annotations

import argparse
import json
import sys

from .build import DEFAULT_DTYPES, build_binaries
from .loader import live_problems, live_target, stored_archs
from .store import AOTError, arch_dir, read_index, verify_files
from .workload import DEFAULT_WORKLOAD


def add_build_args(p: argparse.ArgumentParser):
    """The AOT options (also meant for `k31c compile --aot`)."""
    p.add_argument("--aot-triton", default=None, metavar="DIR",
                   help="compile with the Triton installed under DIR (the deployment's version; default: this one)")
    p.add_argument("--aot-dtypes", default=",".join(DEFAULT_DTYPES), help="compute dtypes to build for (bf16,fp32)")
    p.add_argument("--aot-workload", default=None, help="JSON list of scenarios {prompts, decode, verify} to record")
    p.add_argument("--aot-timeout", type=float, default=3600, help="time limit of the build subprocess, seconds")


def run_build(artifact: str, args) -> int:
    workload = json.loads(args.aot_workload) if args.aot_workload else DEFAULT_WORKLOAD
    dtypes = tuple(d.strip() for d in args.aot_dtypes.split(",") if d.strip())
    rep = build_binaries(artifact, workload=workload, dtypes=dtypes, triton_path=args.aot_triton,
                         timeout_s=args.aot_timeout)
    print(rep.text())
    return 1 if rep.errors else 0


def show(artifact: str) -> int:
    import triton

    archs = stored_archs(artifact)
    if not archs:
        print(f"{artifact}: no Triton binaries (kernels/bin/ is empty)")
        return 1
    rc = 0
    for arch in archs:
        folder = arch_dir(artifact, arch)
        idx = read_index(folder)
        bad = verify_files(folder, idx)
        names = sorted({k["name"] for k in idx["kernels"]})
        print(f"{arch}: {len(idx['kernels'])} binaries of {len(names)} kernels, Triton {idx['triton']['version']}, "
              f"target {idx['target']['name']}, dtypes {idx['dtypes']}, {len(idx['errors'])} build failures, "
              f"{'integrity ok' if not bad else f'{len(bad)} files rejected'}")
        for p in bad:
            print(f"  - {p}")
        rc |= bool(bad)
    here = live_problems(artifact, live_target(), triton.__version__)
    print("this machine: " + ("runs them" if not here else "; ".join(here)))
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.aot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the artifact's Triton binaries for its target")
    b.add_argument("artifact")
    add_build_args(b)
    s = sub.add_parser("show", help="list and verify the stored binaries")
    s.add_argument("artifact")
    args = ap.parse_args(argv)
    try:
        return run_build(args.artifact, args) if args.cmd == "build" else show(args.artifact)
    except AOTError as e:
        print(f"aot: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
