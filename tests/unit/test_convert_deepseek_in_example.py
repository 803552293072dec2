"""A converted DeepSeek-V2/V3 in the example (examples/pretrain_gpt.py's model code): its
argument parser takes the flags `npuspeed convert` prints, its model built from them loads
the converted checkpoint (the run-description check passes) and gives transformers' logits
within 1e-5, and `--hf-checkpoint` fills the same model, routing bias included.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import VOCAB, make_hf  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


def _logits(model, tokens):
    model.eval()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)[..., :VOCAB]


YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
CASES = {"deepseek_v3": {}, "deepseek_v2": {},
         "deepseek_v3_yarn": {"rope_parameters": YARN, "max_position_embeddings": 163840}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_example_runs_a_converted_deepseek(case, tmp_path, megatron_mp):
    import megatron.core
    from megatron.core import dist_checkpointing

    from gpt_example import args as example_args
    from gpt_example import ckpt_verify, model as example_model
    from npuspeed.convert import hf_to_megatron, into_model

    if case.endswith("yarn") and tuple(int(x) for x in megatron.core.__version__.split(".")[:2]) < (0, 15):
        pytest.skip("YaRN with MLA converts on megatron-core 0.15 and later")
    arch = case.removesuffix("_yarn")
    hf_model = make_hf(tmp_path / "hf", arch, **CASES[case])
    done = hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))
    args = example_args.parse_args(done["flags"] + ["--seq-length", "24", "--micro-batch-size", "2",
                                                    "--mock-data"])
    args.padded_vocab_size = done["padded_vocab_size"]
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(tokens).logits

    path = str(tmp_path / "mg" / "iter_0000000")
    common = dist_checkpointing.load_common_state_dict(path)
    ckpt_verify.verify_fits(common["run"], args, path)  # the example's own flags-vs-checkpoint check
    config = example_model.transformer_config(args)
    (chunk,) = example_model.build_model(args, config, args.padded_vocab_size)
    attention = chunk.decoder.layers[0].self_attention.core_attention  # npuspeed's MLA core attention
    assert type(attention).__name__ == "MLADotProductAttention"
    assert attention.hidden_size_per_partition == args.num_attention_heads * args.v_head_dim
    chunk.load_state_dict(dist_checkpointing.load({"model": chunk.sharded_state_dict()}, path)["model"])
    diff = (_logits(chunk, tokens) - want).abs().max().item()
    assert diff <= 1e-5, diff

    (fresh,) = example_model.build_model(args, config, args.padded_vocab_size)
    filled = into_model.load_into([fresh], str(tmp_path / "hf"), args.padded_vocab_size,
                                  ckpt_verify.model_fingerprint(args))
    biases = [n for n, _ in fresh.named_buffers() if n.endswith("router.expert_bias")]
    assert filled == len(list(fresh.parameters())) + len(biases)
    assert len(biases) == (1 if arch == "deepseek_v3" else 0)
    assert torch.equal(_logits(fresh, tokens), _logits(chunk, tokens))


def test_moe_layer_freq_pattern():
    from gpt_example.args import moe_layer_freq

    assert moe_layer_freq("1") == 1
    assert moe_layer_freq("[0]*3+[1]*2") == [0, 0, 0, 1, 1]
    assert moe_layer_freq("[0,1]*2") == [0, 1, 0, 1]
    with pytest.raises(Exception, match="use an int or terms"):
        moe_layer_freq("[2]*3")


@pytest.mark.parametrize("extra,says", [(["--use-flash-attn"], "--use-flash-attn with --multi-latent-attention"),
                                        (["--context-parallel-size", "2"], "--context-parallel-size with --multi"),
                                        (["--moe-layer-freq", "[0]*3"], "--moe-layer-freq has 3 entries")])
def test_example_refuses_what_mla_does_not_take(extra, says, monkeypatch):
    from gpt_example import args as example_args
    from npuspeed.errors import UserError

    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--multi-latent-attention", "--rope-type", "rope", "--q-lora-rank", "8", "--kv-lora-rank", "8",
            "--mock-data"]
    with pytest.raises(UserError, match=says.replace("[", r"\[")):
        example_args.parse_args(base + extra)
