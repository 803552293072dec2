"""A Hugging Face model directory: `config.json` plus safetensors shards, read and written one
tensor at a time.

Reading goes through `safetensors.safe_open`, which maps a shard and copies out only the
tensor asked for, so a conversion holds the tensors of one Megatron parameter at a time,
never a whole shard, let alone the model. Writing assigns tensors to shards by their byte
size before any is produced, so each output shard is written as soon as its tensors exist.
"""
from __future__ import annotations

import json
import os

import torch

from npuspeed.errors import UserError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _safetensors():
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open
        from safetensors.torch import save_file
    except ImportError as exc:  # pragma: no cover - the environment's, not the code's
        raise UserError("npuspeed convert needs the `safetensors` package: pip install safetensors") from exc
    return safe_open, save_file


class HFReader:
    """The tensors of a Hugging Face directory by name; each read opens its shard lazily."""

    def __init__(self, root: str, flag: str = "--hf"):
        self.root = root
        self.flag = flag  # the option that named the directory, for the error lines
        path = os.path.join(root, CONFIG)
        if not os.path.isfile(path):
            raise UserError(f"{flag} {root}: no {CONFIG}; point {flag} at a Hugging Face model directory")
        try:
            with open(path) as f:
                self.config = json.load(f)
        except ValueError as exc:
            raise UserError(f"{flag} {root}: {CONFIG} is not valid JSON ({exc})") from exc
        self.shard_of = self._index()

    def _index(self) -> dict[str, str]:
        index = os.path.join(self.root, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map") or {}
            for shard in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.root, shard)):
                    raise UserError(f"{self.flag} {self.root}: shard {shard} named in {INDEX} is missing; "
                                    "download the model again")
            return dict(weight_map)
        if os.path.isfile(os.path.join(self.root, SINGLE)):
            safe_open, _ = _safetensors()
            with self._open(SINGLE, safe_open) as f:
                return {name: SINGLE for name in f.keys()}
        raise UserError(f"{self.flag} {self.root}: neither {SINGLE} nor {INDEX}; only safetensors checkpoints convert "
                        "(save the model with save_pretrained(safe_serialization=True))")

    def _open(self, shard: str, safe_open):
        try:
            return safe_open(os.path.join(self.root, shard), framework="pt")
        except Exception as exc:
            raise UserError(f"{self.flag} {self.root}: shard {shard} is damaged ({exc}); download the model again") from exc

    def names(self) -> list[str]:
        return sorted(self.shard_of)

    def has(self, name: str) -> bool:
        return name in self.shard_of

    def read(self, name: str) -> torch.Tensor:
        """One tensor, copied out of its shard."""
        shard = self.shard_of.get(name)
        if shard is None:
            raise UserError(f"{self.flag} {self.root}: tensor {name} is missing from the checkpoint; is it a "
                            f"{(self.config.get('architectures') or ['?'])[0]} checkpoint, complete?")
        safe_open, _ = _safetensors()
        with self._open(shard, safe_open) as f:
            try:
                return f.get_tensor(name)
            except Exception as exc:
                raise UserError(f"{self.flag} {self.root}: tensor {name} in shard {shard} cannot be read ({exc}); "
                                "download the model again") from exc


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most max_bytes each (a bigger tensor gets its own)."""
    shards, current, used = [], [], 0
    for name, size in sizes:
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        shards.append(current)
    return shards


def shard_file(i: int, count: int) -> str:
    return SINGLE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def write_shard(root: str, i: int, count: int, tensors: dict[str, torch.Tensor]) -> str:
    """Write one shard; return its file name."""
    _, save_file = _safetensors()
    name = shard_file(i, count)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(root, name), metadata={"format": "pt"})
    return name


def write_index(root: str, weight_map: dict[str, str], total_bytes: int) -> None:
    if len(set(weight_map.values())) == 1:
        return  # one shard: model.safetensors alone, as save_pretrained writes it
    with open(os.path.join(root, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                  f, indent=2)
        f.write("\n")


def write_config(root: str, config: dict) -> None:
    with open(os.path.join(root, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
