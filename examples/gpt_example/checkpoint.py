"""Save and resume through megatron.core's dist_checkpointing.

Layout as Megatron-LM: `<dir>/iter_0000006/` plus `latest_checkpointed_iteration.txt`.
Each rank's RNG states (python, numpy, host torch, device, model-parallel tracker) are a
ShardedObject keyed by global rank, so a resume in the same layout continues bit for bit;
at another layout (TP, PP, DP, world size) they are not restored, as in Megatron-LM.
Model and optimizer state reshard to any layout and optimizer kind (ckpt_optimizer.py).
A save is atomic (written aside, renamed into place, then tracked); a load checks the files
and the model shape before it reads a tensor (ckpt_verify.py).
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject

from gpt_example import ckpt_optimizer, ckpt_verify
from npuspeed import get_accelerator
from npuspeed.errors import UserError


def _unwrap(chunk):
    """The GPTModel inside Megatron's DDP / Float16Module wrappers (checkpoints hold its keys)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_state(model) -> dict:
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _rng_object(data=None) -> ShardedObject:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardedObject("rng_state", data, (world,), (rank,), replica_id=0)


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": get_accelerator().get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["device"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> dict:
    return {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
            "dp": mpu.get_data_parallel_world_size(), "world": torch.distributed.get_world_size()}


def _describe(args, optimizer, iteration: int) -> dict:
    """What a later load checks before reading any tensor (common.pt, saved by rank 0)."""
    return {"format": 1, "iteration": iteration, "model": ckpt_verify.model_fingerprint(args),
            "layout": _layout(), "optimizer": ckpt_optimizer.kind(optimizer),
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"}


def _merged(model_state: dict) -> dict:
    """The model chunks' sharded state dicts the optimizer maps its parameters through, kept
    apart: chunks share local keys (each one's first layer is `decoder.layers.0`), and Megatron
    matches parameters by value over the nested dict, so flattening them would lose all but the
    last chunk's (VPP could not save)."""
    return {name: part for name, part in model_state.items() if name.startswith("model")}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, ckpt_verify.TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, ckpt_verify.TRACKER))
    _fsync_dir(root)


def save(root: str, iteration: int, model, optimizer, scheduler, args=None) -> str:
    """Write iteration's checkpoint into `iter_N.tmp/`, rename it to `iter_N/` once every rank has
    written, then point the tracker at it: a run killed at any moment leaves the previous
    checkpoint as the one `--load` finds."""
    path = ckpt_verify.iter_dir(root, iteration)
    tmp = path + ".tmp"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
        os.makedirs(tmp)
    torch.distributed.barrier()
    state = _model_state(model)
    state["optim"] = ckpt_optimizer.to_save(optimizer, _merged(state))
    state["scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_object(_rng_state())
    state["iteration"] = iteration
    if args is not None:
        state["run"] = _describe(args, optimizer, iteration)
    dist_checkpointing.save(state, tmp)
    torch.distributed.barrier()
    if rank0:
        if os.path.exists(path):  # saving the same iteration again
            shutil.rmtree(path)
        os.rename(tmp, path)
        _fsync_dir(root)
        _write_tracker(root, iteration)
    torch.distributed.barrier()
    return path


def _rank0_print(message: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(message, flush=True)


def load(root: str, model, optimizer, scheduler, *, load_optim: bool = True, load_rng: bool = True,
         step: int | None = None, args=None, fresh_ok: bool = False) -> int:
    """Restore checkpoint `step` (default: the latest) under `root`; return its iteration (0: none).

    Everything that can be known from the files is checked first (ckpt_verify): a missing,
    damaged or different-model checkpoint raises UserError before any state is touched."""
    iteration = ckpt_verify.choose(root, step, fresh_ok=fresh_ok)
    if iteration is None:
        _rank0_print(f"no checkpoint under {root} yet: starting from iteration 0")
        return 0
    path = ckpt_verify.iter_dir(root, iteration)
    ckpt_verify.verify_files(path, root, ckpt_verify.complete_iterations(root))
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as exc:
        raise UserError(f"checkpoint {path} is damaged: common.pt cannot be read ({exc})") from exc
    saved = common.get("run")
    if args is not None:
        ckpt_verify.verify_fits(saved, args, path)
    if load_rng and saved and saved.get("layout") is None:  # written by `npuspeed convert`: no RNG states
        _rank0_print(f"checkpoint {path} was converted from {saved.get('source')}: it holds no RNG states, "
                     "they start from --seed")
        load_rng = False
    if load_rng and saved and saved.get("layout") != _layout():
        _rank0_print(f"checkpoint layout {saved.get('layout')} differs from this run's {_layout()}: RNG states "
                     "are not restored (as Megatron-LM; dropout masks differ between layouts anyway)")
        load_rng = False
    model_state = _model_state(model)
    request = dict(model_state)
    template = None
    if load_optim:
        if "optim" not in common:
            raise UserError(f"checkpoint {path} holds no optimizer state in this example's format; "
                            "resume with --no-load-optim (the optimizer starts afresh)")
        saved_keys = set(dist_checkpointing.load_tensors_metadata(path).keys())
        template, optim_request, substitutes = ckpt_optimizer.load_request(optimizer, _merged(model_state),
                                                                           saved_keys)
        absent = ckpt_optimizer.missing(optim_request, saved_keys)
        if absent:
            raise UserError(f"checkpoint {path} lacks optimizer state this run needs ({absent[0]} and "
                            f"{len(absent) - 1} more); resume with --no-load-optim")
        request["optim"] = {"tensors": optim_request}
    if load_rng:
        request["rng_state"] = _rng_object(None)
    state = dist_checkpointing.load(request, path)
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(state[f"model{i}"])
    if load_optim:
        weights = ckpt_optimizer.model_tensors(model_state, {k: state[k] for k in model_state})
        ckpt_optimizer.restore(optimizer, template, state["optim"]["tensors"], common["optim"], substitutes,
                               weights)
        scheduler.load_state_dict(common["scheduler"])
    if load_rng:
        _set_rng_state(state["rng_state"])
    return int(common["iteration"])
