"""Subprocess body for test_megatron_lm_feature: megatron.core's DistributedOptimizer (torch
Adam, no apex/TE) saved through dist_checkpointing (dp_reshardable) and loaded into a fresh
one, world size 1, with a chosen set of npuspeed's fixes. Prints losses as JSON.

argv[1]: all | none | no-step (fixes 1 and 2 only: template step and no_grad).
"""
import json
import sys
import tempfile

import torch


def register(which: str) -> None:
    """The device feature applies all three fixes; 'none' and 'no-step' hold them back."""
    from npuspeed import runtime
    from npuspeed.features.device import distopt_fixes as fixes
    from npuspeed.patching import registry

    cls = f"{fixes.DISTRIB}.DistributedOptimizer"
    if which != "all":
        fixes.register = lambda *args, **kwargs: None
    runtime.initialize([])  # what `import npuspeed.megatron_adaptor` does
    if which == "no-step":
        registry.register(f"{cls}.state_dict", wrapper=fixes.state_dict_before_first_step, feature="test")
        registry.register(f"{cls}.load_parameter_state_from_dp_reshardable", wrapper=fixes.under_no_grad,
                          feature="test")
    registry.apply()


def main() -> None:
    register(sys.argv[1])
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)

    def build(seed):
        torch.manual_seed(seed)
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                   use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
        gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, use_distributed_optimizer=True), [model])
        return model, optimizer

    def step(model, optimizer, i):
        tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(100 + i))
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, torch.arange(8).expand(2, 8), None, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        return loss.item()

    def sharded(model, optimizer, loading):
        model_state = model.module.sharded_state_dict()
        return {"model": model_state, "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}

    model, optimizer = build(0)
    for i in range(2):
        step(model, optimizer, i)
    ckpt = tempfile.mkdtemp()
    dist_checkpointing.save(sharded(model, optimizer, False), ckpt)
    reference = [step(model, optimizer, i) for i in range(2, 5)]
    model2, optimizer2 = build(7)
    state = dist_checkpointing.load(sharded(model2, optimizer2, True), ckpt)
    model2.module.load_state_dict(state["model"])
    optimizer2.load_state_dict(state["optimizer"])
    chained = getattr(optimizer2, "chained_optimizers", [optimizer2])
    inner = chained[0].optimizer
    steps = [float(s["step"]) for s in inner.state.values()]
    distinct = len({id(s["step"]) for s in inner.state.values()})
    resumed = [step(model2, optimizer2, i) for i in range(2, 5)]
    print("RESULT " + json.dumps({"reference": reference, "resumed": resumed, "steps_after_load": steps,
                                  "distinct_step_tensors": distinct, "params": len(inner.state)}))


if __name__ == "__main__":  # dist_checkpointing's writer starts spawned helper processes
    main()
