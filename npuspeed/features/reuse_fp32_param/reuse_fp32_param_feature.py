"""`--reuse-fp32-param`: bf16 parameters and their fp32 masters share memory, exactly.

Ordinary bf16 mixed precision keeps each weight twice (2 + 4 bytes). Here the fp32 master
is the bf16 parameter plus a 16-bit residual (2 + 2 bytes, plus a sparse list of exact
ties), rebuilt bit for bit for each optimizer step and for checkpoints. Losses are
bitwise those of ordinary mixed precision. With the distributed optimizer the saving is
2 bytes per parameter / DP. Upstream Transformer Engine's `store_param_remainders` does
the same for TE's fused Adam only; without TE (CPU, NPU) this is the path. The optimizer
patches: patches.py; the codec: codec.py, triton_codec.py; the masters: shared_masters.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.reuse_fp32_param import patches as _patches, plan as _plan
from npuspeed.features.reuse_fp32_param import codec

FLAG = "--reuse-fp32-param"


@dataclass(frozen=True)
class Config(FeatureConfig):
    reuse_fp32_param: bool = flag(FLAG, False)
    """Share fp32 master weights with bf16 parameters (needs --bf16); bitwise-equal training,
    2 bytes/parameter less."""


class ReuseFp32ParamFeature(Feature, name="reuse_fp32_param", Config=Config, patches=_patches, plan=_plan,
                            switch="reuse_fp32_param"):
    def validate(self, ctx) -> None:
        if ctx.megatron.fp16:
            raise FeatureError(f"{FLAG} works with --bf16 only (bf16 is the top half of "
                               "fp32; fp16 is not): replace --fp16 with --bf16 or drop the flag")
        device = getattr(ctx.accelerator, "name", "cpu")
        if codec.implementation_for(device) == "device":
            ctx.note(f"{FLAG}: triton cannot compile for {device} here (install "
                     "triton, or triton-ascend on an NPU); the chunked PyTorch device codec runs instead, "
                     "many small launches a step")

    def running(self, ctx) -> str:
        impl = codec.implementation_for(getattr(ctx.accelerator, "name", "cpu"))
        ties = "dense tie bits" if impl in codec.DENSE else "sparse tie list"
        text = (f"bf16 param + int16 residual + {ties}, one codec call per param-buffer segment; "
                f"masters rebuilt per step ({codec.DESCRIPTIONS[impl]})")
        ran = codec.ran()
        if ran:
            text += "; ran: " + ", ".join(f"{k} x{n}" for k, n in sorted(ran.items()))
        return text
