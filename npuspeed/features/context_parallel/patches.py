"""The CP feature's two patches of Megatron-Core.

- `DotProductAttention.__init__` asserts `context_parallel_size == 1` ("only supported by
  TEDotProductAttention"). The wrapper builds the layer from a copy of the config with
  CP 1 (nothing else in __init__ reads the CP size), then gives it back the real config and
  marks it with its CP layout, which fused attention's forward hands to features/attention/cp_attention.py.
  Heads and query groups per TP rank must divide by the Ulysses degree.
- `rope_utils.get_pos_emb_on_this_cp_rank` (RoPE angles of this rank's two chunks) builds its
  index with `pin_memory=True` and `.cuda()`, which a CPU build refuses; the replacement
  selects the same chunks on the embedding's own device.
- `parallel_state.initialize_model_parallel` learns the hybrid's Ulysses and ring groups:
  `hierarchical_context_parallel_sizes=[U, R]` (Megatron's own groups, see features/attention/groups.py).
"""
from __future__ import annotations

import copy
import functools

from npuspeed.features.base import FeatureError
from npuspeed.features.attention.cp_attention import ATTR
from npuspeed.features.attention.layout import CPLayout

ATTENTION = "megatron.core.transformer.dot_product_attention.DotProductAttention.__init__"
INIT_MP = "megatron.core.parallel_state.initialize_model_parallel"
ROPE = "megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank"


def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group=None):
    """Megatron's function (chunks cp_rank and 2N-1-cp_rank along `seq_dim`), device-neutral."""
    import torch

    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    picked = chunks.index_select(seq_dim, index)
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])


def check_heads(cp: CPLayout, heads: int, groups: int, tp: int = 1) -> None:
    """Ulysses splits each TP rank's heads and query groups U ways."""
    if cp.ulysses == 1:
        return
    flag = ("--context-parallel-size" if cp.algo == "ulysses_cp_algo" else "--ulysses-degree-in-cp")
    for what, n in (("--num-attention-heads", heads), ("--num-query-groups", groups)):
        if n % tp or (n // tp) % cp.ulysses:
            raise FeatureError(
                f"--context-parallel-algo {cp.algo}: {what} {n} over tensor parallel {tp} gives {n // max(tp, 1)} "
                f"per rank, which {flag} {cp.ulysses} does not divide; choose a Ulysses degree that divides "
                f"{what} / TP (or use megatron_cp_algo)")


def attention_init(cp_algo: str, ulysses_degree: int | None):
    def wrapper(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            config = kwargs["config"] if "config" in kwargs else args[0]
            size = int(getattr(config, "context_parallel_size", 1) or 1)
            if size == 1:
                return init(self, *args, **kwargs)
            cp = CPLayout.make(cp_algo, size, ulysses_degree)
            check_heads(cp, config.num_attention_heads, config.num_query_groups or config.num_attention_heads,
                        config.tensor_model_parallel_size)
            local = copy.copy(config)
            local.context_parallel_size = 1
            if "config" in kwargs:
                kwargs["config"] = local
            else:
                args = (local,) + tuple(args[1:])
            init(self, *args, **kwargs)
            self.config = config
            setattr(self, ATTR, cp)

        return __init__

    return wrapper


def initialize_model_parallel(cp_algo: str, ulysses_degree: int | None):
    def wrapper(fn):
        @functools.wraps(fn)
        def initialize(*args, **kwargs):
            import inspect

            bound = inspect.signature(fn).bind_partial(*args, **kwargs)
            size = int(bound.arguments.get("context_parallel_size", 1) or 1)
            if cp_algo == "hybrid_cp_algo" and size > 1:
                cp = CPLayout.make(cp_algo, size, ulysses_degree)
                if not cp.ring:
                    raise FeatureError(f"--ulysses-degree-in-cp {ulysses_degree} does not divide "
                                       f"--context-parallel-size {size}")
                given = bound.arguments.get("hierarchical_context_parallel_sizes")
                if given and list(given) != [cp.ulysses, cp.ring]:
                    raise FeatureError(f"hierarchical_context_parallel_sizes {list(given)} contradicts "
                                       f"--ulysses-degree-in-cp {cp.ulysses} (needs [{cp.ulysses}, {cp.ring}])")
                bound.arguments["hierarchical_context_parallel_sizes"] = [cp.ulysses, cp.ring]
            return fn(*bound.args, **bound.kwargs)

        return initialize

    return wrapper


#: DotProductAttention.__init__, get_pos_emb_on_this_cp_rank unchanged 0.12-0.19;
#: initialize_model_parallel keeps hierarchical_context_parallel_sizes (0.19 adds GTP sizes)
MEGATRON_RANGE = ">=0.12,<0.20"


def register(registry, ctx, config, feature: str) -> None:
    algo, degree = config.algo, config.ulysses_degree_in_cp
    registry.register(ATTENTION, wrapper=attention_init(algo, degree), feature=feature, megatron=MEGATRON_RANGE)
    registry.register(ROPE, get_pos_emb_on_this_cp_rank, feature=feature, megatron=MEGATRON_RANGE)
    registry.register(INIT_MP, wrapper=initialize_model_parallel(algo, degree), feature=feature,
                      megatron=MEGATRON_RANGE)
