"""The built-in hardware table: one plain dict per target, every figure with its source.

Units: bytes, bytes/s, FLOP/s (dense, no 2:4 sparsity). `link_bandwidth` is per device and per
direction (vendors quote the bidirectional total: NVLink 5 "1.8 TB/s" is 0.9 TB/s each way).
Where a vendor quotes a rack or board total, the per-device figure is that total divided by the
device count, as the comment says. Figures no vendor has published are marked "estimate" in a
comment AND listed under `estimates`, so `k31c explain` can flag them. `measured` holds figures
read on this project's own machines; the cost model prefers them to datasheet peaks.

Backends: `triton-nvidia:<arch>`, `triton-amd:<arch>`, `tvm:<kind>`, `triton-interpreter`;
an empty list means "plan only": the planner works, no kernel is built (DESIGN §5 T13).
Each dict goes through the same validator as a user's `--target-file` JSON (`k31c.targets`).
"""

from __future__ import annotations

GB = 10**9  # vendors quote decimal GB and TB/s
TB = 10**12
MiB = 2**20
TFLOPS = 10**12
PFLOPS = 10**15

TARGET_SPECS: dict[str, dict] = {
    # ---- NVIDIA Hopper ------------------------------------------------------------------------
    "h100": dict(
        vendor="NVIDIA", description="NVIDIA H100 SXM5 80GB (Hopper) in an HGX H100 8-GPU board",
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5 column)",
        memory_bytes=80 * GB,  # datasheet: 80 GB HBM3 (nvidia-smi shows 81,559 MiB; we keep the datasheet figure)
        hbm_bandwidth=3.35 * TB,  # datasheet: 3.35 TB/s
        compute_units=132, compute_unit_kind="SM",  # datasheet / CUDA: 132 SMs on the SXM5 part
        peak_flops={"fp32": 67 * TFLOPS,  # datasheet: FP32 67 TFLOPS
                    "bf16": 989 * TFLOPS,  # datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense
                    "fp8": 1979 * TFLOPS},  # datasheet: FP8 Tensor Core 3,958 with sparsity -> 1,979 dense
        native_formats=["fp8"],  # Hopper tensor cores: FP8 e4m3/e5m2; no FP4
        link_bandwidth=450 * GB,  # datasheet: NVLink 900 GB/s bidirectional -> 450 GB/s per direction
        scaleup_size=8, topology="NVLink 4 + NVSwitch, 8 GPUs per HGX board",  # HGX H100 8-GPU
        backends=["triton-nvidia:sm_90a", "tvm:cuda"],  # TOOLCHAIN.md: Triton AOT for sm_90a works
        device_names=["H100"],
    ),
    "h200": dict(
        vendor="NVIDIA", description="NVIDIA H200 SXM 141GB (Hopper) in an HGX H200 8-GPU board",
        source="NVIDIA H200 Tensor Core GPU datasheet; measured: shared/TOOLCHAIN.md, .library/device/KINDS.md",
        memory_bytes=143771 * MiB,  # measured: nvidia-smi 143,771 MiB (KINDS.md); datasheet "141 GB"
        hbm_bandwidth=4.8 * TB,  # datasheet: 4.8 TB/s HBM3e
        compute_units=132, compute_unit_kind="SM",  # measured: torch reports 132 SMs (TOOLCHAIN.md, KINDS.md)
        peak_flops={"fp32": 67 * TFLOPS,  # datasheet: FP32 67 TFLOPS (same chip as H100 SXM)
                    "bf16": 989 * TFLOPS,  # datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense
                    "fp8": 1979 * TFLOPS},  # datasheet: FP8 3,958 TFLOPS with sparsity -> 1,979 dense
        measured={"hbm_bandwidth": 4.2 * TB,  # TOOLCHAIN.md: copy and read 4.2 TB/s (KINDS.md: ~4.3)
                  "bf16": 779 * TFLOPS,  # TOOLCHAIN.md: bf16 matmul 8192^3, 779 TFLOP/s
                  "fp8": 1337 * TFLOPS},  # TOOLCHAIN.md: fp8 matmul 8192^3, 1,337 TFLOP/s
        native_formats=["fp8"],  # Hopper: FP8 only
        link_bandwidth=450 * GB,  # datasheet: NVLink 900 GB/s bidirectional -> 450 GB/s per direction
        scaleup_size=8, topology="NVLink 4 + NVSwitch, 8 GPUs per HGX board",  # HGX H200 8-GPU
        backends=["triton-nvidia:sm_90a", "tvm:cuda"],  # measured: Triton 3.6 kernels run on the H200 machine
        device_names=["H200"],
    ),
    # ---- NVIDIA Blackwell ---------------------------------------------------------------------
    "b200": dict(
        vendor="NVIDIA", description="NVIDIA B200 (Blackwell) in an HGX B200 8-GPU board",
        source="NVIDIA HGX B200 / DGX B200 datasheets (8-GPU totals / 8)",
        memory_bytes=180 * GB,  # DGX B200: 1,440 GB total GPU memory / 8
        hbm_bandwidth=8 * TB,  # DGX B200: 64 TB/s HBM3e / 8
        compute_units=148, compute_unit_kind="SM",  # NVIDIA Blackwell architecture brief: 148 SMs (B200)
        peak_flops={"fp32": 75 * TFLOPS,  # HGX B200: FP32 600 TFLOPS / 8
                    "bf16": 2.25 * PFLOPS,  # HGX B200: FP16/BF16 36 PFLOPS with sparsity / 8 / 2
                    "fp8": 4.5 * PFLOPS,  # HGX B200: FP8 72 PFLOPS with sparsity / 8 / 2
                    "mxfp4": 9 * PFLOPS, "nvfp4": 9 * PFLOPS},  # HGX B200: FP4 144 PFLOPS sparse / 8 / 2
        native_formats=["fp8", "mxfp4", "nvfp4"],  # Blackwell tcgen05: MXFP8/6/4 and NVFP4 block scaling
        link_bandwidth=900 * GB,  # datasheet: NVLink 5 1.8 TB/s bidirectional per GPU -> 900 GB/s per direction
        scaleup_size=8, topology="NVLink 5 + NVSwitch, 8 GPUs per HGX board",  # HGX B200: 8 GPUs, NVLink Switch
        backends=["triton-nvidia:sm_100a", "tvm:cuda"],  # TOOLCHAIN.md: Triton AOT for sm_100a (tcgen05) works
        device_names=["B200"],
    ),
    "b300": dict(
        vendor="NVIDIA", description="NVIDIA B300 (Blackwell Ultra) in an HGX B300 8-GPU board",
        source="NVIDIA HGX B300 datasheet (8-GPU totals / 8)",
        memory_bytes=288 * GB,  # HGX B300: 2.3 TB total / 8 (288 GB HBM3e per GPU)
        hbm_bandwidth=8 * TB,  # HGX B300: 64 TB/s total / 8
        compute_units=160, compute_unit_kind="SM",  # NVIDIA Blackwell Ultra technical blog: 160 SMs
        peak_flops={"fp32": 75 * TFLOPS,  # HGX B300: FP32 600 TFLOPS / 8
                    "bf16": 2.25 * PFLOPS,  # HGX B300: FP16/BF16 36 PFLOPS with sparsity / 8 / 2
                    "fp8": 4.5 * PFLOPS,  # HGX B300: FP8 72 PFLOPS with sparsity / 8 / 2
                    "mxfp4": 13.5 * PFLOPS, "nvfp4": 13.5 * PFLOPS},  # HGX B300: FP4 108 PFLOPS dense / 8
        native_formats=["fp8", "mxfp4", "nvfp4"],
        link_bandwidth=900 * GB,  # NVLink 5: 1.8 TB/s bidirectional per GPU
        scaleup_size=8, topology="NVLink 5 + NVSwitch, 8 GPUs per HGX board",  # HGX B300: 8 GPUs, NVLink Switch
        backends=["triton-nvidia:sm_103a", "tvm:cuda"],  # TOOLCHAIN.md: Triton AOT for sm_103a works
        device_names=["B300"],
    ),
    "gb300": dict(
        vendor="NVIDIA", description="NVIDIA GB300 (Blackwell Ultra GPU of a Grace Blackwell Ultra superchip), "
                                     "GB300 NVL72 rack",
        source="NVIDIA GB300 NVL72 datasheet (72-GPU totals / 72)",
        memory_bytes=288 * GB,  # GB300 NVL72: up to 20.7 TB HBM3e / 72 = 288 GB per GPU
        hbm_bandwidth=8 * TB,  # GB300 NVL72: up to 576 TB/s / 72
        compute_units=160, compute_unit_kind="SM",  # NVIDIA Blackwell Ultra technical blog: 160 SMs
        peak_flops={"fp32": 80 * TFLOPS,  # GB300 NVL72: FP32 5,760 TFLOPS / 72
                    "bf16": 2.5 * PFLOPS,  # GB300 NVL72: FP16/BF16 360 PFLOPS with sparsity / 72 / 2
                    "fp8": 5 * PFLOPS,  # GB300 NVL72: FP8 720 PFLOPS with sparsity / 72 / 2
                    "mxfp4": 15 * PFLOPS, "nvfp4": 15 * PFLOPS},  # GB300 NVL72: FP4 1,080 PFLOPS dense / 72
        native_formats=["fp8", "mxfp4", "nvfp4"],
        link_bandwidth=900 * GB,  # GB300 NVL72: 130 TB/s NVLink / 72 = 1.8 TB/s bidirectional per GPU
        scaleup_size=72,  # GB300 NVL72 datasheet: 72 GPUs in one NVLink domain
        topology="NVLink 5 switch tray fabric, 72 GPUs in one NVLink domain (NVL72)",
        backends=["triton-nvidia:sm_103a", "tvm:cuda"],  # TOOLCHAIN.md: Triton AOT for sm_103a works
        device_names=["GB300"],
    ),
    # ---- NVIDIA Rubin -------------------------------------------------------------------------
    "rubin": dict(
        vendor="NVIDIA", description="NVIDIA Rubin GPU in a Vera Rubin NVL72 rack",
        source="NVIDIA Vera Rubin NVL72 announcement (CES 2026); most per-format rates unpublished",
        memory_bytes=288 * GB,  # announcement: 288 GB HBM4 per GPU
        hbm_bandwidth=22 * TB,  # announcement: up to 22 TB/s HBM4 per GPU
        compute_units=224, compute_unit_kind="SM",  # estimate: SM count not published
        peak_flops={"bf16": 8 * PFLOPS,  # estimate: not published; assumed fp8 / 2
                    "fp8": 16 * PFLOPS,  # estimate: not published; assumed NVFP4 inference rate / ~3 (as GB300)
                    "mxfp4": 50 * PFLOPS, "nvfp4": 50 * PFLOPS},  # announcement: NVFP4 inference 50 PFLOPS
        native_formats=["fp8", "mxfp4", "nvfp4"],  # announcement: NVFP4 tensor cores (Blackwell formats kept)
        link_bandwidth=1800 * GB,  # announcement: NVLink 6, 3.6 TB/s per GPU bidirectional
        scaleup_size=72,  # announcement: Vera Rubin NVL72, 72 GPU packages per NVLink domain
        topology="NVLink 6 switch fabric, 72 GPUs in one NVLink domain",
        backends=[],  # no Rubin target in Triton 3.6/3.7 or TVM 0.27: plan only
        device_names=["Rubin"],
        estimates=["compute_units", "peak_flops.bf16", "peak_flops.fp8"],
    ),
    # ---- AMD ----------------------------------------------------------------------------------
    "mi355x": dict(
        vendor="AMD", description="AMD Instinct MI355X (CDNA 4) on an 8-GPU UBB platform",
        source="AMD Instinct MI355X datasheet",
        memory_bytes=288 * GB,  # datasheet: 288 GB HBM3E
        hbm_bandwidth=8 * TB,  # datasheet: 8 TB/s
        compute_units=256, compute_unit_kind="CU",  # datasheet: 256 compute units
        peak_flops={"fp32": 157.3 * TFLOPS,  # datasheet: FP32 vector 157.3 TFLOPS
                    "bf16": 2.5 * PFLOPS,  # datasheet: FP16/BF16 matrix 2.5 PFLOPS (dense)
                    "fp8": 5 * PFLOPS,  # datasheet: FP8 5.0 PFLOPS (dense)
                    "mxfp4": 10 * PFLOPS},  # datasheet: MXFP6/MXFP4 10 PFLOPS (dense)
        native_formats=["fp8", "mxfp4"],  # CDNA 4: FP8 (OCP), MXFP8/6/4; no NVFP4 (E4M3 block scales)
        link_bandwidth=537.6 * GB,  # datasheet: Infinity Fabric 7 links x 153.6 GB/s = 1,075 GB/s bidirectional
        scaleup_size=8, topology="Infinity Fabric all-to-all, 8 GPUs per UBB platform",  # AMD: 8-GPU UBB 2.0 platform
        backends=["triton-amd:gfx950", "tvm:rocm"],  # TOOLCHAIN.md: Triton AOT for gfx950 works
        device_names=["MI355X", "MI355"],
    ),
    # ---- Google TPU ---------------------------------------------------------------------------
    "tpu-v7x": dict(
        vendor="Google", description="Google TPU v7x (Ironwood) chip",
        source="Google Cloud TPU7x (Ironwood) documentation and announcement (2025)",
        memory_bytes=192 * GB,  # Google: 192 GB HBM per chip
        hbm_bandwidth=7.37 * TB,  # Google: 7.37 TB/s per chip
        compute_units=2, compute_unit_kind="TensorCore",  # Google TPU7x docs: 2 TensorCores per chip
        core_kinds={"TensorCore": 2,  # Google TPU7x docs: dense matrix units (MXUs) live in the TensorCores
                    "SparseCore": 4},  # Google TPU7x docs: 4 SparseCores per chip (gathers, embeddings, top-k)
        peak_flops={"bf16": 2307 * TFLOPS,  # Google TPU7x docs: BF16 2,307 TFLOPS per chip
                    "fp8": 4614 * TFLOPS},  # Google: FP8 4,614 TFLOPS per chip
        native_formats=["fp8"],  # Ironwood: native FP8; no FP4 formats announced
        link_bandwidth=600 * GB,  # Google: ICI 1.2 TB/s bidirectional per chip
        scaleup_size=9216,  # Google: Ironwood pods of up to 9,216 chips on ICI
        topology="ICI 3D torus (4x4x4 cubes), up to 9,216 chips per pod via optical switches",
        backends=[],  # no Triton/TVM backend for TPU in this toolchain (XLA/Pallas not used): plan only
        device_names=["TPU v7", "TPU7x"],
    ),
    # ---- T-Head (Alibaba) PPU -----------------------------------------------------------------
    "ppu-810e": dict(
        vendor="T-Head (Alibaba)", description="T-Head Zhenwu PPU 810E",
        source="press reports on the Zhenwu 810E (2025); no public datasheet",
        memory_bytes=96 * GB,  # press: 96 GB HBM2e
        hbm_bandwidth=2.8 * TB,  # estimate: HBM2e, 6 stacks x ~0.46 TB/s; not published
        compute_units=None, compute_unit_kind="core",  # not published
        peak_flops={"bf16": 150 * TFLOPS},  # estimate: press compares it to NVIDIA H20 (148 TFLOPS BF16)
        native_formats=[],  # estimate: FP8 support not published; treated as absent
        link_bandwidth=350 * GB,  # press: 700 GB/s inter-chip bandwidth (taken as bidirectional)
        scaleup_size=8, topology="estimate: 8 PPUs per server on the inter-chip network",  # estimate: not published
        backends=[],  # no Triton/TVM backend for the PPU in this toolchain: plan only
        device_names=["PPU"],
        estimates=["hbm_bandwidth", "peak_flops.bf16", "native_formats", "scaleup_size"],
    ),
    "ppu-m890": dict(
        vendor="T-Head (Alibaba)", description="T-Head Zhenwu PPU M890",
        source="press reports on the Zhenwu M890; no public datasheet",
        memory_bytes=144 * GB,  # press: 144 GB HBM
        hbm_bandwidth=4 * TB,  # estimate: not published
        compute_units=None, compute_unit_kind="core",  # not published
        peak_flops={"bf16": 450 * TFLOPS,  # estimate: press "about 3x the 810E"
                    "fp8": 900 * TFLOPS},  # estimate: 2x bf16 as on other FP8 parts
        native_formats=["fp8"],  # estimate: not published
        link_bandwidth=400 * GB,  # press: 800 GB/s inter-chip bandwidth (taken as bidirectional)
        scaleup_size=16, topology="estimate: 16 PPUs per supernode group",  # estimate: not published
        backends=[],  # no Triton/TVM backend for the PPU in this toolchain: plan only
        device_names=["PPU"],
        estimates=["hbm_bandwidth", "peak_flops.bf16", "peak_flops.fp8", "native_formats", "scaleup_size"],
    ),
    # ---- CPU (CI and local development) -------------------------------------------------------
    "cpu": dict(
        vendor="any", description="host CPU: reference interpreter, Triton interpreter, TVM llvm",
        source="shared/DESIGN.md §8 (the CI machine: 2 cores, 24 GiB)",
        memory_bytes=24 * 2**30,  # DESIGN.md §8: 24 GiB on the CI machine
        hbm_bandwidth=20 * GB,  # estimate: DDR4/5 dual channel, not measured
        compute_units=2, compute_unit_kind="core",  # DESIGN.md §8: 2 cores
        peak_flops={"fp32": 100 * 10**9, "bf16": 100 * 10**9},  # estimate: 2 AVX2/AVX-512 cores, not measured
        native_formats=[],  # every format is emulated (exactly) by the reference and the interpreter
        emulates_all_formats=True,
        link_bandwidth=10 * GB,  # estimate: gloo over shared memory/loopback, not measured
        scaleup_size=8, topology="gloo processes on one host (tests use 2, 4 and 8)",  # tests/ use up to 8 processes
        backends=["triton-interpreter", "tvm:llvm"],  # TOOLCHAIN.md: interpreter (fp32) and TVM llvm builds
        device_names=[],
        estimates=["hbm_bandwidth", "peak_flops.fp32", "peak_flops.bf16", "link_bandwidth"],
    ),
}
