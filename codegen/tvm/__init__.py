"""TVM kernel families for the CPU target, one per file (issue 6 item 4).

Each family writes its kernel as TIR (`from tvm.script import tirx as T`) parameterised by the
schedule knobs it declares as `Tunable`s (tile sizes, vector width, parallel split, unroll), builds it
with `tvm.compile` for the host CPU (`llvm`, `mcpu` = the host's own CPU) lazily on first use, caches the
compiled function in-process per (kernel, shape key, config), and calls it with torch tensors through
tvm-ffi (DLPack, no copies). The same `KernelTemplate` contract as the Triton families applies, so the
tuner (`k31c tune`) searches these knobs too.

Selection (`codegen/select.py`, rule in `_build.cpu_rule`): on `--target cpu`, a TVM template is chosen
for a node when the CPU bench (`benches/bench_tvm_cpu.py`) measured it faster than the torch reference
at the k31-tiny shapes; otherwise its `supports` names the measured ratio and the next template runs.

Without apache-tvm installed every family exports `TEMPLATES = []` (the Triton families still load).
"""
