"""--npuspeed-dump and `npuspeed compare` in one process on a tiny Megatron GPTModel (1 gloo rank):
what a dump holds (execution order, gradients as autograd gives them, parameters and main grads,
losses, the layout), that it leaves the run's losses and gradients bitwise unchanged, that compare
finds nothing between two identical runs and names an injected fault (test-only, here), and that
its reassembly of TP shards and its bad-input lines are right. The same through torchrun at TP1
against TP2 + SP: tests/distributed/test_dump_compare.py."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from npuspeed.errors import UserError
from npuspeed.features.base import FeatureError
from npuspeed.features.dump import hooks
from npuspeed.features.dump.selection import parse_modules, parse_steps
from npuspeed.features.dump.stats import describe


# --- flags and statistics ------------------------------------------------------------------------
def test_steps_and_modules_parse_or_name_the_flag():
    assert parse_steps("1,3-5") == {1, 3, 4, 5} and parse_steps(None) is None
    for bad in ("0", "3-1", "a", "1,,2"):
        with pytest.raises(FeatureError, match="^--dump-steps .*: give 1-based iterations"):
            parse_steps(bad)
    assert parse_modules(None) == ("*",) and parse_modules("a.*, b") == ("a.*", "b")
    with pytest.raises(FeatureError, match="--dump-modules"):
        parse_modules(" , ")


def test_statistics_count_nan_and_inf_and_describe_the_finite_rest():
    t = torch.tensor([1.0, -2.0, float("nan"), float("inf"), 3.0], dtype=torch.bfloat16)
    s = describe(t)
    assert (s["NaN"], s["Inf"], s["Max"], s["Min"], s["dtype"], s["shape"]) == (1, 1, 3.0, -2.0, "torch.bfloat16", [5])
    assert s["Mean"] == pytest.approx(2 / 3) and s["Norm"] == pytest.approx(math.sqrt(14))
    assert describe(None) is None


# --- a tiny GPTModel through a schedule-shaped function --------------------------------------------
def _model(seed=7):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def _batches(n=2):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (n, 2, 16), generator=g)
    return [(t, torch.roll(t, -1, 1)) for t in tokens]


def schedule(*, model, data_iterator, num_microbatches, forward_only=False, **_):
    """Megatron's no-pipelining schedule in miniature: forward, loss, backward per micro-batch."""
    losses = []
    for _ in range(num_microbatches):
        tokens, labels = next(data_iterator)
        position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        if not forward_only:
            (loss / num_microbatches).backward()
        losses.append({"lm loss": loss.detach()})
    return losses


def _train(model, step_fn, iterations=2):
    """Plain SGD on `model` through `step_fn`; returns the losses and the final gradients."""
    seen = []
    for _ in range(iterations):
        model.zero_grad()
        out = step_fn(model=model, data_iterator=iter(_batches()), num_microbatches=2)
        seen.append([float(x["lm loss"]) for x in out])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return seen, {n: p.grad.clone() for n, p in model.named_parameters()}


def _dumper(path, level="stats", steps=None, globs=("*",)):
    return hooks.Dumper(str(path), steps, globs, level, print)


def _norm_fault(model):
    """Test-only fault: a 1e-3 relative error in layer 2's (layer_number 2) input norm, forward."""
    norm = model.decoder.layers[1].input_layernorm
    return norm.register_forward_hook(lambda m, i, out: out * (1 + 1e-3))


def test_dump_leaves_losses_and_gradients_bitwise_unchanged(megatron_mp, tmp_path):
    plain = _train(_model(), schedule)
    dumped = _train(_model(), _dumper(tmp_path / "d", "tensors", steps=frozenset({1})).wrap_schedule(schedule))
    assert plain[0] == dumped[0]
    assert all(torch.equal(plain[1][n], dumped[1][n]) for n in plain[1])


def test_a_dump_holds_forward_backward_parameters_losses_and_layout(megatron_mp, tmp_path):
    root = tmp_path / "d"
    losses, _ = _train(_model(), _dumper(root, "tensors", steps=frozenset({2})).wrap_schedule(schedule))
    assert sorted(os.listdir(root)) == ["rank0", "step2"]  # only the step asked for, every loss
    lines = [json.loads(x) for x in (root / "rank0" / "loss.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["values"]["lm loss"] == [[v] for v in losses[1]]
    layout = json.loads((root / "rank0" / "layout.json").read_text())
    assert (layout["tp_size"], layout["pp_size"], layout["dp_size"]) == (1, 1, 1)
    assert layout["parameters"]["decoder.layers.1.self_attention.linear_qkv.weight"]["partition_dim"] == 0
    assert layout["parameters"]["decoder.layers.1.input_layernorm.weight"]["partition_dim"] is None
    recs = [json.loads(x) for x in (root / "step2" / "rank0" / "records.jsonl").read_text().splitlines()]
    forward = [r["module"] for r in recs if r["kind"] == "forward" and r["index"] == 0]
    # execution order: embedding before layer 0 before layer 2 before the output layer
    order = [forward.index(m) for m in ("embedding", "decoder.layers.0.input_layernorm",
                                        "decoder.layers.2.mlp.linear_fc2", "output_layer")]
    assert order == sorted(order)
    assert {r["index"] for r in recs if r["kind"] == "forward"} == {0, 1}  # two micro-batches
    # a gradient as autograd produced it: the loss's w.r.t. the output layer's logits is nonzero,
    # backward records come after the micro-batch's forward ones, in reverse module order
    back = [r for r in recs if r["kind"] == "backward" and r["index"] == 0]
    assert back[0]["seq"] > max(r["seq"] for r in recs if r["kind"] == "forward" and r["index"] == 0)
    first_back = [r["module"] for r in back]
    assert first_back.index("output_layer") < first_back.index("decoder.layers.0.input_layernorm")
    params = {r["module"]: r for r in recs if r["kind"] == "parameter"}
    grad = torch.load(root / "step2" / "rank0" / "dump_tensor_data" /
                      params["output_layer.weight"]["grad"]["data_name"])
    assert grad.abs().sum() > 0 and list(grad.shape) == params["output_layer.weight"]["data"]["shape"]
    ms = json.loads((root / "step2" / "rank0" / "dump.json").read_text())  # MindStudio Probe's layout
    assert ms["task"] == "tensor" and "Module.output_layer.ColumnParallelLinear.forward.0" in ms["data"]


def test_a_dump_tensor_is_the_tensor_the_model_produced(megatron_mp, tmp_path):
    model = _model()
    got = {}

    def keep(module, inputs, output):
        got.setdefault("y", output[0].detach().clone())  # micro-batch 0

    model.decoder.layers[2].mlp.linear_fc2.register_forward_hook(keep)
    _train(model, _dumper(tmp_path / "d", "tensors", steps=frozenset({1}),
                          globs=("decoder.layers.2.mlp", "decoder.layers.2.mlp.*")).wrap_schedule(schedule), iterations=1)
    folder = tmp_path / "d" / "step1" / "rank0"
    recs = [json.loads(x) for x in (folder / "records.jsonl").read_text().splitlines()]
    assert {r["module"] for r in recs if r["kind"] != "parameter"} == {
        "decoder.layers.2.mlp", "decoder.layers.2.mlp.linear_fc1", "decoder.layers.2.mlp.linear_fc2"}
    fc2 = next(r for r in recs if r["module"] == "decoder.layers.2.mlp.linear_fc2" and r["kind"] == "forward")
    assert torch.equal(torch.load(folder / "dump_tensor_data" / fc2["output"][0]["data_name"]), got["y"])


def _compare(a, b, *extra):
    from npuspeed.compare import cli

    return cli.run(cli.parser().parse_args([str(a), str(b), "--no-plot", *extra]))


@pytest.mark.parametrize("level", ["stats", "tensors"])
def test_compare_finds_nothing_twice_and_names_the_injected_norm_fault(megatron_mp, tmp_path, level):
    for name in ("a", "b"):
        _train(_model(), _dumper(tmp_path / name, level).wrap_schedule(schedule))
    same = _compare(tmp_path / "a", tmp_path / "b")
    assert same["divergence"] is None and same["max_rel_error"] == 0.0 and same["steps_compared"] == [1, 2]
    faulty = _model()
    _norm_fault(faulty)
    _train(faulty, _dumper(tmp_path / "f", level).wrap_schedule(schedule))
    got = _compare(tmp_path / "a", tmp_path / "f")
    div = got["divergence"]
    assert div["step"] == 1
    assert (div["forward"]["module"], div["forward"]["micro_batch"]) == ("decoder.layers.1.input_layernorm", 0)
    assert div["forward"]["rel_error"] == pytest.approx(1e-3, rel=0.05)
    assert [b["module"] for b in div["forward"]["before"]][-1] == "decoder.layers.0"  # what ran just before
    assert div["backward"] is not None and div["parameter"] is not None


# --- reassembly and bad input on written dumps ---------------------------------------------------------
def _write(root, tp, records_per_rank, params=None, steps=(1,), losses=None, dtype="torch.float32", gated=False,
           values=None):
    """A dump written by the dump's own writer: `records_per_rank` [(module, output)] per rank,
    `values` {parameter: (value, gradient)} (rank 0 only)."""
    from npuspeed.features.dump.writer import DumpWriter

    for rank in range(tp):
        w = DumpWriter(str(root), rank, "tensors")
        w.write_layout({"format": "npuspeed-dump/1", "rank": rank, "world_size": tp, "tp_rank": rank, "tp_size": tp,
                        "pp_rank": 0, "pp_size": 1, "cp_rank": 0, "cp_size": 1, "ep_rank": 0, "ep_size": 1,
                        "dp_rank": 0, "dp_size": 1, "sequence_parallel": tp > 1, "gated_linear_unit": gated,
                        "params_dtype": dtype, "parameters": params or {}})
        for step in steps:
            w.start_step(step)
            for seq, (module, tensor) in enumerate(records_per_rank[rank]):
                key = f"Module.{module}.X.forward.0"
                w.record({"kind": "forward", "name": key, "module": module, "class": "X", "index": 0, "seq": seq,
                          "output": [w.tensor(tensor, key, "output", 0)]})
            for name, (value, grad) in (values or {}).items():
                key = f"Parameter.{name}"
                w.record({"kind": "parameter", "name": key, "module": name, "seq": 99,
                          "data": w.tensor(value, key, "data", 0), "grad": w.tensor(grad, key, "grad", 0)})
            w.end_step()
            w.loss(step, {"lm loss": [[(losses or {}).get(step, 2.0)]]} if rank == 0 else {})


def test_tp2_shards_reassemble_to_tp1_tensors(tmp_path):
    g = torch.Generator().manual_seed(1)
    hidden, seq_out, part, fc1 = (torch.randn(8, 2, 8, generator=g) for _ in range(4))
    ref = [[("a.col", hidden), ("b.sp", seq_out), ("c.bias_grad", part.sum(0)), ("d.linear_fc1", fc1)]]
    gate, up = fc1.chunk(2, -1)
    shards = [[("a.col", hidden.chunk(2, -1)[r]), ("b.sp", seq_out.chunk(2, 0)[r]), ("c.bias_grad", part[:4].sum(0) if r == 0 else part[4:].sum(0)),
               ("d.linear_fc1", torch.cat([gate.chunk(2, -1)[r], up.chunk(2, -1)[r]], -1))] for r in range(2)]
    _write(tmp_path / "tp1", 1, ref, gated=True)
    _write(tmp_path / "tp2", 2, shards, gated=True)
    got = _compare(tmp_path / "tp1", tmp_path / "tp2")
    assert got["divergence"] is None and got["max_rel_error"] < 1e-6
    shards[1][3] = ("d.linear_fc1", torch.cat([up.chunk(2, -1)[1], gate.chunk(2, -1)[1]], -1))  # halves swapped
    _write(tmp_path / "bad", 2, shards, gated=True)
    div = _compare(tmp_path / "tp1", tmp_path / "bad")["divergence"]
    assert div["forward"]["module"] == "d.linear_fc1"


def test_parameter_values_alone_are_drift_a_gradient_is_a_divergence(tmp_path):
    t, w, g = torch.ones(4), torch.ones(8), torch.full((8,), 0.5)
    params = {"w": {"shape": [8], "partition_dim": None}}
    _write(tmp_path / "a", 1, [[("m", t)]], params=params, values={"w": (w, g)})
    _write(tmp_path / "value", 1, [[("m", t)]], params=params, values={"w": (w * 1.01, g)})
    _write(tmp_path / "grad", 1, [[("m", t)]], params=params, values={"w": (w, g * 1.01)})
    drift = _compare(tmp_path / "a", tmp_path / "value")
    assert drift["divergence"] is None and drift["parameter_drift"][0]["module"] == "w"
    div = _compare(tmp_path / "a", tmp_path / "grad")["divergence"]
    assert (div["parameter"]["module"], div["parameter"]["slot"], div["forward"]) == ("w", "grad", None)


def test_bad_input_is_one_line_naming_what_differs(tmp_path):
    t = torch.ones(4, 4)
    _write(tmp_path / "a", 1, [[("m", t)]], params={"w": {"shape": [4, 4], "partition_dim": None}}, steps=(1, 2))
    _write(tmp_path / "other", 1, [[("m", t)]], params={"w": {"shape": [4, 8], "partition_dim": None}})
    _write(tmp_path / "late", 1, [[("m", t)]], params={"w": {"shape": [4, 4], "partition_dim": None}}, steps=(3,))
    cases = {
        str(tmp_path / "nowhere"): "B: .* is not a folder",
        str(tmp_path / "a" / "rank0"): "is not an npuspeed dump",
        str(tmp_path / "other"): "different models: parameter w is \\[4, 4\\] in A and \\[4, 8\\] in B",
        str(tmp_path / "late"): "no dumped step in common \\(A: \\[1, 2\\], B: \\[3\\]\\)",
    }
    for b, message in cases.items():
        with pytest.raises(UserError, match=message):
            _compare(tmp_path / "a", b)
    with pytest.raises(UserError, match="--steps 3: step 3 is not dumped in A"):
        _compare(tmp_path / "a", tmp_path / "a", "--steps", "3")
    records = tmp_path / "a" / "step2" / "rank0" / "records.jsonl"
    records.write_text(records.read_text()[:-20] + "\n")
    with pytest.raises(UserError, match="records.jsonl line 1 is damaged"):
        _compare(tmp_path / "a", tmp_path / "a")
    os.remove(tmp_path / "a" / "step1" / "rank0" / "dump_tensor_data" / "Module.m.X.forward.0.output.0.pt")
    with pytest.raises(UserError, match="forward.0.output.0.pt is missing"):
        _compare(tmp_path / "a", tmp_path / "a", "--steps", "1")


def test_cli_prints_the_table_and_says_where_the_plot_went(tmp_path, capsys):
    from npuspeed.cli import main

    t = torch.ones(4)
    _write(tmp_path / "a", 1, [[("m", t)]], losses={1: 2.0})
    _write(tmp_path / "b", 1, [[("m", t * 1.01)]], losses={1: 2.5})
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(tmp_path / "l.png")]) == 0
    out = capsys.readouterr().out
    assert "        1               2             2.5         0.2  <- beyond tolerance" in out
    assert "first in forward order: m (X) output[0] micro-batch 0: rel. error 0.0099" in out
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "l.png").stat().st_size > 0 and f"plot: {tmp_path / 'l.png'}" in out
    except ImportError:
        assert "matplotlib is not importable" in out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--no-plot"]) == 0
    assert json.loads(capsys.readouterr().out)["divergence"]["forward"]["module"] == "m"
