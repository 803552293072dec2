"""npuspeed convert (issue 37): tiny Hugging Face models made here with `transformers` from a
config (random weights, nothing downloaded), converted to a Megatron checkpoint and back.

- the Megatron model loaded from the converted checkpoint gives the transformers model's
  logits within 1e-5 (fp32, TP1) for each architecture;
- HF -> Megatron -> HF gives every tensor back bitwise, in several safetensors shards;
- bad input (unknown architecture, a field that changes the maths, a missing shard, a layout
  the model cannot take, an occupied --save) ends with one line and leaves nothing behind.
"""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_tiny import VOCAB, hf_config, hf_tensors, make_hf, megatron_logits_at  # noqa: E402


def megatron_logits(ckpt, tokens):
    from megatron.core import dist_checkpointing

    path = os.path.join(ckpt, "iter_0000000")
    common = dist_checkpointing.load_common_state_dict(path)
    return megatron_logits_at(path, common["hf_config"], tokens), common["run"]["model"]["padded_vocab_size"]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
CASES = {  # name: (architecture, config overrides)
    "llama": ("llama", {}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", {}),
    "qwen2-moe-shared-expert": ("qwen2_moe", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-unnormalised-topk": ("qwen3_moe", {"norm_topk_prob": False}),
    # MLA with q_lora_rank, interleaved RoPE rows, sigmoid routing with a random expert bias, 2 groups,
    # routed_scaling_factor 2.5, a shared expert, one dense first layer
    "deepseek-v3": ("deepseek_v3", {}),
    "deepseek-v3-rope-halves": ("deepseek_v3", {"rope_interleave": False}),  # RoPE rows permuted
    "deepseek-v2-group-limited": ("deepseek_v2", {}),  # softmax, group_limited_greedy, scaling 2.5
    "deepseek-v2-lite": ("deepseek_v2", {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1,
                                         "topk_group": 1, "routed_scaling_factor": 1.0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_round_trip(case, tmp_path, megatron_mp):
    from npuspeed.convert import hf_to_megatron, megatron_to_hf

    arch, overrides = CASES[case]
    hf_model = make_hf(tmp_path / "hf", arch, **overrides)
    assert len(glob.glob(str(tmp_path / "hf" / "*.safetensors"))) > 1  # a sharded checkpoint with an index
    if case == "deepseek-v2-lite" and _megatron_release() >= (0, 19):  # TE-only query projection there
        from npuspeed.errors import UserError

        with pytest.raises(UserError, match="q_lora_rank null .* convert with megatron-core 0.16"):
            hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2)
        return
    done = hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, divisible_by=128)
    assert done["padded_vocab_size"] == 512  # 258 padded to a multiple of 128 x TP2
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    logits, padded = megatron_logits(str(tmp_path / "mg"), tokens)
    assert logits.shape == (2, 24, padded)
    with torch.no_grad():
        want = hf_model(tokens).logits
    diff = (logits[..., :VOCAB] - want).abs().max().item()
    assert diff <= 1e-5, diff

    back = megatron_to_hf.convert(str(tmp_path / "mg"), str(tmp_path / "back"), max_shard_bytes=40_000)
    assert back["shards"] > 1 and os.path.isfile(tmp_path / "back" / "model.safetensors.index.json")
    before, after = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    unequal = [k for k in before if not torch.equal(before[k], after[k])]
    assert not unequal, unequal
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).float().eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, want)


def _megatron_release() -> tuple[int, int]:
    import megatron.core

    return tuple(int(x) for x in megatron.core.__version__.split(".")[:2])


def test_deepseek_rope_rows_must_be_permuted(tmp_path, megatron_mp, monkeypatch):
    """The logits test catches a wrong RoPE layout: DeepSeek-V3 with rope_interleave=false
    converted without the row permutation is 1.3e-3 off (measured), 130x the tolerance."""
    from npuspeed.convert import deepseek, hf_to_megatron

    model = make_hf(tmp_path / "hf", "deepseek_v3", rope_interleave=False)
    monkeypatch.setattr(deepseek, "_pairs", lambda rows, d, to_megatron: rows)
    hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    logits, _ = megatron_logits(str(tmp_path / "mg"), tokens)
    with torch.no_grad():
        diff = (logits[..., :VOCAB] - model(tokens).logits).abs().max().item()
    assert diff > 1e-4, diff


def test_deepseek_flags_megatron_lm_accepts(tmp_path, megatron_mp, monkeypatch):
    """The printed flags of a DeepSeek-V3 are Megatron-LM's: its parser, validate_args and
    core_transformer_config_from_args take them (where megatron.training is installed: .venv312)."""
    from npuspeed.convert import hf_to_megatron

    make_hf(tmp_path / "hf", "deepseek_v3")
    flags = hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))["flags"]
    assert (tmp_path / "mg" / hf_to_megatron.ARGS_FILE).read_text().split() == flags
    for pair in (["--q-lora-rank", "24"], ["--kv-lora-rank", "16"], ["--qk-head-dim", "16"],
                 ["--qk-pos-emb-head-dim", "8"], ["--v-head-dim", "12"], ["--rope-type", "rope"],
                 ["--moe-router-score-function", "sigmoid"], ["--moe-router-topk-scaling-factor", "2.5"],
                 ["--moe-router-num-groups", "2"], ["--moe-router-group-topk", "1"],
                 ["--moe-layer-freq", "[0]*1+[1]*1"], ["--moe-shared-expert-intermediate-size", "32"]):
        i = flags.index(pair[0])
        assert flags[i:i + 2] == pair
    assert {"--multi-latent-attention", "--qk-layernorm", "--moe-router-enable-expert-bias", "--no-rope-fusion"} <= set(flags)
    assert "--kv-channels" not in flags and "--moe-router-pre-softmax" not in flags
    arguments = pytest.importorskip("megatron.training.arguments")
    import argparse

    args = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(flags)
    assert args.multi_latent_attention and args.moe_layer_freq == [0, 1] and args.moe_router_enable_expert_bias
    assert (args.q_lora_rank, args.kv_lora_rank, args.v_head_dim, args.rope_type) == (24, 16, 12, "rope")
    # and Megatron-LM's own checks and its MLATransformerConfig take them
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(
        flags + ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
                 "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)])
    args.world_size, args.rank = 1, 0
    arguments.validate_args(args, {})
    config = arguments.core_transformer_config_from_args(args)
    assert type(config).__name__ == "MLATransformerConfig" and config.moe_layer_freq == [0, 1]
    assert (config.rope_type, config.moe_router_score_function, config.moe_router_topk_scaling_factor) == (
        "rope", "sigmoid", 2.5)


#: DeepSeek-V3's own YaRN settings (V2's: mscale and mscale_all_dim 0.707)
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("arch,mscale", [("deepseek_v3", "1"), ("deepseek_v2", "0.707")])
def test_deepseek_yarn(arch, mscale, tmp_path, megatron_mp):
    """DeepSeek's YaRN is Megatron's MLA YaRN (--rope-type yarn, factor, mscale, mscale_all_dim):
    ignoring it would move the logits by 1.5e-3 (V3) and 1.2e-2 (V2) (measured); converted, they
    are within 2.4e-7 (0.16.1 and 0.19.2)."""
    from npuspeed.convert import hf_to_megatron

    rope = dict(DEEPSEEK_YARN, mscale=float(mscale), mscale_all_dim=float(mscale))
    scaled = make_hf(tmp_path / "hf", arch, rope_parameters=rope, max_position_embeddings=163840)
    if _megatron_release() < (0, 15):  # refused in one line there
        from npuspeed.errors import UserError

        with pytest.raises(UserError, match="YaRN RoPE scaling with multi-latent attention converts on "
                                            "megatron-core 0.15, 0.16 and 0.19, not 0.1"):
            hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))
        return
    plain = make_hf(tmp_path / "plain", arch, max_position_embeddings=163840)  # the same seed: the same weights
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = scaled(tokens).logits
        assert (want - plain(tokens).logits).abs().max().item() > 1e-3
    flags = hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))["flags"]
    i = flags.index("--rope-type")
    assert flags[i:i + 8] == ["--rope-type", "yarn", "--rotary-scaling-factor", "40", "--mscale", mscale,
                              "--mscale-all-dim", mscale]
    logits, _ = megatron_logits(str(tmp_path / "mg"), tokens)
    diff = (logits[..., :VOCAB] - want).abs().max().item()
    assert diff <= 1e-5, diff


DEEPSEEK_BAD = {  # name: (architecture, config overrides, what the line says)
    "yarn-other-original-context": ("deepseek_v3", {"rope_parameters": dict(
        DEEPSEEK_YARN, original_max_position_embeddings=8192)},
        "rope_parameters.original_max_position_embeddings=8192 is not converted"),
    "yarn-attention-factor": ("deepseek_v3", {"rope_parameters": dict(DEEPSEEK_YARN, attention_factor=1.2)},
                              "rope_parameters.attention_factor=1.2 is not converted"),
    "llama3-rope": ("deepseek_v3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 8192}},
                    "rope_parameters.rope_type='llama3' is not converted"),
    "v3-unnormalised-sigmoid": ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob=False is not converted"),
    "v2-group-ranked-by-top2": ("deepseek_v2", {"num_experts_per_tok": 4}, "topk_group=2 is not converted"),
    "v2-topk-method": ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not converted"),
    "attention-bias": ("deepseek_v3", {"attention_bias": True}, "attention_bias=True is not converted"),
    "kv-heads": ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads=2 is not converted"),
    "no-shared-experts": ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts=0 is not converted"),
    "fp8": ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}},
            "quantization_config='fp8' is not converted"),
}


@pytest.mark.parametrize("case", sorted(DEEPSEEK_BAD))
def test_deepseek_refuses_what_does_not_map(case):
    from npuspeed.convert import architectures
    from npuspeed.errors import UserError

    arch, overrides, says = DEEPSEEK_BAD[case]
    cfg = hf_config(arch).to_dict()
    cfg.update(overrides)
    with pytest.raises(UserError) as exc:
        architectures.from_hf_config(cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


#: the released models' config.json fields that matter here (V3: its quantization_config left out,
#: as after dequantizing to bf16)
_V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
                qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1,
                topk_group=1, num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=False,
                scoring_func="softmax", aux_loss_alpha=0.001, hidden_act="silu", max_position_embeddings=163840,
                rms_norm_eps=1e-6, rope_theta=10000, attention_bias=False,
                rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"})
_V3 = dict(_V2_LITE, architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
           intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
           num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
           routed_scaling_factor=2.5, q_lora_rank=1536, topk_method="noaux_tc", n_group=8, topk_group=4,
           num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
           rope_scaling=dict(_V2_LITE["rope_scaling"], mscale=1.0, mscale_all_dim=1.0))


def test_released_deepseek_configs():
    """DeepSeek-V3 and V2-Lite map; DeepSeek-V2 (236B) does not: Megatron ranks its 8 groups by the
    sum of the best 6//3=2 scores, transformers by the best one."""
    from npuspeed.convert import architectures, megatron_args
    from npuspeed.errors import UserError

    v3 = architectures.from_hf_config(_V3)
    flags = " ".join(megatron_args.model_flags(v3, 128))
    for part in ("--rope-type yarn --rotary-scaling-factor 40 --mscale 1 --mscale-all-dim 1",
                 "--moe-router-num-groups 8 --moe-router-group-topk 4", "--moe-layer-freq [0]*3+[1]*58",
                 "--moe-router-topk-scaling-factor 2.5", "--q-lora-rank 1536"):
        assert part in flags, part
    lite = architectures.from_hf_config(_V2_LITE)
    assert lite.mla.q_lora_rank is None and lite.experts.shared_ffn_hidden_size == 2816
    assert lite.experts.num_groups is None and lite.experts.pre_softmax
    v2 = dict(_V2_LITE, q_lora_rank=1536, n_routed_experts=160, topk_method="group_limited_greedy", n_group=8,
              topk_group=3)
    with pytest.raises(UserError, match="topk_group=3 is not converted"):
        architectures.from_hf_config(v2)


def test_deepseek_mtp_layers_refused_or_dropped(tmp_path, capsys, megatron_mp):
    """DeepSeek-V3's multi-token-prediction layer (tensors of layer num_hidden_layers) is not in
    transformers' forward: one line naming --drop-mtp-layers, which leaves them out."""
    from safetensors.torch import save_file

    from npuspeed.cli import main

    make_hf(tmp_path / "hf", "deepseek_v3", num_nextn_predict_layers=1)
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, str(tmp_path / "hf" / "mtp.safetensors"))
    index = tmp_path / "hf" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.2.eh_proj.weight"] = "mtp.safetensors"
    index.write_text(json.dumps(data))
    line = _bad(tmp_path, _h2m(tmp_path), capsys)
    assert "model.layers.2.eh_proj.weight belongs to a multi-token-prediction layer" in line, line
    assert "--drop-mtp-layers" in line and not (tmp_path / "mg").exists()
    assert main(["convert", *_h2m(tmp_path, "--drop-mtp-layers")]) == 0
    assert "left out 1 multi-token-prediction tensors" in capsys.readouterr().out


def test_mla_refuses_untested_megatron_release(monkeypatch, megatron_mp):
    import megatron.core

    from npuspeed.convert import architectures, megatron_model
    from npuspeed.errors import UserError

    spec = architectures.from_hf_config(hf_config("deepseek_v3").to_dict())
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(UserError, match="multi-latent attention conversion is tested on megatron-core 0.12, "
                                        ".*0.19, not 0.17.0"):
        megatron_model.transformer_config(spec, torch.float32)


def test_llama3_rope_scaling(tmp_path, megatron_mp):
    """Llama 3.x's scaled RoPE (--use-rope-scaling): long enough sequences and large enough
    weights that ignoring the scaling would change the logits 100x beyond the tolerance (measured:
    0.10; the converted model is within 2.8e-6)."""
    from npuspeed.convert import hf_to_megatron

    big = dict(initializer_range=0.1, max_position_embeddings=256)
    scaled = make_hf(tmp_path / "hf", "llama", rope_parameters=LLAMA3_ROPE, **big)
    plain = make_hf(tmp_path / "plain", "llama", **big)  # the same seed: the same weights
    tokens = torch.randint(0, VOCAB, (1, 192), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = scaled(tokens).logits
        assert (want - plain(tokens).logits).abs().max().item() > 1e-3
    done = hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))
    i = done["flags"].index("--use-rope-scaling")
    assert done["flags"][i:i + 3] == ["--use-rope-scaling", "--rope-scaling-factor", "32"]
    logits, _ = megatron_logits(str(tmp_path / "mg"), tokens)
    diff = (logits[..., :VOCAB] - want).abs().max().item()
    assert diff <= 1e-5, diff


def test_flags_describe_the_model(tmp_path, megatron_mp):
    from npuspeed.convert import hf_to_megatron

    make_hf(tmp_path / "hf", "qwen2", num_key_value_heads=2, rope_theta=1e6, attention_dropout=0.1)
    done = hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=1, pp=2, precision="bf16")
    text = (tmp_path / "mg" / hf_to_megatron.ARGS_FILE).read_text().split()
    assert text == done["flags"]
    for pair in (["--num-query-groups", "2"], ["--rotary-base", "1000000"], ["--norm-epsilon", "1e-06"],
                 ["--pipeline-model-parallel-size", "2"], ["--attention-dropout", "0.1"], ["--hidden-dropout", "0"]):
        i = text.index(pair[0])
        assert text[i:i + 2] == pair
    assert "--add-qkv-bias" in text and "--bf16" in text and "--qk-layernorm" not in text
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(tmp_path / "mg" / "iter_0000000"))
    assert meta["embedding.word_embeddings.weight"].dtype == torch.bfloat16


def test_bf16_round_trip(tmp_path, megatron_mp):
    """A bf16 Hugging Face model stays bf16 (config.json's dtype) and comes back bitwise."""
    from megatron.core import dist_checkpointing

    from npuspeed.convert import hf_to_megatron, megatron_to_hf

    model = make_hf(tmp_path / "fp32", "qwen3", tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB")
    done = hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))
    assert "--bf16" in done["flags"]
    meta = dist_checkpointing.load_tensors_metadata(str(tmp_path / "mg" / "iter_0000000"))
    assert {m.dtype for m in meta.values() if hasattr(m, "dtype")} == {torch.bfloat16}
    megatron_to_hf.convert(str(tmp_path / "mg"), str(tmp_path / "back"))
    before, after = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert sorted(before) == sorted(after) and all(after[k].dtype == torch.bfloat16 for k in after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def _bad(tmp_path, argv, capsys) -> str:
    from npuspeed.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["convert", *argv])
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("npuspeed: error: ")]
    assert len(err) == 1, err
    return err[0]


def _h2m(tmp_path, *extra):
    return ["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "mg"), *extra]


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


BAD = {  # name: (how to spoil a Llama directory, extra flags, what the line says)
    "unknown-architecture": (lambda cfg, d: cfg.update(architectures=["GPT2LMHeadModel"]), [],
                             "architectures=['GPT2LMHeadModel']: not convertible"),
    "rope-scaling": (lambda cfg, d: cfg.update(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                "rope_theta": 10000.0}), [],
                     "rope_parameters.rope_type='yarn' is not converted"),
    "llama3-rope-other-window": (lambda cfg, d: cfg.update(rope_parameters=dict(
        LLAMA3_ROPE, original_max_position_embeddings=4096)), [],
        "rope_parameters.original_max_position_embeddings=4096 is not converted"),
    "sliding-window": (lambda cfg, d: cfg.update(architectures=["MistralForCausalLM"], sliding_window=16), [],
                       "sliding_window=16 is not converted"),
    "missing-shard": (lambda cfg, d: os.remove(glob.glob(os.path.join(d, "model-00002-of-*.safetensors"))[0]), [],
                      "named in model.safetensors.index.json is missing"),
    "damaged-shard": (lambda cfg, d: _truncate(glob.glob(os.path.join(d, "model-00003-of-*.safetensors"))[0]), [],
                      "is damaged"),
    "tp-too-wide": (lambda cfg, d: None, ["--tensor-model-parallel-size", "4"],
                    "--tensor-model-parallel-size 4: the model's 2 key/value heads do not split over 4 ranks"),
    "save-exists": (lambda cfg, d: os.makedirs(os.path.join(os.path.dirname(d), "mg", "x")), [],
                    "exists and is not empty"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line(case, tmp_path, capsys, megatron_mp):
    spoil, extra, says = BAD[case]
    make_hf(tmp_path / "hf", "llama")
    path = tmp_path / "hf" / "config.json"
    cfg = json.loads(path.read_text())
    spoil(cfg, str(tmp_path / "hf"))
    path.write_text(json.dumps(cfg))
    line = _bad(tmp_path, _h2m(tmp_path, *extra), capsys)
    assert says in line, line
    left = sorted(os.listdir(tmp_path))
    assert left == (["hf", "mg"] if case == "save-exists" else ["hf"]), left  # nothing half-written


def test_megatron_to_hf_refuses_another_model(tmp_path, capsys, megatron_mp):
    from npuspeed.convert import hf_to_megatron

    make_hf(tmp_path / "hf", "llama")
    hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))
    other = hf_config("llama", num_hidden_layers=4)
    other.save_pretrained(str(tmp_path / "other"))
    line = _bad(tmp_path, ["megatron-to-hf", "--load", str(tmp_path / "mg"), "--save", str(tmp_path / "back"),
                           "--hf-config", str(tmp_path / "other")], capsys)
    assert "num_layers 2 in the checkpoint, 4 in config.json" in line, line
    assert not (tmp_path / "back").exists()


def test_layouts_experts_cannot_take():
    from npuspeed.convert import architectures
    from npuspeed.errors import UserError

    moe = architectures.from_hf_config(hf_config("mixtral").to_dict())  # 4 experts of width 32
    architectures.check_layout(moe, 2, 1, None, 4, None)
    with pytest.raises(UserError, match="--expert-model-parallel-size 3: the model's 4 experts do not split"):
        architectures.check_layout(moe, 1, 1, None, 3, None)
    with pytest.raises(UserError, match="--expert-tensor-parallel-size 3: the experts' FFN width 32"):
        architectures.check_layout(moe, 1, 1, None, 1, 3)
    dense = architectures.from_hf_config(hf_config("llama").to_dict())
    with pytest.raises(UserError, match="--expert-model-parallel-size 2: LlamaForCausalLM has no experts"):
        architectures.check_layout(dense, 1, 1, None, 2, None)


def test_hf_checkpoint_flags_must_describe_the_model():
    from npuspeed.convert import architectures, into_model, megatron_args
    from npuspeed.errors import UserError

    spec = architectures.from_hf_config(hf_config("qwen2").to_dict())
    flags = megatron_args.fingerprint(spec, 258)
    into_model.check_flags(spec, 258, flags, "DIR")
    with pytest.raises(UserError, match=r"needs --num-query-groups 2 \(the run has 4\); --add-qkv-bias True "
                                        r"\(the run has False\)"):
        into_model.check_flags(spec, 258, dict(flags, add_qkv_bias=False, num_query_groups=4), "DIR")


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_and_gather_are_inverse(tp):
    from npuspeed.convert import layout

    full = torch.arange(8 * tp * 2 * tp, dtype=torch.float32).reshape(8 * tp, 2 * tp)
    for dim, swiglu in ((0, True), (0, False), (1, False)):
        parts = [layout.shard_dim(full, dim, swiglu, r, tp) for r in range(tp)]
        assert torch.equal(layout.gather_dim(parts, dim, swiglu), full)
    gate, up = full.chunk(2)
    rank1 = layout.shard_dim(full, 0, True, 1, tp)  # [gate_1; up_1], as Megatron's TP fc1 holds them
    rows = 4
    assert torch.equal(rank1, torch.cat([gate[rows:2 * rows], up[rows:2 * rows]]))
