"""E2M1 -> bf16 decodes of MXFP4 weights read as 16-bit words, for the grouped expert GEMMs' MMA step
(_moe_tiles._mxfp4_quarters; DEQ asm16 / asm16i, bf16 activations, CUDA only: inline PTX). Not a kernel family
(no TEMPLATES). Exactness: tests/test_moe_kernels_gpu_paths.py emulates these texts instruction by instruction on
every 16-bit word under E8M0 scales 2^-127 .. 2^127 against the float64 dequantisation.
"""

from __future__ import annotations

import triton
import triton.language as tl

# E2M1 -> bf16 on 16-bit words (DEQ asm16, pack=2): the packed weights are read as int16 elements of
# four codes each (K columns 4j .. 4j+3, code c in bits 4c..4c+3); $1 holds elements j (bits 0..15)
# and j+1 (bits 16..31), $2 the bf16x2 factors; $0 = (code c of j, code c of j+1) as bf16x2. The two
# halves are independent elements laid out alike, so ONE shift per field moves both codes into place,
# no byte permute: sign 4c+3 -> 15 and e e m 4c..4c+2 -> 8..6 of each half,
#   $0 = ((x << 12-4c) & 0x80008000 | (x << 6-4c) & 0x01C001C0) · f   (a negative shift: to the right),
# 4-5 logic instructions and one bf16x2 multiply per 2 weight elements, no byte-pair packing of the
# operand. One instance per code c (E2M1_ASM16[c]): single-result asm lets Triton move the layout
# conversion to the dot operand onto the int16 tile, so the decoded values never pass through shared
# memory. The K columns come out split four ways (4j + c); _load_bt splits the activations alike.
_SHIFT = {1: "shl", -1: "shr"}


def _e2m1_16(c: int, wide: bool) -> tl.constexpr:
    sa, sb = 12 - 4 * c, 6 - 4 * c
    sign = f"shl.b32 a, $1, {sa};\nand.b32 a, a, 0x80008000;" if sa else "and.b32 a, $1, 0x80008000;"
    mag = f"{_SHIFT[1 if sb > 0 else -1]}.b32 b, $1, {abs(sb)};\nand.b32 b, b, 0x01C001C0;"
    scale = "mov.b32 b, 0x7E807E80;\nmul.rn.bf16x2 a, a, b;\n" if wide else ""
    return tl.constexpr("{\n.reg .b32 a, b;\n" + sign + "\n" + mag + "\nor.b32 a, a, b;\n" + scale
                        + "mul.rn.bf16x2 $0, a, $2;\n}")


E2M1_ASM16 = (_E16_0, _E16_1, _E16_2, _E16_3) = tuple(_e2m1_16(c, False) for c in range(4))
E2M1_ASM16_WIDE = (_E16W_0, _E16W_1, _E16W_2, _E16W_3) = tuple(_e2m1_16(c, True) for c in range(4))


# DEQ asm16i: E2M1_ASM16 with its left shifts as multiplies by 2^n (mul.lo.u32 x, m = x << n mod 2^32), m = 2^n
# plus a zero ptxas cannot fold (%dynamic_smem_size >> 24: the launch's shared memory, < 16 MB), so the products stay
# IMADs on the FMA pipe (12% busy at T=64) instead of SHFs on the ALU pipe (63%, shared with the LOP3s); the m's
# are loop invariant (hoisted). The right shifts (codes 2 and 3's magnitudes) stay SHF. Same bits as asm16.
def _e2m1_16i(c: int, wide: bool) -> tl.constexpr:
    sa, sb = 12 - 4 * c, 6 - 4 * c
    sign = (f"add.u32 m, z, {1 << sa};\nmul.lo.u32 a, $1, m;\nand.b32 a, a, 0x80008000;" if sa
            else "and.b32 a, $1, 0x80008000;")
    mag = (f"add.u32 m, z, {1 << sb};\nmul.lo.u32 b, $1, m;" if sb > 0 else f"shr.b32 b, $1, {-sb};"
           ) + "\nand.b32 b, b, 0x01C001C0;"
    scale = "mov.b32 b, 0x7E807E80;\nmul.rn.bf16x2 a, a, b;\n" if wide else ""
    return tl.constexpr("{\n.reg .b32 a, b, m, z;\nmov.u32 z, %dynamic_smem_size;\nshr.u32 z, z, 24;\n" + sign
                        + "\n" + mag + "\nor.b32 a, a, b;\n" + scale + "mul.rn.bf16x2 $0, a, $2;\n}")


E2M1_ASM16I = (_E16I_0, _E16I_1, _E16I_2, _E16I_3) = tuple(_e2m1_16i(c, False) for c in range(4))
E2M1_ASM16I_WIDE = (_E16IW_0, _E16IW_1, _E16IW_2, _E16IW_3) = tuple(_e2m1_16i(c, True) for c in range(4))


@triton.jit
def _asm_code(q, f, A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr, C: tl.constexpr):
    """Code C of every int16 element of q, times f (bf16), by the PTX A_C of four (one per code position)."""
    if C == 0:
        return tl.inline_asm_elementwise(A0, "=r,r,r", [q, f], dtype=tl.bfloat16, is_pure=True, pack=2)
    elif C == 1:
        return tl.inline_asm_elementwise(A1, "=r,r,r", [q, f], dtype=tl.bfloat16, is_pure=True, pack=2)
    elif C == 2:
        return tl.inline_asm_elementwise(A2, "=r,r,r", [q, f], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(A3, "=r,r,r", [q, f], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _asm16(q, f, C: tl.constexpr, WIDE: tl.constexpr, IMAD: tl.constexpr):
    """Code C of every int16 element of q, times f (bf16): E2M1_ASM16[C], or E2M1_ASM16I[C] (IMAD: the left shifts
    as multiplies); their _WIDE forms when WIDE."""
    if IMAD:
        if WIDE:
            return _asm_code(q, f, _E16IW_0, _E16IW_1, _E16IW_2, _E16IW_3, C)
        else:
            return _asm_code(q, f, _E16I_0, _E16I_1, _E16I_2, _E16I_3, C)
    else:
        if WIDE:
            return _asm_code(q, f, _E16W_0, _E16W_1, _E16W_2, _E16W_3, C)
        else:
            return _asm_code(q, f, _E16_0, _E16_1, _E16_2, _E16_3, C)
