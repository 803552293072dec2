"""One rank of tests/distributed/test_convert_layouts.py: converted checkpoints loaded at
TP/PP/EP layouts, in one process for every layout (starting the process and importing
Megatron cost more than all the models together).

`python _convert_layouts_worker.py PLAN.json`, started on every rank with RANK/WORLD_SIZE/
MASTER_* set (tests/ranks.py). For each layout of the plan this rank sets Megatron's parallel
state up afresh, builds each case's local-spec model at that layout
(npuspeed/convert/megatron_model.py), lets dist_checkpointing load its part of the converted
checkpoint (stored with global shapes: the load reshards), runs the forward on the plan's tokens
(a pipeline passes the first stage's hidden states to the second: set_input_tensor, send/recv),
gathers the vocabulary over TP and writes the largest |difference| from transformers' logits.
A layout marked `save` then saves the model from that layout as Megatron-LM does
(`{"model": model.sharded_state_dict()}` into iter_0000001, with the tracker), for the way back.
A `mistake` spoils the loaded TP shards on purpose, so the test shows it catches such an error.
"""
from __future__ import annotations

import json
import os
import sys

import torch


def _spoil(model, mistake: str) -> None:
    """A loader's typical TP error, on a model loaded right: `fc1-contiguous` gives each rank a
    plain row block of SwiGLU's fused [gate; up] instead of [gate_r; up_r]; `qkv-rank-order`
    gives each rank the other rank's query groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from npuspeed.convert import layout

    group, size = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size()
    rank = mpu.get_tensor_model_parallel_rank()
    suffix = {"fc1-contiguous": ".mlp.linear_fc1.weight", "qkv-rank-order": ".linear_qkv.weight"}[mistake]
    for name, param in model.named_parameters():
        if not name.endswith(suffix):
            continue
        parts = [torch.empty_like(param.data) for _ in range(size)]
        dist.all_gather(parts, param.data.contiguous(), group=group)
        if mistake == "fc1-contiguous":
            param.data.copy_(layout.gather_dim(parts, 0, True).chunk(size, 0)[rank])
        else:
            param.data.copy_(parts[size - 1 - rank])


def _logits(model, tokens: torch.Tensor, hidden: int):
    """The whole vocabulary's logits on the last pipeline stage (None elsewhere)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    stages = dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group())
    stage = stages.index(dist.get_rank())
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        if stage > 0:
            received = torch.empty(tokens.shape[1], tokens.shape[0], hidden)  # [s, b, h]
            dist.recv(received, src=stages[stage - 1])
            model.set_input_tensor(received)
        out = model(tokens, positions, None)
        if stage < len(stages) - 1:
            dist.send(out.contiguous(), dst=stages[stage + 1])
            return None
    size = mpu.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(out) for _ in range(size)]
    dist.all_gather(parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _save(model, where: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = os.path.join(where, "iter_0000001")
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(where, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")


def _run_case(case: dict, lay: dict, tokens: torch.Tensor, mistake: str | None):
    from megatron.core import dist_checkpointing

    from npuspeed.convert import architectures, megatron_model

    with open(os.path.join(case["hf"], "config.json")) as f:
        spec = architectures.from_hf_config(json.load(f))
    meta = dist_checkpointing.load_tensors_metadata(case["ckpt"])
    padded = meta["embedding.word_embeddings.weight"].global_shape[0]
    model = megatron_model.build(spec, padded, torch.float32)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, case["ckpt"])
    model.load_state_dict(state["model"])
    model.eval()
    if mistake:
        _spoil(model, mistake)
    logits = _logits(model, tokens, spec.hidden_size)
    if lay.get("save") and not mistake:
        _save(model, os.path.join(case["saves"], lay["name"]))
    if logits is None:
        return None
    want = torch.load(case["logits"])
    return (logits[..., :want.shape[-1]] - want).abs().max().item()


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    torch.set_num_threads(1)
    from npuspeed.convert import megatron_model

    megatron_model.runtime_first()
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    dist.init_process_group("gloo")
    tokens = torch.load(plan["tokens"])
    diffs: dict = {}
    for lay in plan["layouts"]:
        mpu.initialize_model_parallel(tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
                                      expert_model_parallel_size=lay["ep"], expert_tensor_parallel_size=lay["etp"])
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        for name, case in plan["cases"].items():
            if lay["ep"] > 1 and not case["moe"]:
                continue
            runs = [None] + [m["mistake"] for m in plan.get("mistakes", [])
                             if m["case"] == name and m["layout"] == lay["name"]]
            for mistake in runs:
                diff = _run_case(case, lay, tokens, mistake)
                if diff is not None:
                    diffs[f"{name}/{lay['name']}" + (f"/{mistake}" if mistake else "")] = diff
        mpu.destroy_model_parallel()
    with open(os.path.join(plan["out"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(diffs, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
