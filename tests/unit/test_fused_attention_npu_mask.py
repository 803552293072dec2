"""npu_fusion_attention's atten_mask takes the shapes its documentation lists: "输入shape类型支持
BNSS格式、B1SS格式、11SS格式、SS格式" (torch_npu 2.6.0-2.14.0). A per-head mask shared by the batch,
[1, N, Sq, Skv], is none of them: it goes to the op expanded to BNSS. The emulator refuses
an undocumented shape, as the contract does."""
from __future__ import annotations

import types

import pytest
import torch

from npu_contract.emulate_attention import npu_fusion_attention as emulator


@pytest.mark.parametrize("sparse_mode", [None, 0, 1])
@pytest.mark.parametrize("mask_shape", [(1, 2), (2, 2), (2, 1), (1, 1)])
def test_atten_mask_shape_is_documented(sparse_mode, mask_shape):
    from npuspeed.features.fused_attention.npu import npu_attention
    from npuspeed.features.fused_attention.masks import MaskPlan

    sq, b, h, d = 5, 2, 2, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sq, b, h, d, generator=gen) for _ in range(3))
    mask = torch.rand(*mask_shape, sq, sq, generator=gen) > 0.6
    mask[..., 0] = False  # every row keeps a key
    shapes = []

    def record(*args, **kwargs):
        shapes.append(tuple(kwargs["atten_mask"].shape))
        return emulator(*args, **kwargs)

    out = npu_attention(types.SimpleNamespace(npu_fusion_attention=record), q, k, v, MaskPlan(mask=mask),
                        scale=0.5, dropout_p=0.0, sparse_mode=sparse_mode)
    (shape,) = shapes
    assert shape in {(b, h, sq, sq), (b, 1, sq, sq), (1, 1, sq, sq), (sq, sq)}
    bhsd = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*bhsd, attn_mask=~mask, scale=0.5)
    torch.testing.assert_close(out, ref.permute(2, 0, 1, 3).reshape(sq, b, h * d))


def test_forced_mode_0_refuses_tockens_the_op_does_not_take():
    """Mode 0 aligns the band at the top-left corner, so npuspeed shifts a causal pattern by
    Skv - Sq: with Sq=8, Skv=4 next_tockens is -4, and |next_tockens| < Skv does not hold
    (the documentation's constraint); Sq=8, Skv=6 gives -2, which the op takes."""
    from npuspeed.features.base import FeatureError
    from npuspeed.features.fused_attention.npu import mask_arguments
    from npuspeed.features.fused_attention.masks import MaskPlan

    args = mask_arguments(MaskPlan(causal=True), 0, 8, 6, 2, torch.device("cpu"), 1)
    assert args["next_tockens"] == -2 and args["sparse_mode"] == 0
    with pytest.raises(FeatureError, match=r"--sparse-mode 0: .*Sq=8, Skv=4 .*next_tockens=-4.*Leave --sparse-mode out"):
        mask_arguments(MaskPlan(causal=True), 0, 8, 4, 2, torch.device("cpu"), 1)
