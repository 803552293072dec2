"""The FP8 linear's output and both gradients within the format's error bound of a float64
reference, for every recipe and format; the torch._scaled_mm backend against the emulation;
the counters; fp32 weight gradients when fp8_wgrad is off.

The bound, per GEMM C = A B^T with A, B quantized: each element a decodes to a + e with
|e| <= u|a| + (min_subnormal / 2) * scale_inv, u the format's unit roundoff (2**-4 E4M3,
2**-3 E5M2). MXFP8 (OCP's round-down shared exponent) saturates the top binade: there the
error is below |a| / 8, so its u is max(u, 1/8). scale_inv is at most 2 * amax / max for
every recipe (TE's current scale; pow2 rounding at most doubles it; MX's X <= amax / 2**emax).
Then |C - C_ref| <= (|A| + E_A)(|B| + E_B)^T - |A||B|^T, plus fp32 accumulation, K * 2**-23
of (|A| + E_A)(|B| + E_B)^T.
"""
from __future__ import annotations

import pytest
import torch

from npuspeed.ops.fp8 import Fp8Recipe
from npuspeed.ops.fp8.linear import fp8_linear

RECIPES = ["tensorwise", "delayed", "blockwise", "mxfp8"]


def _err(a: torch.Tensor, fmt_dtype, recipe: str) -> torch.Tensor:
    fi = torch.finfo(fmt_dtype)
    u = fi.eps / 2
    if recipe == "mxfp8":
        u = max(u, 0.125)
    min_sub = fi.smallest_normal * fi.eps            # smallest subnormal: 2**-9 / 2**-16
    scale_inv = 2 * a.abs().max() / fi.max
    return u * a.abs() + min_sub / 2 * scale_inv


def _bound(a, b, da, db, recipe):
    """Elementwise bound on |Q(a) Q(b)^T - a b^T| (a [M,K], b [N,K], float64)."""
    ea, eb = _err(a, da, recipe), _err(b, db, recipe)
    full = (a.abs() + ea) @ (b.abs() + eb).t()
    k = a.shape[1]
    return full - a.abs() @ b.abs().t() + k * 2.0 ** -23 * full


def _counter(stats: dict):
    def count(name, n):
        stats[name] = stats.get(name, 0) + n
    return count


def _run(recipe_name, fmt, x, w, b, dy, iters=2, **kw):
    recipe = Fp8Recipe(recipe_name, fp8_format=fmt, **kw)
    state, stats = recipe.new_state(), {}
    count = _counter(stats)
    for _ in range(iters):        # delayed scaling: the second pass quantizes with this tensor's own amax
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        bi = b.clone().requires_grad_(True)
        y = fp8_linear(xi, wi, bi, recipe, state, count)
        y.backward(dy)
    return y, xi.grad, wi.grad, bi.grad, stats


def _inputs(m=37, k=200, n=72, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.01, 10, k)).to(dtype)  # columns of very different scale
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = (torch.randn(m, n, generator=g) * 1e-3).to(dtype)
    return x.reshape(1, m, k), w, b, dy.reshape(1, m, n)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_output_and_gradients_within_format_bound(recipe, fmt):
    x, w, b, dy = _inputs()
    y, dx, dw, db, stats = _run(recipe, fmt, x, w, b, dy)
    e4, gdt = torch.float8_e4m3fn, (torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn)
    X, W, DY = x[0].double(), w.double(), dy[0].double()
    checks = [("y", y[0].double() - b.double(), X @ W.t(), _bound(X, W, e4, e4, recipe)),
              ("dx", dx[0].double(), DY @ W, _bound(DY, W.t().contiguous(), gdt, e4, recipe)),
              ("dw", dw.double(), DY.t() @ X, _bound(DY.t().contiguous(), X.t().contiguous(), gdt, e4, recipe))]
    for name, got, want, bound in checks:
        err = (got - want).abs()
        print(recipe, fmt, name, (err / bound).max().item())
        assert (err <= bound).all(), (name, (err / bound).max().item())
        assert err.max() > 0, name                 # it did quantize
    assert torch.equal(db, dy[0].sum(0))
    assert stats[f"gemm.{recipe}"] == 6           # two passes, three GEMMs each


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_scaled_mm_backend_agrees_with_emulation(recipe, fmt):
    x, w, b, dy = _inputs(m=32, k=256, n=64)
    emu = _run(recipe, fmt, x, w, b, dy, backend="emulate")
    smm = _run(recipe, fmt, x, w, b, dy, backend="scaled_mm")
    for a, c in zip(emu[:4], smm[:4]):
        scale = a.detach().abs().max()
        torch.testing.assert_close(a, c, rtol=0, atol=float(scale) * 256 * 2.0 ** -23)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_inputs_give_bf16_outputs(recipe):
    x, w, b, dy = _inputs(dtype=torch.bfloat16)
    y, dx, dw, db, _ = _run(recipe, "hybrid", x, w, b, dy, iters=1)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    ref = (x[0].double() @ w.double().t() + b.double())
    assert ((y[0].double() - ref).norm() / ref.norm()) < 0.1


def test_wgrad_in_high_precision_when_fp8_wgrad_off():
    x, w, b, dy = _inputs()
    _, _, dw, _, stats = _run("tensorwise", "hybrid", x, w, b, dy, iters=1, wgrad_fp8=False)
    assert torch.equal(dw, (dy[0].float().t() @ x[0].float()))
    assert stats["gemm.tensorwise"] == 2


def test_counts_saturation_and_underflow():
    """Delayed scaling with a growing amax saturates; a tiny value beside a large one underflows."""
    x = torch.ones(1, 4, 128)
    w = torch.ones(8, 128)
    recipe = Fp8Recipe("delayed", fp8_format="e4m3")
    state, stats = recipe.new_state(), {}
    count = _counter(stats)
    fp8_linear(x, w, None, recipe, state, count)            # scales learn amax 1 -> 448
    x2 = x * 2
    x2[0, 0, 0] = 1e-6                                       # 1e-6 * 448 < smallest subnormal / 2
    fp8_linear(x2, w, None, recipe, state, count)
    assert stats["saturated"] == 4 * 128 - 1                # every 2.0 * 448 > 448
    assert stats["underflowed"] == 1


def test_delayed_needs_its_state():
    x, w, b, _ = _inputs()
    with pytest.raises(ValueError, match="new_state"):
        fp8_linear(x, w, b, Fp8Recipe("delayed"))


def test_block_recipes_refuse_scaled_mm_in_one_line():
    for r in ("blockwise", "mxfp8"):
        with pytest.raises(ValueError, match="--fp8-recipe " + r) as err:
            Fp8Recipe(r, backend="scaled_mm")
        assert "\n" not in str(err.value)
