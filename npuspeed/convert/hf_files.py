"""A Hugging Face model directory: `config.json` plus safetensors shards, read and written one
tensor at a time.

Reading parses each shard's header once and reads a tensor's bytes straight into the memory it
ends up in (safetensors_file.py: no mmap, no decoded copy), so a conversion holds one Megatron
parameter at a time, never a whole shard, let alone the model. Writing assigns tensors to
shards by their byte size before any is produced, so each tensor goes to its place in its
shard's file as soon as it exists.
"""
from __future__ import annotations

import json
import os

import torch

from npuspeed.convert import safetensors_file
from npuspeed.errors import UserError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


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
        self._headers: dict[str, dict[str, safetensors_file.Entry]] = {}
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
            return {name: SINGLE for name in self._header(SINGLE)}
        raise UserError(f"{self.flag} {self.root}: neither {SINGLE} nor {INDEX}; only safetensors checkpoints convert "
                        "(save the model with save_pretrained(safe_serialization=True))")

    def _header(self, shard: str) -> dict[str, safetensors_file.Entry]:
        if shard not in self._headers:
            try:
                self._headers[shard] = safetensors_file.read_header(os.path.join(self.root, shard))
            except (OSError, ValueError) as exc:
                raise UserError(f"{self.flag} {self.root}: shard {shard} is damaged ({exc}); "
                                "download the model again") from exc
        return self._headers[shard]

    def names(self) -> list[str]:
        return sorted(self.shard_of)

    def has(self, name: str) -> bool:
        return name in self.shard_of

    def entry(self, name: str) -> safetensors_file.Entry:
        """Where tensor `name` is stored (dtype, shape, offset) in its shard."""
        shard = self.shard_of.get(name)
        if shard is None:
            raise UserError(f"{self.flag} {self.root}: tensor {name} is missing from the checkpoint; is it a "
                            f"{(self.config.get('architectures') or ['?'])[0]} checkpoint, complete?")
        entry = self._header(shard).get(name)
        if entry is None:
            raise UserError(f"{self.flag} {self.root}: tensor {name} is not in shard {shard}, where "
                            f"{INDEX} puts it; download the model again")
        return entry

    def read_into(self, name: str, view: torch.Tensor) -> None:
        """Fill `view` (any strides and shape of the tensor's element count) with tensor `name`."""
        entry = self.entry(name)
        try:
            safetensors_file.read_into(os.path.join(self.root, self.shard_of[name]), entry, view)
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.flag} {self.root}: tensor {name} in shard {self.shard_of[name]} cannot be "
                            f"read ({exc}); download the model again") from exc

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard."""
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, out)
        return out


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
