"""The gloo uneven-gather wrapper keeps upstream's call shape: megatron-core 0.12.0's
`_ScatterToSequenceParallelRegion.backward` calls `_gather_along_first_dim(grad)` with no group
(every TP2+SP backward on 0.12.0 failed with a TypeError when the wrapper required one)."""
from __future__ import annotations

import torch

from npuspeed.features.device.gloo_collectives import uneven_gather_on_gloo


def _upstream(input_, group=None, output_split_sizes=None, use_global_buffer=False):
    return ("upstream", input_, group, output_split_sizes, use_global_buffer)


def test_group_is_optional_as_upstream():
    wrapped = uneven_gather_on_gloo(_upstream)
    x = torch.ones(2)
    assert wrapped(x)[0] == "upstream" and wrapped(x)[2] is None


def test_even_or_unsplit_gathers_go_to_upstream():
    wrapped = uneven_gather_on_gloo(_upstream)
    x = torch.ones(2)
    assert wrapped(x, None, [3, 3])[3] == [3, 3]
