"""Megatron dist_checkpointing checkpoint (any TP/PP/VPP layout) -> Hugging Face directory.

Each parameter is stored with its global shape whatever layout saved it, so its whole (TP=1)
value is read straight from the checkpoint, one parameter at a time (dcp_regions.py: the
model exists only on the meta device, to say where each parameter is stored); each Hugging
Face tensor is then written from its place in the parameter (a view: the fused tensors are
not split into copies, the vocabulary padding is left out) to its place in its safetensors
shard (safetensors_file.py: the shards' headers come from the shapes alone), so neither a
shard nor a second copy of a parameter is ever in memory. Shards hold at most
--max-shard-size bytes, with `model.safetensors.index.json`, as `save_pretrained` lays them out. The architecture comes
from the Hugging Face config.json the converter stored in the checkpoint, or --hf-config.
"""
from __future__ import annotations

import json
import math
import os
import re

import torch

from npuspeed.convert import (
    architectures, dcp_regions, hf_files, host_memory, megatron_args, megatron_model, name_table,
    safetensors_file, staging,
)
from npuspeed.convert.hf_to_megatron import HF_CONFIG_FILE, TRACKER
from npuspeed.errors import UserError, one_line

_ITER = re.compile(r"^iter_(\d{7})$")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_EMBEDDING = "embedding.word_embeddings.weight"


def checkpoint_dir(load: str, step: int | None = None) -> str:
    """The iteration directory `--load` means: --ckpt-step, else the tracker's, else the latest."""
    if not os.path.isdir(load):
        raise UserError(f"--load {load}: no such directory")
    done = sorted(int(m.group(1)) for m in map(_ITER.match, os.listdir(load))
                  if m and os.path.isfile(os.path.join(load, m.group(0), "metadata.json")))
    if step is None:
        tracker = os.path.join(load, TRACKER)
        text = open(tracker).read().strip() if os.path.isfile(tracker) else ""
        step = int(text) if text.isdigit() else (done[-1] if done else None)
    if step is None or step not in done:
        raise UserError(f"--load {load}: no complete checkpoint of iteration {step} (complete ones: "
                        f"{', '.join(map(str, done)) or 'none'})")
    return os.path.join(load, f"iter_{step:07d}")


def _hf_config(load: str, common: dict, given: str | None) -> dict:
    if given:
        path = os.path.join(given, "config.json") if os.path.isdir(given) else given
        if not os.path.isfile(path):
            raise UserError(f"--hf-config {given}: no config.json there")
        with open(path) as f:
            return json.load(f)
    if isinstance(common.get("hf_config"), dict):
        return common["hf_config"]
    beside = os.path.join(load, HF_CONFIG_FILE)
    if os.path.isfile(beside):
        with open(beside) as f:
            return json.load(f)
    raise UserError(f"--load {load}: the checkpoint does not say which Hugging Face model it is; pass the "
                    "original model's config.json with --hf-config PATH")


def _check_same_model(common: dict, spec, padded: int, path: str) -> None:
    saved = (common.get("run") or {}).get("model")
    if not saved:
        return
    want = megatron_args.fingerprint(spec, padded)
    diff = [f"{k} {saved.get(k)} in the checkpoint, {v} in config.json" for k, v in want.items()
            if k in saved and k not in ("kv_channels", "max_position_embeddings") and saved[k] != v]
    if diff:
        raise UserError(f"checkpoint {path} holds a different model than the Hugging Face config: {'; '.join(diff)}; "
                        "pass the matching config.json with --hf-config")


def _plan(groups, params, dtypes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(HF name, dtype, shape) of every output tensor, in order, from shapes alone."""
    out = []
    for group in groups:
        meta = torch.empty(params[group.megatron].shape, dtype=dtypes[group.megatron], device="meta")
        out += [(name, t.dtype, tuple(t.shape)) for name, t in zip(group.hf, group.to_hf(meta))]
    return out


def _read(checkpoint, group, params, where, dtypes) -> torch.Tensor:
    """The whole (TP=1) value of the group's parameter, read from the checkpoint."""
    key, prefix = where[group.megatron]
    shape = tuple(params[group.megatron].shape)
    dest = torch.empty((1,) * len(prefix) + shape, dtype=dtypes[group.megatron])
    checkpoint.read(key, prefix + (0,) * len(shape), dest)
    return dest.view(shape)


def convert(load: str, save: str, *, hf_config: str | None = None, step: int | None = None,
            max_shard_bytes: int = 5 * 2**30) -> dict:
    """Convert; return {"save", "shards", "tensors"}."""
    megatron_model.runtime_first()
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(load, step)
    staging.check_target(save)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
        metadata = dist_checkpointing.load_tensors_metadata(path)
    except Exception as exc:
        raise UserError(f"checkpoint {path} cannot be read ({exc})") from exc
    cfg = dict(_hf_config(load, common, hf_config))
    spec = architectures.from_hf_config(cfg)
    if _EMBEDDING not in metadata:
        raise UserError(f"checkpoint {path} holds no {_EMBEDDING}: not a GPTModel checkpoint")
    padded, dtype = metadata[_EMBEDDING].global_shape[0], metadata[_EMBEDDING].dtype
    _check_same_model(common, spec, padded, path)
    groups = name_table.groups(spec, padded)
    with megatron_model.single_rank(), host_memory.cache_off(), staging.staged(save) as tmp:
        with torch.device("meta"):  # shapes and stored locations only: no weights in memory
            model = megatron_model.build(spec, padded, dtype)
        params = megatron_model.check_names(model, [g.megatron for g in groups])
        where = dcp_regions.locations(model)
        missing = [g.megatron for g in groups if where.get(g.megatron, ("",))[0] not in metadata]
        if missing:
            raise UserError(f"checkpoint {path} holds no {missing[0]} of {spec.architecture}: it is a checkpoint "
                            "of another model; pass its config.json with --hf-config")
        dtypes = {g.megatron: metadata[where[g.megatron][0]].dtype for g in groups}
        tensors = _plan(groups, params, dtypes)
        layout = {name: (dtype, shape) for name, dtype, shape in tensors}
        shards = hf_files.plan_shards([(n, math.prod(s) * d.itemsize) for n, d, s in tensors], max_shard_bytes)
        shard_index = {name: i for i, shard in enumerate(shards) for name in shard}
        checkpoint = dcp_regions.Checkpoint(path)
        writers: dict[int, safetensors_file.Writer] = {}
        weight_map, total = {}, 0
        try:
            for group in groups:
                try:
                    value = _read(checkpoint, group, params, where, dtypes)
                except Exception as exc:
                    raise UserError(f"checkpoint {path} cannot be read as {spec.architecture} of config.json "
                                    f"({one_line(exc)[:300]})") from exc
                # each HF tensor goes from its place in the parameter to its place in its shard
                parts = group.views(value) if group.views is not None else group.to_hf(value)
                for name, part in zip(group.hf, parts):
                    i = shard_index[name]
                    if i not in writers:
                        file = hf_files.shard_file(i, len(shards))
                        writers[i] = safetensors_file.Writer(os.path.join(tmp, file), [
                            (n, *layout[n]) for n in shards[i]], metadata={"format": "pt"})
                        weight_map.update({n: file for n in shards[i]})
                    total += part.numel() * part.element_size()
                    if writers[i].write(name, part):
                        del writers[i]
                del value, parts
                host_memory.give_back()
        finally:
            for writer in writers.values():
                writer.close()
        hf_files.write_index(tmp, weight_map, total)
        key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
        cfg[key] = _DTYPE_NAMES[dtype]
        hf_files.write_config(tmp, cfg)
    return {"save": os.path.abspath(save), "shards": len(shards), "tensors": len(weight_map)}
