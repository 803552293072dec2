"""--use-coc without processes: chunk choice, flag validation, construction-time refusals,
the MC2 helpers and the report line. The 2-rank numerics are in tests/distributed/test_coc_layers.py."""
from __future__ import annotations

import logging
import types

import pytest
import torch
from hypothesis import given, strategies as st

from npuspeed.features import FeatureError
from npuspeed.features.coc_overlap import CocOverlapFeature, chunking, layers, mc2


def _ctx(*argv, acc=None):
    from feature_ctx import ctx_for

    return ctx_for(list(argv), acc)


# -- chunk choice -------------------------------------------------------------------------------

@given(st.integers(1, 5000), st.integers(2, 16))
def test_nearest_divisor_divides_and_is_nearest(m, n):
    d = chunking.nearest_divisor(m, n)
    assert m % d == 0
    best = min(abs(k - n) for k in range(1, m + 1) if m % k == 0)
    assert abs(d - n) == best
    if m % n == 0:
        assert d == n


def test_nearest_divisor_ties_go_to_more_chunks():
    assert chunking.nearest_divisor(15, 2) == 3  # 1 and 3 are both 1 away
    assert chunking.nearest_divisor(15, 4) == 5  # 3 and 5
    assert chunking.nearest_divisor(18, 4) == 3
    assert chunking.nearest_divisor(7, 4) == 7   # 1 and 7 are both 3 away


def test_fallback_is_logged_once_per_shape_even_down_to_one_chunk():
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("npuspeed")
    logger.addHandler(handler)
    try:
        assert chunking.chunk_count(5, 2, "unit-test op") == 1
        assert chunking.chunk_count(5, 2, "unit-test op") == 1
        assert chunking.chunk_count(12, 4, "unit-test op") == 4  # divides: no line
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if "unit-test op" in r.getMessage()]
    assert len(lines) == 1 and "--coc-parallel-num 2" in lines[0] and "using 1 chunk of 5 rows" in lines[0]
    assert ("unit-test op", 5, 2) in chunking.logged_shapes()


# -- flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--use-coc"], "--coc-parallel-num N with N > 1 \\(not given\\)"),
    (["--use-coc", "--coc-parallel-num", "1"], "--coc-parallel-num N with N > 1 \\(got 1\\)"),
    (["--use-coc", "--coc-parallel-num", "0"], "got 0"),
    (["--coc-parallel-num", "4"], "--coc-parallel-num 4 is given without --use-coc"),
    (["--use-ascend-mc2"], "--use-ascend-mc2 is given without --use-coc"),
])
def test_bad_flags_are_errors_naming_the_flag(argv, match):
    feature = CocOverlapFeature()
    ctx = _ctx(*argv)
    assert feature.enabled(ctx.args)
    with pytest.raises(FeatureError, match=match):
        feature.validate(ctx)


def test_tp1_on_the_command_line_is_an_error(monkeypatch):
    feature = CocOverlapFeature()
    coc = ("--use-coc", "--coc-parallel-num", "2")
    monkeypatch.setattr("sys.argv", ["train.py", "--tensor-model-parallel-size", "2"])  # not read
    with pytest.raises(FeatureError, match="--use-coc.*--tensor-model-parallel-size is 1"):
        feature.validate(_ctx(*coc, "--tensor-model-parallel-size", "1"))
    feature.validate(_ctx(*coc, "--tensor-model-parallel-size", "2"))
    monkeypatch.setenv("NPUSPEED_ARGS", "--tensor-model-parallel-size 1")
    with pytest.raises(FeatureError, match="--tensor-model-parallel-size is 1"):
        feature.validate(_ctx(*coc))


def test_off_without_flags():
    assert not CocOverlapFeature().enabled(_ctx().args)
    assert CocOverlapFeature().path(_ctx()) == "off"


# -- construction-time refusals -----------------------------------------------------------------

def test_tp1_layer_construction_is_an_error(megatron_mp, with_features):  # noqa: F811
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cfg = ModelParallelConfig(use_cpu_initialization=True)
    with with_features(["--use-coc", "--coc-parallel-num", "2"]):
        with pytest.raises(FeatureError, match="--use-coc .*tensor-model-parallel size 1"):
            ColumnParallelLinear(8, 8, config=cfg, init_method=torch.nn.init.zeros_, bias=False)
        with pytest.raises(FeatureError, match="--use-coc .*RowParallelLinear"):
            RowParallelLinear(8, 8, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                              input_is_parallel=True, skip_bias_add=False)
    ColumnParallelLinear(8, 8, config=cfg, init_method=torch.nn.init.zeros_, bias=False)  # patch undone


def test_deferred_embedding_wgrad_is_refused():
    fake_group = types.SimpleNamespace(size=lambda: 2)
    layer = types.SimpleNamespace(tp_group=fake_group, explicit_expert_comm=False,
                                  config=types.SimpleNamespace(defer_embedding_wgrad_compute=True))
    init = layers.init_wrapper("ColumnParallelLinear")(lambda self: None)
    with pytest.raises(FeatureError, match="--use-coc cannot replace .*defer_embedding_wgrad_compute"):
        init(layer)
    layer.config.defer_embedding_wgrad_compute = False
    init(layer)
    layer.explicit_expert_comm, fake_group.size = True, lambda: 1  # experts: nothing to chunk, no error
    init(layer)


def test_foreign_linear_classes_are_refused(megatron_mp):  # noqa: F811
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    layers.check_linear_class(ColumnParallelLinear)
    layers.check_linear_class(RowParallelLinear)

    class Inherits(ColumnParallelLinear):
        pass

    layers.check_linear_class(Inherits)

    class OwnForward(RowParallelLinear):
        def forward(self, input_):
            return input_, None

    with pytest.raises(FeatureError, match="--use-coc .*OwnForward defines its own forward"):
        layers.check_linear_class(OwnForward)
    TEColumnParallelLinear = type("TEColumnParallelLinear", (torch.nn.Module,), {})
    with pytest.raises(FeatureError, match="--use-coc .*TEColumnParallelLinear.*--transformer-impl local"):
        layers.check_linear_class(TEColumnParallelLinear)
    layers.check_linear_class(torch.nn.Linear)


def test_build_module_refuses_a_foreign_linear_spec(megatron_mp, with_features):  # noqa: F811
    from megatron.core.transformer import spec_utils
    from megatron.core.transformer.spec_utils import ModuleSpec

    TERowParallelLinear = type("TERowParallelLinear", (torch.nn.Module,), {})
    with with_features(["--use-coc", "--coc-parallel-num", "2"]):
        with pytest.raises(FeatureError, match="TERowParallelLinear"):
            spec_utils.build_module(ModuleSpec(module=TERowParallelLinear))
        assert isinstance(spec_utils.build_module(torch.nn.Identity), torch.nn.Identity)
    spec_utils.build_module(ModuleSpec(module=TERowParallelLinear))  # patch undone


def test_a_built_block_with_a_foreign_linear_is_refused(megatron_mp):  # noqa: F811
    """From megatron-core 0.17 MLP and attention call their spec's linear class directly (no
    build_module): the check of the built block (check_built) still finds a foreign one."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from npuspeed.features.coc_overlap import CocOverlapFeature

    class TEColumnParallelLinear(torch.nn.Module):  # what a Transformer Engine spec would build
        def __init__(self, *args, **kwargs):
            super().__init__()

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    mlp = MLP(config, MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=RowParallelLinear))
    problem = CocOverlapFeature().check_built(torch.nn.ModuleList([mlp]), None)
    assert problem and "TEColumnParallelLinear" in problem and "--use-coc" in problem, problem
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    local = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    assert CocOverlapFeature().check_built(torch.nn.ModuleList([local]), None) is None


def test_gtp_sharded_weights_are_refused():
    layer = types.SimpleNamespace(tp_group=types.SimpleNamespace(size=lambda: 2), explicit_expert_comm=False,
                                  gtp_remat_size=2, config=types.SimpleNamespace(defer_embedding_wgrad_compute=False))
    init = layers.init_wrapper("RowParallelLinear")(lambda self: None)
    with pytest.raises(FeatureError, match="--use-coc cannot chunk a RowParallelLinear .*GTP"):
        init(layer)
    layer.gtp_remat_size = 1
    init(layer)


# -- MC2 helpers and the report -----------------------------------------------------------------

def test_hccl_comm_name_asks_the_group_backend_for_the_global_rank(monkeypatch):
    seen = {}

    class Backend:
        def get_hccl_comm_name(self, rank):
            seen["rank"] = rank
            return f"hcom-{rank}"

    class Group:
        def _get_backend(self, device):
            seen["device"] = device
            return Backend()

    acc = types.SimpleNamespace(device=lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 5)
    assert mc2.hccl_comm_name(Group(), acc) == "hcom-5"
    assert seen == {"rank": 5, "device": torch.device("cpu")}


def test_mc2_constraints():
    x, w = torch.empty(8, 256, dtype=torch.bfloat16), torch.empty(256, 64, dtype=torch.bfloat16)
    assert mc2.unsupported(x, w, 2) is None
    assert "dtype" in mc2.unsupported(x.float(), w.float(), 2)
    assert "k=128" in mc2.unsupported(x[:, :128], w[:128], 2)
    assert "tensor-parallel size 3" in mc2.unsupported(x, w, 3)
    # npu_mm_reduce_scatter_base: "m must be divisible by world_size" (the all-gather has no such rule)
    assert "m=7 not a multiple" in mc2.unsupported(x[:7], w, 2, "npu_mm_reduce_scatter_base")
    assert mc2.unsupported(x[:7], w, 2, "npu_all_gather_base_mm") is None


class _FakeNpuAcc:
    name, dist_backend = "npu", "hccl"

    def __init__(self, ops):
        self.torch_npu = types.SimpleNamespace(**{op: (lambda *a, **k: None) for op in ops})

    def has_mc2(self):
        return all(hasattr(self.torch_npu, op) for op in mc2.OPS)


def test_report_path_says_which_path_runs(npuspeed_runtime):
    feature = CocOverlapFeature()
    args = ("--use-coc", "--coc-parallel-num", "4")
    cpu = npuspeed_runtime.accelerator
    text = feature.path(_ctx(*args, acc=cpu))
    assert "chunked" in text and "N=4" in text and "gloo" in text and "async work handles" in text
    assert "ColumnParallelLinear/RowParallelLinear" in text
    mc2_args = (*args, "--use-ascend-mc2")
    assert "torch_npu MC2 fused npu_all_gather_base_mm" in feature.path(_ctx(*mc2_args, acc=_FakeNpuAcc(mc2.OPS)))
    assert "chunked" in feature.path(_ctx(*mc2_args, acc=_FakeNpuAcc(())))
    assert "no MC2 kernels here" in feature.path(_ctx(*mc2_args, acc=cpu))
    assert "chunked" in feature.path(_ctx(*args, acc=_FakeNpuAcc(mc2.OPS)))  # MC2 only when asked for


def test_device_streams_order_the_collectives(megatron_mp, monkeypatch):  # noqa: F811
    """Where the device has streams: the side stream waits for compute before the collective
    is launched on it, and compute waits for the side stream before the result is used."""
    import contextlib

    import torch.distributed as dist

    from npuspeed.features.coc_overlap import comm

    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits {other.name}")

    compute, side = Stream("compute"), Stream("comm")

    class Acc:
        name = "cuda"

        def current_stream(self):
            return compute

        def current_device(self):
            return 0

        def Stream(self):
            return side

        @contextlib.contextmanager
        def stream(self, s):
            events.append(f"enter {s.name}")
            yield
            events.append(f"exit {s.name}")

    monkeypatch.setattr(comm, "_COMM_STREAMS", {})
    real = dist.all_gather_into_tensor

    def recorded(*args, **kwargs):
        events.append(f"all_gather async={kwargs.get('async_op')}")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_into_tensor", recorded)
    collectives = comm.Collectives(dist.group.WORLD, Acc())
    x = torch.arange(6.0).view(3, 2)
    out = torch.empty(3, 2)
    pending = collectives.all_gather(out, x)
    assert events == ["comm waits compute", "enter comm", "all_gather async=True", "exit comm"]
    assert pending.wait() is out and torch.equal(out, x)
    assert events[-1] == "compute waits comm"
