"""Ahead-of-time Triton binaries in the artifact (issue 6 item 5).

Build (any machine, no GPU needed; runs in a subprocess with a time-out):

    from codegen.aot import build_binaries
    print(build_binaries("build/tiny-h200", triton_path=None).text())
    # or: python -m codegen.aot build build/tiny-h200 [--aot-triton DIR] [--dtypes bf16,fp32]

records every Triton specialisation the artifact's selected kernels launch (its configs, operand
dtypes, shapes, integer/alignment specialisations) over a workload of prefill/decode/verify steps,
compiles each for the target's architecture (sm_90a, sm_100a, sm_103a, gfx950, ...) and stores the
binaries + PTX/AMDGCN + Triton's metadata under `kernels/bin/<arch>/` with `index.json` (store.py).

Run (the live GPU):

    from codegen.aot import use_binaries
    with use_binaries("build/tiny-h200") as stats:   # AOTError if arch or Triton version differ
        ...run the artifact...
    stats.summary()   # binaries loaded, JIT compiles (0 unless jit_fallback=True and a miss)

Modules: record.py (specialisations from Triton's own JIT path, with a fake driver), worker.py (the
subprocess), build.py (driver, time-out, store install, manifest refresh), store.py (index, sha256,
ELF arch check), loader.py (the runtime hook), probe.py (a GEMM + KDA-gate launch set).
"""

from .build import DEFAULT_DTYPES, DEFAULT_WORKLOAD, AOTTimeout, BuildReport, build_binaries, compile_callable
from .loader import (BinaryStats, install, installed_summary, live_problems, live_target, stored_archs, uninstall,
                     use_binaries)
from .store import AOTError, embedded_arch, read_index, triton_target, verify_files

__all__ = ["AOTError", "AOTTimeout", "BinaryStats", "BuildReport", "DEFAULT_DTYPES", "DEFAULT_WORKLOAD",
           "build_binaries", "compile_callable", "embedded_arch", "install", "installed_summary", "live_problems",
           "live_target", "read_index", "stored_archs", "triton_target", "uninstall", "use_binaries", "verify_files"]
