"""Each FP8 recipe's quantization bit for bit against tests/fp8_reference.py (written from the
definitions), on adversarial tensors: zeros, fp32 and FP8 subnormals, values at and past the
format's max, +-Inf, NaN, round-to-even ties, powers of two (MX scales)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from npuspeed.ops.fp8 import E4M3, E5M2, Fp8Recipe
from npuspeed.ops.fp8.blockwise import quantize_blockwise
from npuspeed.ops.fp8.delayed import DelayedScaling
from npuspeed.ops.fp8.mxfp8 import quantize_mxfp8
from npuspeed.ops.fp8.tensorwise import quantize_tensorwise, quantize_with_scale
from tests import fp8_reference as ref

FORMATS = [E4M3, E5M2]


def _bits(q):
    """uint8 codes with every NaN as 0x7F (the reference's canonical NaN)."""
    b = q.view(torch.uint8).clone()
    b[torch.isnan(q.float())] = 0x7F
    return b.flatten().tolist()


def _adversarial(fmt, n=300, seed=0):
    """A tensor holding every special value next to random ones over many binades."""
    g = torch.Generator().manual_seed(seed)
    special = [0.0, -0.0, 1e-45, -1e-40, 2.0 ** -126, fmt.max, -fmt.max, fmt.max * 1.03,
               fmt.max * 1.0625, 1e30, -3.4e38, 1.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -11,
               fmt.min_subnormal, fmt.min_subnormal / 2, fmt.min_subnormal * 1.5, 2.0 ** -20]
    rand = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    return torch.cat([torch.tensor(special), rand]).float()


def _grid_values(fmt):
    """Every fp8 value, its midpoints to the next one (ties), and just around them."""
    vals = [ref.decode(b, fmt.name) for b in range(256)]
    pos = sorted(v for v in vals if math.isfinite(v) and v >= 0)
    mids = [(a + b) / 2 for a, b in zip(pos, pos[1:])]
    near = [np.nextafter(np.float32(m), np.float32(np.inf)) for m in mids] + \
           [np.nextafter(np.float32(m), np.float32(0)) for m in mids]
    out = pos + mids + [float(v) for v in near]
    return torch.tensor(out + [-v for v in out], dtype=torch.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_cast_rounds_to_nearest_even_and_saturates(fmt):
    x = torch.cat([_grid_values(fmt), torch.tensor([fmt.max * 2, float("inf"), float("-inf"), float("nan")])])
    q = quantize_with_scale(x, torch.tensor(1.0), fmt)
    assert _bits(q.data) == ref.quantize_values(x.tolist(), [1.0] * len(x), fmt.name)
    assert int(q.saturated) == 3  # 2*max, +Inf, -Inf (never NaN), and nothing else
    assert float(q.scale_inv) == 1.0


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("case", ["mixed", "zeros", "with_inf", "with_nan", "tiny", "exact_max"])
def test_tensorwise_matches_definition(fmt, case):
    x = _adversarial(fmt)
    if case == "zeros":
        x = torch.zeros(64)
    elif case == "with_inf":
        x[5] = float("inf")
    elif case == "with_nan":
        x[7] = float("nan")
    elif case == "tiny":
        x = torch.tensor([1e-45, -3e-45, 0.0, 1e-44])   # scale overflows fp32 -> fp32 max
    elif case == "exact_max":
        x = _grid_values(fmt)                            # amax == max: scale exactly 1
    q = quantize_tensorwise(x, fmt)
    values = x.tolist()
    scale = ref.te_current_scale(ref.f32(ref.amax_ignoring_nan(values)), fmt.max)
    assert float(q.scale_inv) == float(np.float32(1) / np.float32(scale))
    assert _bits(q.data) == ref.quantize_values(values, [scale] * len(values), fmt.name)
    if case == "tiny":
        assert scale == ref.F32_MAX


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("history_len,algo,margin", [(1, "most_recent", 0), (4, "max", 0),
                                                     (3, "most_recent", 2), (2, "max", 1)])
def test_delayed_matches_definition(fmt, history_len, algo, margin):
    g = torch.Generator().manual_seed(history_len)
    scaler = DelayedScaling(fmt, margin=margin, history_len=history_len, algo=algo)
    model = ref.DelayedReference(fmt.max, margin, history_len, algo)
    mags = [1.0, 30.0, 0.01, 0.0, 5.0, 1e4, 2.0, 2.0]     # rises, falls, a zero step keeps the scale
    for step, mag in enumerate(mags):
        x = torch.randn(200, generator=g) * mag
        if step == 6:
            x[3] = float("inf")                            # an Inf amax keeps the scale
        scale = model.step(x.tolist())
        q = scaler.quantize(x)
        assert float(q.scale_inv) == float(np.float32(1) / np.float32(scale)), step
        assert _bits(q.data) == ref.quantize_values(x.tolist(), [scale] * len(x), fmt.name), step


@pytest.mark.parametrize("fmt,below,at", [(E4M3, [448.5, 463.9, 464.0], [464.01, 500.0]),
                                          (E5M2, [57345.0, 61439.0], [61440.0, 70000.0])])
def test_saturation_counts_only_what_the_clamp_changed(fmt, below, at):
    """Past max but rounding to max anyway is not saturation; the RNE tie at the midpoint goes
    to the even neighbour (448 for E4M3, 65536 -> clamped for E5M2)."""
    x = torch.tensor(below + at + [float("inf"), float("nan")])
    q = quantize_with_scale(x, torch.tensor(1.0), fmt)
    assert int(q.saturated) == len(at) + 1
    assert _bits(q.data) == ref.quantize_values(x.tolist(), [1.0] * len(x), fmt.name)


def test_delayed_saturates_when_amax_grows():
    scaler = DelayedScaling(E4M3, history_len=1)
    scaler.quantize(torch.full((8,), 1.0))        # next scale: 448
    q = scaler.quantize(torch.tensor([1.0, 2.0, -3.0, 0.5]))
    assert int(q.saturated) == 2 and q.data.float().abs().max() == 448  # 1*448 is max, not past it


def _blocks(rows, cols, br, bc):
    for r0 in range(0, rows, br):
        for c0 in range(0, cols, bc):
            yield slice(r0, min(r0 + br, rows)), slice(c0, min(c0 + bc, cols))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("block,shape", [((1, 128), (5, 300)), ((128, 128), (130, 260))])
def test_blockwise_matches_definition(fmt, block, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, shape, generator=g).float())
    x[0, :128] = 0.0                                     # an all-zero block: scale 1
    x[1, 3] = float("nan")
    x[2, 200] = float("inf")                             # its block: scale 1, Inf saturates
    x[3, 130] = 1e-44                                    # a block of one fp32 subnormal
    x[3, 131:256] = 0.0
    x[4, 1] = fmt.max * 3
    x[-1, -1] = -fmt.max                                 # a partial edge block
    q = quantize_blockwise(x, fmt, block)
    xn = x.numpy()
    for bi, (rs, cs) in enumerate(_blocks(*shape, *block)):
        vals = xn[rs, cs].flatten().tolist()
        scale = ref.te_current_scale(ref.f32(ref.amax_ignoring_nan(vals)), fmt.max, pow2=True)
        r, c = rs.start // block[0], cs.start // block[1]
        assert float(q.scale_inv[r, c]) == 1.0 / scale, (r, c)
        got = _bits(q.data[rs, cs])
        assert got == ref.quantize_values(vals, [scale] * len(vals), fmt.name), (r, c)
    assert torch.equal(q.dequantize()[x.isfinite()], (q.data.float() * q.expanded_scale_inv())[x.isfinite()])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_mxfp8_matches_ocp_definition(fmt):
    g = torch.Generator().manual_seed(2)
    rows, cols = 6, 200                                   # 200 = 6 blocks of 32 + a partial one
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-60, 60, (rows, cols), generator=g).float())
    x[0, :32] = 0.0                                       # zero block: X = 2**-127
    x[0, 32:64] = 2.0 ** torch.arange(-16, 16).float()   # powers of two: amax 2**15
    x[1, :32] = 1e-44                                     # fp32 subnormals: X clamps at 2**-127
    x[1, 40] = float("inf")                               # Inf block: NaN scale
    x[2, 70] = float("nan")                               # NaN ignored by the amax, stays NaN
    x[3, :32] = 3.0e38                                    # near fp32 max: X = 2**(127 - emax)
    x[4, :32] = torch.linspace(-fmt.max, fmt.max, 32) * 2.0 ** 5   # amax 448*32: top binade saturates
    q = quantize_mxfp8(x, fmt)
    e8m0 = q.scale_e8m0.view(torch.uint8)
    xn = x.numpy()
    for rs, cs in _blocks(rows, cols, 1, 32):
        vals = xn[rs, cs].flatten().tolist()
        r, c = rs.start, cs.start // 32
        exp = ref.mx_block_exponent(vals, fmt.name)
        got = _bits(q.data[rs, cs])
        if exp is None:
            assert int(e8m0[r, c]) == 0xFF and math.isnan(float(q.scale_inv[r, c]))
            assert all(b == 0x7F for b in got)
            continue
        assert int(e8m0[r, c]) == exp + 127, (r, c)
        assert float(q.scale_inv[r, c]) == 2.0 ** exp
        assert got == ref.quantize_values(vals, [2.0 ** -exp] * len(vals), fmt.name), (r, c)
    assert int(e8m0[0, 0]) == 0 and int(e8m0[0, 1]) == 15 - fmt.emax + 127


def test_mx_scale_decodes_with_torch_e8m0():
    """torch.float8_e8m0fnu reads our scale bytes as the same powers of two."""
    x = torch.randn(4, 64) * 1e3
    q = quantize_mxfp8(x, E4M3)
    assert torch.equal(q.scale_e8m0.float(), q.scale_inv)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8"])
def test_hybrid_uses_e5m2_for_gradients_only(recipe):
    r = Fp8Recipe(recipe, fp8_format="hybrid")
    st = r.new_state()
    x = torch.randn(4, 128)
    assert r.quantize(x, "input", st).data.dtype == torch.float8_e4m3fn
    assert r.quantize(x, "weight", st).data.dtype == torch.float8_e4m3fn
    assert r.quantize(x, "grad_output", st).data.dtype == torch.float8_e5m2
    r = Fp8Recipe(recipe, fp8_format="e4m3")
    assert r.quantize(x, "grad_output", r.new_state()).data.dtype == torch.float8_e4m3fn


def test_bad_recipe_values_are_one_line():
    for kwargs, flag in [({"recipe": "nvfp4"}, "--fp8-recipe"), ({"fp8_format": "e5m2"}, "--fp8-format"),
                         ({"amax_compute_algo": "mean"}, "--fp8-amax-compute-algo"),
                         ({"amax_history_len": 0}, "--fp8-amax-history-len")]:
        with pytest.raises(ValueError, match=flag) as err:
            Fp8Recipe(**kwargs)
        assert "\n" not in str(err.value)


def test_delayed_state_resumes_bitwise():
    """Saved mid-run and loaded into a fresh scaler, the amax history and scale continue as if uninterrupted."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(64, generator=g) * m for m in (1.0, 8.0, 0.5, 3.0, 40.0, 2.0)]
    straight = DelayedScaling(E5M2, margin=1, history_len=3, algo="max")
    first = [straight.quantize(x) for x in xs]
    resumed = DelayedScaling(E5M2, margin=1, history_len=3, algo="max")
    for x in xs[:3]:
        resumed.quantize(x)
    fresh = DelayedScaling(E5M2, margin=1, history_len=3, algo="max")
    fresh.load_state_dict(resumed.state_dict())
    for x, want in zip(xs[3:], first[3:]):
        got = fresh.quantize(x)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale_inv, want.scale_inv)
