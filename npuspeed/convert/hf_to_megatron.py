"""Hugging Face directory -> Megatron dist_checkpointing checkpoint of the local-spec GPTModel.

The checkpoint is `<save>/iter_0000000/` with `latest_checkpointed_iteration.txt`, the model
under the key `model` (as the example and Megatron-LM save it), and a run description the
example checks against its flags. It holds no optimizer or RNG state: resume with
--no-load-optim. Tensors are stored with their global shapes, so the checkpoint loads at any
TP/PP/VPP/EP layout; the layout given here checks that the model takes it and pads the
vocabulary for it. Each parameter is built from its Hugging Face tensors when the writer asks
for it (lazy_save.py), so host memory holds one parameter, not the model. Beside the
checkpoint: megatron_args.txt (the flags) and hf_config.json.
"""
from __future__ import annotations

import json
import math
import os

import torch

from npuspeed.convert import (
    architectures, dcp_regions, hf_files, host_memory, layout, lazy_save, megatron_args, megatron_model, name_table,
    names, staging,
)
from npuspeed.errors import UserError

ITERATION = 0
TRACKER = "latest_checkpointed_iteration.txt"
ARGS_FILE = "megatron_args.txt"
HF_CONFIG_FILE = "hf_config.json"

_PRECISION_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


def default_precision(config: dict) -> str:
    """The precision the Hugging Face weights are stored in (fp32 when config.json does not say)."""
    return _PRECISION_OF_DTYPE.get(str(config.get("dtype") or config.get("torch_dtype") or ""), "fp32")


def _check_tensor_set(reader: hf_files.HFReader, groups: list[names.Group], spec, drop_mtp: bool = False) -> int:
    """Every tensor mapped and every mapped tensor there; returns how many MTP tensors are left out."""
    from npuspeed.convert import deepseek

    wanted = {n for g in groups for n in g.hf}
    ignored = {"lm_head.weight"} if spec.tied_embeddings else set()
    unmapped = [n for n in reader.names()
                if n not in wanted and n not in ignored and not n.endswith(names.IGNORED_SUFFIXES)]
    mtp = [n for n in unmapped if deepseek.mtp_layer(spec, n) is not None]
    if mtp and not drop_mtp:
        raise deepseek.mtp_layer(spec, mtp[0])
    unmapped = [n for n in unmapped if n not in mtp]
    if unmapped:
        raise UserError(f"--hf {reader.root}: tensor {unmapped[0]} (and {len(unmapped) - 1} more) is not mapped "
                        f"for {spec.architecture}; the checkpoint holds weights this converter would drop")
    absent = sorted(wanted - set(reader.names()))
    if absent:
        raise UserError(f"--hf {reader.root}: tensor {absent[0]} (and {len(absent) - 1} more) is missing; "
                        f"is it a complete {spec.architecture} checkpoint?")
    return len(mtp)


def _materializer(groups: list[names.Group], params: dict, reader: hf_files.HFReader, errors: list):
    """Parameter name -> its whole (TP=1) value from the HF tensors, in its parameter's dtype:
    each HF tensor is read straight into its place in the parameter (Group.views), so the
    parameter is the only copy in memory. A UserError is also kept in `errors`:
    torch.distributed.checkpoint wraps what the planner raises, and the one line must survive that."""
    by_name = {g.megatron: g for g in groups}

    def fused(group, shape, kind) -> torch.Tensor:  # a group without views: build it from whole HF tensors
        full = group.to_megatron([reader.read(n) for n in group.hf])
        if tuple(full.shape) != shape:
            raise UserError(f"--hf {reader.root}: {', '.join(group.hf)} make a {tuple(full.shape)} tensor, "
                            f"config.json implies {shape} for {group.megatron}")
        return full.to(kind)

    def materialize(name: str) -> torch.Tensor:
        try:
            group, shape = by_name[name], tuple(params[name].shape)
            kind = params[name].dtype  # the run's precision; Megatron's expert_bias stays fp32
            if group.views is None:
                return fused(group, shape, kind)
            out = torch.empty(shape, dtype=kind)
            parts = group.views(out)
            if sum(p.numel() for p in parts) != out.numel():
                out.zero_()  # rows no HF tensor fills: the vocabulary's padding
            for hf_name, part in zip(group.hf, parts):
                stored = reader.entry(hf_name).shape
                if part.numel() != math.prod(stored) or tuple(part.shape[part.dim() - len(stored) + 1:]) != stored[1:]:
                    raise UserError(f"--hf {reader.root}: {hf_name} is {stored}, config.json implies "
                                    f"{tuple(part.shape)} for its part of {name} {shape}")
                reader.read_into(hf_name, part)
            return out
        except UserError as exc:
            errors.append(exc)
            raise

    return materialize


def convert(hf: str, save: str, *, tp: int = 1, pp: int = 1, vpp_layers: int | None = None, ep: int = 1,
            etp: int | None = None, divisible_by: int = 128, precision: str | None = None, drop_mtp: bool = False) -> dict:
    """Convert; return {"save", "flags", "spec", "padded_vocab_size", "dropped"}."""
    megatron_model.runtime_first()
    reader = hf_files.HFReader(hf)
    spec = architectures.from_hf_config(reader.config)
    architectures.check_layout(spec, tp, pp, vpp_layers, ep, etp)
    precision = precision or default_precision(reader.config)
    padded = layout.padded_vocab_size(spec.vocab_size, divisible_by, tp)
    groups = name_table.groups(spec, padded)
    dropped = _check_tensor_set(reader, groups, spec, drop_mtp)
    flags = megatron_args.model_flags(spec, divisible_by) + megatron_args.layout_flags(tp, pp, vpp_layers, precision, ep, etp)
    staging.check_target(save)
    with megatron_model.single_rank(), host_memory.cache_off(), staging.staged(save) as tmp:
        dtype = megatron_model.DTYPES[precision]
        with torch.device("meta"):  # keys, shapes and offsets only: tensors are made as they are written
            model = megatron_model.build(spec, padded, dtype)
        params = megatron_model.check_names(model, [g.megatron for g in groups])
        run = {"format": 1, "iteration": ITERATION, "model": megatron_args.fingerprint(spec, padded),
               "layout": None, "optimizer": None, "precision": precision, "source": spec.architecture}
        # checkpoint_version 3.0: Megatron-LM's current layout (it reorders QKV of older ones)
        state = {"model": model.sharded_state_dict(), "iteration": ITERATION, "run": run,
                 "hf_config": reader.config, "checkpoint_version": 3.0}
        path = os.path.join(tmp, f"iter_{ITERATION:07d}")
        os.makedirs(path)
        errors: list[UserError] = []
        try:
            lazy_save.save(state, path, _materializer(groups, params, reader, errors),
                           dcp_regions.locations(model))
        except BaseException:  # torch's CheckpointException is a BaseException
            if errors:
                raise errors[0] from None
            raise
        del model, state
        with open(os.path.join(tmp, TRACKER), "w") as f:
            f.write(str(ITERATION))
        with open(os.path.join(tmp, ARGS_FILE), "w") as f:
            f.write(" ".join(flags) + "\n")
        with open(os.path.join(tmp, HF_CONFIG_FILE), "w") as f:
            json.dump(reader.config, f, indent=2, sort_keys=True)
    return {"save": os.path.abspath(save), "flags": flags, "spec": spec, "padded_vocab_size": padded, "dropped": dropped}
