"""Which checkpoint `--load` means, and whether it is whole and fits this model, checked
before a single tensor is read.

A damaged or mismatched checkpoint must fail with a sentence naming the file or the flag,
never halfway through a load into the live model (dist_checkpointing loads into the
parameters in place) and never by silently training from scratch on top of it. Every rank
runs the same cheap checks on the same files, so every rank reaches the same verdict.
"""
from __future__ import annotations

import os
import re

from npuspeed.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7})$")
#: Flags that fix the shapes of the saved tensors: a checkpoint loads only where they agree.
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "padded_vocab_size", "max_position_embeddings", "normalization", "swiglu",
               "position_embedding_type", "untie_embeddings_and_output_weights", "disable_bias_linear",
               "num_experts", "moe_ffn_hidden_size", "add_qkv_bias", "qk_layernorm",
               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "multi_latent_attention",
               "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
               "moe_layer_freq", "moe_router_enable_expert_bias")
#: MLA's sizes, which mean something only with --multi-latent-attention
MLA_FLAGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
#: What a checkpoint written before a flag existed holds for it: that flag's default.
_ADDED_LATER = {"add_qkv_bias": False, "qk_layernorm": False, "moe_shared_expert_intermediate_size": None,
                "moe_shared_expert_gate": False, "multi_latent_attention": False, "q_lora_rank": None,
                "kv_lora_rank": None, "qk_head_dim": None, "qk_pos_emb_head_dim": None, "v_head_dim": None,
                "moe_layer_freq": 1, "moe_router_enable_expert_bias": False}


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def model_fingerprint(args) -> dict:
    found = {name: getattr(args, name, None) for name in MODEL_FLAGS}
    if not found["multi_latent_attention"]:
        found.update(dict.fromkeys(MLA_FLAGS))
    if found["moe_layer_freq"] is None:
        found["moe_layer_freq"] = 1
    return found


def complete_iterations(root: str) -> list[int]:
    """Iterations under root whose save finished (the directory was renamed into place)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = _ITER.match(name)
        if match and os.path.isfile(os.path.join(root, name, ".metadata")):
            found.append(int(match.group(1)))
    return sorted(found)


def _tracked(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise UserError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number; write the "
                        "iteration to resume from into it, or pick one with --ckpt-step N")
    return int(text)


def choose(root: str, step: int | None, *, fresh_ok: bool) -> int | None:
    """The iteration to load from root (None: nothing to load and `fresh_ok`)."""
    if not os.path.isdir(root):
        if fresh_ok and not os.path.exists(root):
            return None
        raise UserError(f"--load {root}: no such directory; point --load at a directory written by --save")
    available = complete_iterations(root)
    listed = ", ".join(map(str, available)) or "none"
    if step is not None:
        if step not in available:
            raise UserError(f"--ckpt-step {step}: no complete checkpoint of iteration {step} under {root} "
                            f"(complete ones: {listed})")
        return step
    tracked = _tracked(root)
    if tracked is None and not available:
        if fresh_ok:
            return None
        raise UserError(f"--load {root} holds no checkpoint ({TRACKER} and iter_NNNNNNN/ are missing): "
                        "point --load at a directory written by --save, or drop --load")
    if tracked is None:
        return available[-1]  # killed between renaming the first save into place and the tracker
    if tracked not in available:
        raise UserError(f"--load {root}: {TRACKER} names iteration {tracked}, whose directory is missing or "
                        f"incomplete (complete ones: {listed}); pick one with --ckpt-step N")
    return tracked


def verify_files(path: str, root: str, available: list[int]) -> None:
    """Every file the checkpoint's index refers to is present and long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    others = [i for i in available if iter_dir(root, i) != path]
    hint = (f"load an earlier one with --ckpt-step {others[-1]}" if others else "restore it from a copy")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise UserError(f"checkpoint {path} is damaged: metadata.json is missing; {hint}")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # unpicklable index: as damaged as a missing one
        raise UserError(f"checkpoint {path} is damaged: its .metadata cannot be read ({exc}); {hint}") from exc
    # megatron-core 0.19 keeps the common state in the index ("common_state"), older releases in
    # common.pt; a checkpoint with neither lost it
    in_index = any(key.startswith("common_state") for key in metadata.state_dict_metadata)
    if not in_index and not os.path.isfile(os.path.join(path, "common.pt")):
        raise UserError(f"checkpoint {path} is damaged: common.pt is missing; {hint}")
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise UserError(f"checkpoint {path} is damaged: shard {name} is missing; {hint}")
        have = os.path.getsize(file)
        if have < size:
            raise UserError(f"checkpoint {path} is damaged: shard {name} is truncated ({have} of {size} bytes); "
                            f"{hint}")


def _label(name: str) -> str:
    return "padded vocabulary size" if name == "padded_vocab_size" else "--" + name.replace("_", "-")


def verify_fits(saved: dict | None, args, path: str) -> None:
    """The checkpoint's model flags equal this run's, or one line lists each that differs."""
    if not saved or "model" not in saved:
        raise UserError(f"checkpoint {path} was not written by this example (no run description in "
                        "common.pt); load it with the script that saved it")
    now = model_fingerprint(args)
    then = {k: saved["model"].get(k, _ADDED_LATER.get(k)) for k in now}
    diff = [f"{_label(k)} {then[k]} in the checkpoint, {v} in this run" for k, v in now.items() if then[k] != v]
    if diff:
        hint = ""
        if then["padded_vocab_size"] != now["padded_vocab_size"]:
            hint = (" (the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP: pick a "
                    "--make-vocab-size-divisible-by that pads alike at both layouts)")
        raise UserError(f"checkpoint {path} holds a different model: {'; '.join(diff)}{hint}; use the model "
                        "flags of the run that saved it")
