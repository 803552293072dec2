"""Packed documents (PackedSeqParams boundaries, --use-flash-attn): each document as if alone.

A GPT micro-batch of several documents gives, per token, the loss of the same document run
alone, and the gradients of the summed loss equal the sum of the per-document gradients; on
npuspeed's CPU kernel (per-row key ranges) and on PyTorch's CPU flash kernel (one call per
document piece). Attention over documents at S = 4096 never holds anything S x S: its peak
memory (tracking allocator) stays far below one S x S byte mask and grows linearly with S.
"""
from __future__ import annotations

import pytest
import torch

DOCS = (5, 9, 18)  # lengths; S = 32


def _model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, normalization="RMSNorm", add_bias_linear=False)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64,
                    max_sequence_length=64, position_embedding_type="rope")


def _packed_params(lengths, s):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)


@pytest.mark.parametrize("kernel", ["npuspeed", "aten"])
def test_documents_match_each_document_alone(megatron_mp, with_features, monkeypatch, kernel):
    from npuspeed.features.attention import cp_attention
    from npuspeed.features.attention import kernels_cpu
    from npuspeed.ops import flash_attention as cpu_flash

    if kernel == "npuspeed" and cpu_flash.fp32_reason():
        pytest.skip(cpu_flash.fp32_reason())
    if kernel == "aten":
        monkeypatch.setattr(cp_attention, "cpu_kernel", lambda q, k, p: (kernels_cpu.AtenCPU(), "forced"))
    s = sum(DOCS)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (1, s), generator=gen)
    labels = torch.randint(0, 64, (1, s), generator=gen)
    positions = torch.arange(s)[None]
    with with_features(["--use-flash-attn"]):
        model = _model()
        packed = model(tokens, positions, None, labels=labels, packed_seq_params=_packed_params(DOCS, s))
        packed.sum().backward()
        packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        alone, start = [], 0
        for n in DOCS:
            piece = slice(start, start + n)
            loss = model(tokens[:, piece], torch.arange(n)[None], None, labels=labels[:, piece])
            loss.sum().backward()
            alone.append(loss.detach())
            start += n
    assert (packed.detach() - torch.cat(alone, dim=1)).abs().max() < 1e-5
    for name, p in model.named_parameters():
        scale = max(float(packed_grads[name].abs().max()), 1e-3)
        assert (packed_grads[name] - p.grad).abs().max() / scale < 1e-5, name


def _attention_peak(acc, s: int) -> int:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, kv_channels=16,
                               attention_dropout=0.0, use_cpu_initialization=True)
    module = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (torch.randn(s, 1, 2, 16, requires_grad=True) for _ in range(3))
    params = _packed_params([s // 16] * 16, s)
    acc.reset_peak_memory_stats()
    base = acc.memory_allocated()
    module(q, k, v, None, packed_seq_params=params).sum().backward()
    return acc.max_memory_allocated() - base


def test_documents_attention_memory_is_linear_in_s(megatron_mp, with_features):
    acc = megatron_mp.accelerator
    if acc.name != "cpu":
        pytest.skip("measured with the CPU tracking allocator")
    with with_features(["--use-flash-attn"]):
        small, large = _attention_peak(acc, 2048), _attention_peak(acc, 4096)
    s = 4096
    # Megatron's unfused path holds fp32 scores [b, h, S, S] = 128 MiB here; a bool S x S mask is 16 MiB
    assert large < s * s // 2, f"peak {large} bytes at S={s}: an S x S bool mask alone is {s * s}"
    assert large < 2.5 * small, f"peak grew {large / small:.2f}x from S=2048 to 4096 (S x S would be 4x)"
