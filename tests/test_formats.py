"""Tests for ir/formats.py against hand-computed values and independent pure-Python decoders."""
import math
from fractions import Fraction

import pytest
import torch

from ir import formats as F

POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def code_of(x):
    return int(F.encode_e2m1(torch.tensor([x], dtype=torch.float32))[0])


def ref_e2m1_code(x: float) -> int:
    """Independent nearest-even E2M1 rounding in float64: nearest magnitude, tie -> even code."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(POS[c] - a), c % 2))
    return best | (8 if math.copysign(1.0, x) < 0 else 0)


def ref_decode_mxfp4(packed_row, scale_row):
    """Pure-Python float64 decoder: byte j -> columns 2j (low nibble), 2j+1 (high nibble)."""
    out = []
    for j, byte in enumerate(packed_row):
        s = 2.0 ** (scale_row[(2 * j) // 32] - 127)
        for nib in (byte & 0xF, byte >> 4):
            v = POS[nib & 7] * s
            out.append(-v if nib & 8 else v)
    return out


def rel_err(a, b):
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert b.abs().sum() > 0
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------------------ E2M1

def test_e2m1_values_table():
    assert F.E2M1_VALUES.dtype == torch.float32 and F.E2M1_VALUES.shape == (16,)
    assert F.E2M1_VALUES[:8].tolist() == POS
    assert F.E2M1_VALUES[8:].tolist() == [-v for v in POS]
    assert math.copysign(1.0, float(F.E2M1_VALUES[8])) == -1.0


def test_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F.decode_e2m1(codes)
    assert vals.dtype == torch.float32
    assert torch.equal(F.encode_e2m1(vals), codes)


@pytest.mark.parametrize("x,v", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0),
                                 (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)])
def test_e2m1_ties_to_even(x, v):
    assert float(F.E2M1_VALUES[code_of(x)]) == v
    assert float(F.E2M1_VALUES[code_of(-x)]) == -v


def test_e2m1_saturation_small_and_sign():
    assert code_of(7.0) == 7 and code_of(-100.0) == 15
    assert code_of(float("inf")) == 7 and code_of(float("-inf")) == 15
    assert code_of(0.2) == 0 and code_of(0.26) == 1
    assert code_of(-0.0) == 8 and code_of(-0.2) == 8 and code_of(0.0) == 0
    assert code_of(5.0001) == 7 and code_of(0.7499) == 1


def test_e2m1_matches_independent_rounding_on_random():
    g = gen(1)
    x = (torch.rand(2000, generator=g) * 16 - 8).to(torch.float64)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    x = torch.cat([x, mids, -mids, mids + 1e-12, mids - 1e-12])  # ties and near-ties in float64
    got = F.encode_e2m1(x).tolist()
    assert got == [ref_e2m1_code(v) for v in x.tolist()]
    # bf16 input goes through the same exact path
    xb = x.to(torch.bfloat16)
    assert F.encode_e2m1(xb).tolist() == [ref_e2m1_code(v) for v in xb.double().tolist()]


def test_e2m1_nan_raises():
    x = torch.rand(8, generator=gen(2))
    x[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        F.encode_e2m1(x)


def test_decode_e2m1_rejects_bad_codes():
    with pytest.raises(ValueError, match="0..15"):
        F.decode_e2m1(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        F.decode_e2m1(torch.tensor([3], dtype=torch.int64))


# --------------------------------------------------------------------------------------- nibbles

def test_pack_order_hand_written():
    assert F.pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]
    assert F.pack_nibbles(torch.tensor([[15, 0, 8, 7]], dtype=torch.uint8)).tolist() == [[0x0F, 0x78]]
    assert F.unpack_nibbles(torch.tensor([0x21, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 0, 15]


def test_pack_unpack_random_round_trip():
    c = torch.randint(0, 16, (3, 5, 64), generator=gen(3), dtype=torch.uint8)
    p = F.pack_nibbles(c)
    assert p.shape == (3, 5, 32) and p.dtype == torch.uint8
    assert torch.equal(F.unpack_nibbles(p), c)


def test_pack_odd_length_raises():
    with pytest.raises(ValueError, match=r"multiple of 2, found 3"):
        F.pack_nibbles(torch.zeros(4, 3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------ E8M0

def test_e8m0_decode_hand_values():
    d = F.decode_e8m0(torch.tensor([127, 0, 254, 255, 128, 100], dtype=torch.uint8))
    assert d.dtype == torch.float32
    assert d[0] == 1.0 and d[4] == 2.0 and d[5] == 2.0 ** -27
    assert float(d[1]) == 2.0 ** -127 and d[1] > 0
    assert float(d[2]) == 2.0 ** 127
    assert torch.isnan(d[3])


def test_e8m0_encode():
    e = torch.tensor([-127, 0, 1, 127])
    b = F.encode_e8m0(e)
    assert b.dtype == torch.uint8 and b.tolist() == [0, 127, 128, 254]
    assert F.decode_e8m0(b).double().tolist() == [2.0 ** v for v in e.tolist()]
    with pytest.raises(ValueError, match=r"\[-127, 127\].*128"):
        F.encode_e8m0(torch.tensor([128]))


# ----------------------------------------------------------------------------------------- MXFP4

@pytest.mark.parametrize("k", [-5, 0, 3])
def test_mxfp4_exact_block_scale_and_round_trip(k):
    g = gen(10 + k)
    codes = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.uint8)
    codes[:, 0::32] = 7   # +6 in every block ...
    codes[1, 32] = 15     # ... or -6
    x = F.decode_e2m1(codes) * 2.0 ** k
    packed, scales = F.quantize_mxfp4(x)
    assert packed.shape == (4, 32) and scales.shape == (4, 2) and scales.dtype == torch.uint8
    assert (scales == 127 + k).all()
    assert torch.equal(F.dequantize_mxfp4(packed, scales), x)
    assert torch.equal(F.decode_e2m1(F.unpack_nibbles(packed)).abs(), x.abs() / 2.0 ** k)


def test_mxfp4_amax_7_rounds_exponent_up_and_zero_block():
    x = torch.rand(64, generator=gen(11)) * 6 + 0.1
    x[5] = -7.0
    x[32:] = 0.0
    packed, scales = F.quantize_mxfp4(x)
    assert scales.tolist() == [127 + 1, 0]  # ceil(log2(7/6)) = 1; all-zero block -> byte 0 (2^-127)
    y = F.dequantize_mxfp4(packed, scales)
    assert float(y[5]) == -8.0  # -7/2 = -3.5 ties to -4 -> -8 (no clipping at 6)
    assert (y[32:] == 0).all()


def test_mxfp4_exponent_matches_exact_reference_and_no_clipping():
    g = gen(12)
    x = torch.randn(8, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (8, 1), generator=g).float())
    # blocks whose amax is exactly 6 * 2^k and a hair above it
    x[0, :32] = x[0, :32].clamp(-1, 1); x[0, 3] = 6 * 2.0 ** -4
    x[0, 32:64] = x[0, 32:64].clamp(-1, 1); x[0, 40] = math.nextafter(6 * 2.0 ** 2, 100.0)
    packed, scales = F.quantize_mxfp4(x)
    xb = x.reshape(8, 4, 32)
    for r in range(8):
        for b in range(4):
            amax = Fraction(float(xb[r, b].abs().max()))
            e = -127
            while amax > 6 * Fraction(2) ** e:
                e += 1
            assert int(scales[r, b]) == e + 127, (r, b, float(amax))
    y = F.dequantize_mxfp4(packed, scales)
    s = F.decode_e8m0(scales).repeat_interleave(32, dim=-1)
    assert ((y - x).abs() <= s).all()              # at most half the top spacing (2) of a block
    assert ((x / s).abs() <= 6).all()               # nothing clips
    assert rel_err(y, x) < 0.15


def test_dequantize_mxfp4_against_python_decoder():
    g = gen(13)
    packed = torch.randint(0, 256, (3, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 155, (3, 2), generator=g, dtype=torch.uint8)
    got = F.dequantize_mxfp4(packed, scales)
    assert got.shape == (3, 64)
    for r in range(3):
        ref = ref_decode_mxfp4(packed[r].tolist(), scales[r].tolist())
        assert got[r].double().tolist() == ref
    assert F.dequantize_mxfp4(packed, scales, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_gptoss_layout_matches_compressed():
    g = gen(14)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (2, 3, 4), generator=g, dtype=torch.uint8)
    packed, sc = F.gptoss_to_compressed(blocks, scales)
    assert packed.shape == (2, 3, 64) and sc.shape == (2, 3, 4)
    ref = F.dequantize_mxfp4(packed, sc)
    got = F.dequantize_mxfp4_gptoss(blocks, scales)
    assert got.shape == (2, 3, 128) and torch.equal(got, ref)
    assert got[1, 2].double().tolist() == ref_decode_mxfp4(blocks[1, 2].reshape(-1).tolist(),
                                                           scales[1, 2].tolist())
    with pytest.raises(ValueError, match=r"blocks \[\.\.\., G, 16\].*found"):
        F.gptoss_to_compressed(blocks[..., :8], scales)


def test_mxfp4_shape_errors():
    x = torch.randn(2, 48, generator=gen(15))
    with pytest.raises(ValueError, match=r"multiple of 32, found 48"):
        F.quantize_mxfp4(x)
    with pytest.raises(ValueError, match=r"found \(2, 3\)"):
        F.dequantize_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


def test_mxfp4_nan_inf_raise():
    x = torch.randn(64, generator=gen(16))
    x[7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        F.quantize_mxfp4(x)
    x[7] = float("inf")
    with pytest.raises(ValueError, match="inf"):
        F.quantize_mxfp4(x)


def test_mxfp4_pow2_is_mxfp4():
    x = torch.randn(2, 64, generator=gen(17))
    a, b = F.quantize_mxfp4_pow2(x), F.quantize_mxfp4(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------------------- NVFP4

def test_nvfp4_random_round_trip():
    x = torch.randn(16, 256, generator=gen(20)) * 3
    packed, bs, ts = F.quantize_nvfp4(x)
    assert packed.shape == (16, 128) and bs.shape == (16, 16) and bs.dtype == torch.float8_e4m3fn
    assert ts.dtype == torch.float32 and ts.dim() == 0
    assert float(ts) == pytest.approx(float(x.abs().max()) / 2688, rel=1e-6)
    y = F.dequantize_nvfp4(packed, bs, ts)
    assert rel_err(y, x) < 0.15


@pytest.mark.parametrize("ts", [1.0, 2.0 ** -4])
def test_nvfp4_exact_on_representable(ts):
    g = gen(21)
    codes = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.uint8)
    codes[:, 0::16] = 7                                    # every block has amax 6 * block_scale
    bsv = torch.rand(4, 4, generator=g) * 300 + 0.05
    bsv[0, 0] = 448.0                                      # global amax = 6 * 448 * ts
    bsv = bsv.to(torch.float8_e4m3fn).float()
    x = (F.decode_e2m1(codes).reshape(4, 4, 16) * bsv[..., None] * ts).reshape(4, 64)
    packed, bs, t = F.quantize_nvfp4(x)
    assert float(t) == ts
    assert torch.equal(bs.float(), bsv)
    assert torch.equal(F.dequantize_nvfp4(packed, bs, t), x)


def test_nvfp4_errors_and_zero_tensor():
    with pytest.raises(ValueError, match=r"multiple of 16, found 24"):
        F.quantize_nvfp4(torch.randn(2, 24, generator=gen(22)))
    x = torch.randn(32, generator=gen(23))
    x[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        F.quantize_nvfp4(x)
    packed, bs, ts = F.quantize_nvfp4(torch.zeros(2, 32))
    assert float(ts) == 1.0 and (F.dequantize_nvfp4(packed, bs, ts) == 0).all()


# ------------------------------------------------------------------------------------------- FP8

def test_fp8_known_values():
    x = torch.tensor([448.0, 1000.0, -1000.0, 0.1, 2.0 ** -9, -(2.0 ** -9), float("inf"), 449.0])
    q = F.encode_fp8_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn
    assert F.decode_fp8_e4m3(q).tolist() == [448.0, 448.0, -448.0, 0.1015625, 2.0 ** -9,
                                             -(2.0 ** -9), 448.0, 448.0]
    x = torch.rand(8, generator=gen(30))
    x[2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        F.encode_fp8_e4m3(x)


def test_fp8_pow2_hand_values():
    g = gen(31)
    x = torch.rand(5, 64, generator=g) * 2 - 1       # |x| < 1 so the planted amax is the amax
    x[0, 7] = 448.0
    x[1, 9] = -449.0
    x[2] = x[2] * 1e-6
    x[3, 0] = 448.0 * 2.0 ** -3                        # exact power-of-two ratio -> that power
    x[4] = x[4] * 1e-2
    q, s = F.quantize_fp8_pow2(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5,) and s.dtype == torch.float32
    assert s[0] == 1.0 and s[1] == 2.0 and s[3] == 2.0 ** -3
    assert float(s[2]) == 2.0 ** math.ceil(math.log2(1e-4 / 448)) == 2.0 ** -22
    amax4 = float(x[4].abs().max())
    assert float(s[4]) == 2.0 ** math.ceil(math.log2(amax4 / 448))
    m, _ = torch.frexp(s)
    assert (m == 0.5).all()                             # powers of two
    assert q.float().abs().max() <= 448
    assert float(F.decode_fp8_e4m3(q[0, 7:8])) == 448.0


def test_fp8_pow2_random_bounds_and_dequant():
    g = gen(32)
    x = torch.randn(4, 8, 128, generator=g) * torch.exp2(torch.randint(-12, 12, (4, 8, 1), generator=g).float())
    q, s = F.quantize_fp8_pow2(x)
    assert s.shape == (4, 8)
    assert torch.isfinite(q.float()).all() and (q.float().abs() <= 448).all()
    amax = x.abs().amax(-1)
    assert ((amax <= 448 * s) & (amax > 224 * s)).all()  # smallest power of two that fits
    y = F.dequantize_fp8(q, s)
    assert y.dtype == torch.float32 and rel_err(y, x) < 0.05
    xb = x.clone(); xb[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        F.quantize_fp8_pow2(xb)


# ------------------------------------------------------------------------------------- catalogue

def test_storage_formats():
    sf = F.STORAGE_FORMATS
    assert set(sf) == {"bf16", "f32", "fp8_e4m3", "mxfp4", "nvfp4"}
    assert (sf["mxfp4"].bits_per_value, sf["mxfp4"].block) == (4.25, 32)
    assert (sf["nvfp4"].bits_per_value, sf["nvfp4"].block) == (4.5, 16)
    assert (sf["bf16"].bits_per_value, sf["bf16"].block) == (16.0, None)
    assert sf["fp8_e4m3"].bits_per_value == 8.0 and sf["f32"].bits_per_value == 32.0
    with pytest.raises(Exception):
        sf["bf16"].bits_per_value = 3  # frozen
