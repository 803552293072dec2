"""Compute-communication overlap (`--use-coc --coc-parallel-num N`) for tensor parallelism.

With TP, a column-parallel linear starts with an all-gather of the sequence-sharded input
(SP) and a row-parallel linear ends with a reduce-scatter (SP) or an all-reduce; done whole,
that communication is pure waiting. Here the token rows of each call are cut into N chunks
and pipelined: chunk i+1 is gathered while chunk i is multiplied, chunk i is reduced while
chunk i+1 is multiplied; backward mirrors it. The forward and backward of Megatron-Core's
local ColumnParallelLinear / RowParallelLinear are replaced (layers.py, functions.py);
collectives are async work handles, on a side stream where the device has streams
(comm.py). With `--use-ascend-mc2` on an NPU whose torch_npu has the MC2 kernels, the fused
`npu_all_gather_base_mm` / `npu_mm_reduce_scatter_base` run instead (mc2.py).

N must be > 1: one chunk would be the original code under another name (MindSpeed's
default). Shapes N does not divide use the nearest divisor, logged (chunking.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.coc_overlap.layers import Settings, check_linear_class, use_mc2
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.coc_overlap import patches as _patches, plan as _plan


@dataclass(frozen=True)
class Config(FeatureConfig):
    use_coc: bool = flag("--use-coc", False)
    """Overlap tensor-parallel communication with the matmuls of Megatron's
    ColumnParallelLinear/RowParallelLinear, in --coc-parallel-num row chunks (needs
    tensor-model-parallel size > 1)."""
    coc_parallel_num: int | None = flag("--coc-parallel-num", None, type=int)
    """With --use-coc: number of row chunks N (> 1), e.g. 2 or 4."""
    use_ascend_mc2: bool = flag("--use-ascend-mc2", False)
    """With --use-coc on an NPU: torch_npu's fused MC2 kernels (npu_all_gather_base_mm,
    npu_mm_reduce_scatter_base) instead of chunks."""



class CocOverlapFeature(Feature, name="coc_overlap", Config=Config, patches=_patches, plan=_plan, switch="use_coc",
                        requires={"coc_parallel_num": "use_coc", "use_ascend_mc2": "use_coc"}):
    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        self.check_requires(config)
        n = config.coc_parallel_num
        if n is None or n <= 1:
            got = "not given" if n is None else f"got {n}"
            raise FeatureError(f"--use-coc needs --coc-parallel-num N with N > 1 ({got}): one chunk "
                               "leaves nothing to overlap. Add e.g. --coc-parallel-num 2, or drop --use-coc.")
        tp = ctx.megatron.tensor_model_parallel_size
        if tp is not None and tp <= 1:
            raise FeatureError(f"--use-coc overlaps tensor-parallel communication, but "
                               f"--tensor-model-parallel-size is {tp}; use a size > 1 or drop --use-coc.")

    def prepare(self, ctx) -> None:
        config, accelerator = self.config(ctx.args), ctx.accelerator
        if config.use_ascend_mc2 and not use_mc2(Settings(config.coc_parallel_num, True, accelerator)):
            ctx.note(f"--use-ascend-mc2: no torch_npu MC2 kernels on {accelerator.name}; "
                     f"--use-coc runs the chunked path (N={config.coc_parallel_num}).")

    def check_built(self, block, ctx) -> str | None:
        for module in block.modules():
            try:
                check_linear_class(type(module))
            except FeatureError as exc:
                return str(exc)
        return None

    def running(self, ctx) -> str:
        config, accelerator = self.config(ctx.args), ctx.accelerator
        n = config.coc_parallel_num
        target = "replaces forward+backward of Megatron's local ColumnParallelLinear/RowParallelLinear"
        if use_mc2(Settings(n, bool(config.use_ascend_mc2), accelerator)):
            return (f"torch_npu MC2 fused npu_all_gather_base_mm / npu_mm_reduce_scatter_base "
                    f"(chunked N={n} where a shape does not fit MC2); {target}")
        where = ("as async work handles, waited per chunk (no streams on this device)"
                 if not for_device(accelerator.name).has_streams() else "on a separate communication stream")
        mc2 = "; --use-ascend-mc2 given but no MC2 kernels here" if config.use_ascend_mc2 else ""
        return (f"chunked all-gather+matmul / matmul+reduce-scatter / matmul+all-reduce, N={n} row chunks, "
                f"{accelerator.dist_backend} collectives {where}{mc2}; {target}")
