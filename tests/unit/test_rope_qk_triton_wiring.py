"""--use-fused-rotary-pos-emb rotates an attention's q and k in one Triton launch where Triton
runs: inside a Megatron GPT (GQA, partial rotary), the pair op is a candidate of the per-shape
rule (with Megatron's path, the one-tensor kernels twice), runs when it wins or is forced
(counted `ops.rotary_pos_emb_qk.triton`, one launch forward and one backward per layer), and
loss and every gradient match unpatched Megatron.

A Triton-capable device is simulated on CPU: a fresh process with TRITON_INTERPRET=1 (set
before triton is imported) lets CPU tensors take the Triton kernels (`fused_choice.TRITON_ON_HOST`).
On a real CPU run the pair path is not taken (last test: the one-tensor rule runs, as before).
"""
from __future__ import annotations

import pytest

from script_run import ROOT, run_triton_script


_SCRIPT = r"""
import os, sys, json
os.environ["TRITON_INTERPRET"] = "1"
root = sys.argv[1]
sys.path[:0] = [os.path.join(root, "tests"), os.path.join(root, "tools")]
import torch
import torch.distributed as dist
from npuspeed import runtime
from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops.triton import rope as trope
fused_choice.TRITON_ON_HOST = True  # the interpreter runs the kernels on CPU tensors
runtime.initialize([])
from launch import free_port
from feature_ctx import features_enabled
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
parallel_state.initialize_model_parallel(1, 1)

config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=48, use_cpu_initialization=True, hidden_dropout=0.0,
                           attention_dropout=0.0, apply_rope_fusion=False)
tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
position_ids = torch.arange(16).expand(2, 16)
labels = torch.roll(tokens, -1, 1)

def gpt():
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                    position_embedding_type="rope", rotary_percent=0.5)

def loss_and_grads(model):
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

class Times:  # injected timings: the one-launch pair fastest, so the decision is deterministic
    def __call__(self, name, run):
        run()
        return 1.0 if name == "triton" else 2.0

launches = []
real = trope._launch
trope._launch = lambda *a, **kw: launches.append(1) or real(*a, **kw)
tensor_parallel.model_parallel_cuda_manual_seed(7)
torch.manual_seed(7)
baseline = gpt()
base_loss, base_grads = loss_and_grads(baseline)
result = {"baseline_launches": len(launches)}
for force in ("auto", "triton"):
    os.environ["NPUSPEED_FUSED_OP_PATH"] = force
    fused_choice.CHOOSER = fused_choice.Chooser(repeats=2, budget_s=0.0, trial=Times())
    _dispatch.reset_calls()
    with features_enabled(["--use-fused-rotary-pos-emb"]):
        model = gpt()
        model.load_state_dict(baseline.state_dict())
        del launches[:]
        loss, grads = loss_and_grads(model)
    same = abs(loss.item() - base_loss.item()) <= 1e-5 and grads.keys() == base_grads.keys() and all(
        torch.allclose(grads[n], g, rtol=1e-4, atol=1e-5) for n, g in base_grads.items())
    made = [c for c in fused_choice.choices() if c.op == "rotary_pos_emb_qk"]
    result[force] = {"same": same, "launches": len(launches),
                     "calls": {f"{op}.{impl}": n for (op, impl), n in _dispatch.calls().items()},
                     "impl": [c.impl for c in made], "measured": sorted(made[0].ms) if made else None}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def runs() -> dict:
    """Measured and forced runs in one interpreter process (megatron's import is the cost)."""
    return run_triton_script(_SCRIPT, str(ROOT))


def test_pair_kernel_is_measured_wins_and_matches_megatron(runs):
    from npuspeed.ops._extension import has_op

    out = runs["auto"]
    assert runs["baseline_launches"] == 0 and out["same"], out
    assert out["impl"] == ["triton"]  # one shape: measured once
    expect = ["megatron", "triton", "triton_each"] + (["cpp"] if has_op("rotary_pos_emb") else [])
    assert out["measured"] == sorted(expect), out
    assert out["calls"] == {"rotary_pos_emb_qk.triton": 2}, out  # no one-tensor call left: q and k paired


def test_pair_kernel_forced(runs):
    out = runs["triton"]
    assert out["same"] and out["measured"] == [] and out["calls"] == {"rotary_pos_emb_qk.triton": 2}, out
    # per layer one forward and one backward launch for q and k (nothing measured), and the one
    # forward that checks the forced kernel against Megatron's path (both layers share the key)
    assert out["launches"] == 2 * 2 + 1


def test_no_pair_on_a_real_cpu_run(megatron_mp, with_features, monkeypatch):
    """CPU tensors take no Triton kernel: q and k each go through the one-tensor rule (C++)."""
    import torch

    from npuspeed.features.fused_rotary_pos_emb import rope_qk
    from npuspeed.ops import _dispatch, rope

    monkeypatch.setenv("NPUSPEED_FUSED_OP_PATH", "cpp")
    q, k, freqs = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 8)
    assert rope.fused_rotary_pos_emb_qk(q, k, freqs, False, 1.0, lambda t: t) is None

    class Attn:  # what the forward wrapper reads
        config = type("C", (), {})()

    assert rope_qk._shared_freqs(Attn(), {"rotary_pos_emb": freqs}) is None
    _dispatch.reset_calls()


def test_pairing_is_by_identity_and_falls_back_to_megatron(monkeypatch):
    """The scope only pairs the very query and key its attention made, rotated by the one angle
    tensor both get; anything else (other angles, another tensor, a changed key) runs Megatron's."""
    import types

    import torch

    from npuspeed.features.fused_rotary_pos_emb import rope_qk
    from npuspeed.ops import fused_choice, rope

    monkeypatch.setattr(fused_choice, "TRITON_ON_HOST", True)
    config = types.SimpleNamespace(rotary_interleaved=False)
    attn = types.SimpleNamespace(config=config)
    f, g = torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 8)
    assert rope_qk._shared_freqs(attn, {"rotary_pos_emb": f}) is f
    assert rope_qk._shared_freqs(attn, {"rotary_pos_emb": (f, f)}) is f
    assert rope_qk._shared_freqs(attn, {"rotary_pos_emb": (f, g)}) is None  # q and k rotated differently
    assert rope_qk._shared_freqs(attn, {"rotary_pos_emb": f, "packed_seq_params": object()}) is None
    assert rope_qk._shared_freqs(types.SimpleNamespace(config=types.SimpleNamespace(apply_rope_fusion=True)),
                                 {"rotary_pos_emb": f}) is None

    pairs = []
    monkeypatch.setattr(rope, "fused_rotary_pos_emb_qk",
                        lambda q, k, *a: pairs.append(1) or (q + 100, k + 200))
    monkeypatch.setitem(rope_qk._ORIGINAL, "bshd", lambda t, *a, **kw: t)
    monkeypatch.setitem(rope_qk._ORIGINAL, "mla", "mla_rotary_interleaved")

    def megatron_apply(t, freqs, config, cu_seqlens=None, mscale=1.0):
        return t - 1

    apply = rope_qk.apply_wrapper(megatron_apply)
    q, k = torch.zeros(4, 1, 2, 8), torch.zeros(4, 1, 1, 8)

    def scoped(run):
        scope = rope_qk._Scope(attn, f)
        scope.query, scope.key = q, k
        monkeypatch.setattr(rope_qk._LOCAL, "scope", scope, raising=False)
        return run()

    got = scoped(lambda: (apply(q, f, config), apply(k, f, config)))
    assert pairs == [1] and torch.equal(got[0], q + 100) and torch.equal(got[1], k + 200)
    got = scoped(lambda: (apply(q, f, config), apply(k, g, config)))  # the key gets other angles
    assert torch.equal(got[1], k - 1)
    got = scoped(lambda: (apply(q, g, config), apply(k, g, config)))  # not the scope's angles
    assert len(pairs) == 2 and torch.equal(got[0], q - 1) and torch.equal(got[1], k - 1)

    def changed_key():
        out = apply(q, f, config)
        k.add_(0)  # an in-place change between the two calls
        return out, apply(k, f, config)

    assert torch.equal(scoped(changed_key)[1], k - 1)
    monkeypatch.setattr(rope_qk._LOCAL, "scope", None)
