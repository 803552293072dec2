"""--use-fused-linear-cross-entropy at tensor parallel 2 (2 gloo ranks, spawned): a GPT's per-token
loss and every gradient against Megatron's output layer + vocab_parallel_cross_entropy, with and
without sequence parallelism, tied and untied output weights; labels on both vocab shards."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from launch import free_port

WORLD = 2
SEQ, BATCH, HIDDEN, VOCAB = 16, 2, 32, 512
CASES = [(False, False), (True, False), (True, True)]  # (sequence_parallel, untie)


def _gpt(sp: bool, untie: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True,
                               tensor_model_parallel_size=WORLD, sequence_parallel=sp)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=not untie)


def _step(model):

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    loss = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=torch.roll(tokens, -1, 1))
    mask = torch.ones(BATCH, SEQ)
    mask[:, :2] = 0
    (loss * mask).sum().div(mask.sum()).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if getattr(p, "sequence_parallel", False):  # layernorm grads are partial under SP (Megatron
            g = g.clone()                            # all-reduces them in finalize_model_grads)
            torch.distributed.all_reduce(g)
        grads[name] = g.clone()
    return loss.detach(), grads


def _worker(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from feature_ctx import features_enabled
    from npuspeed import runtime, telemetry

    runtime.initialize([])
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from npuspeed.features.fused_linear_ce.function import CALLS

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    parallel_state.initialize_model_parallel(WORLD, 1)
    for sp, untie in CASES:
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        baseline = _gpt(sp, untie)
        loss, grads = _step(baseline)
        with features_enabled(["--use-fused-linear-cross-entropy", "--fused-linear-cross-entropy-fallback", "never",
                               "--fused-linear-cross-entropy-chunk-size", "2000"]):
            model = _gpt(sp, untie)
            model.load_state_dict(baseline.state_dict())
            calls = telemetry.get(CALLS)
            got_loss, got_grads = _step(model)
            assert telemetry.get(CALLS) == calls + 1, (sp, untie)
        torch.testing.assert_close(got_loss, loss, atol=1e-5, rtol=1e-5, msg=f"loss sp={sp} untie={untie}")
        assert got_grads.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, atol=1e-5, rtol=1e-5, msg=f"{name} sp={sp} untie={untie}")
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_tp2_sequence_parallel_tied_untied_match_megatron():
    mp.start_processes(_worker, args=(free_port(),), nprocs=WORLD, join=True, start_method="spawn")
