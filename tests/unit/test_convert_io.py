"""The converter's own file I/O (npuspeed/convert/raw_io.py, safetensors_file.py, the record
reader of dcp_regions.py, names.Group.views): what it reads and writes equals what the
safetensors library and torch.distributed.checkpoint read and write, bitwise, straight into
and out of strided views; a damaged safetensors header is one line naming the shard.
"""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers")

from hf_tiny import make_hf  # noqa: E402

from npuspeed.convert import dcp_regions, hf_files, raw_io, safetensors_file  # noqa: E402
from npuspeed.errors import UserError  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(5, 7, generator=g), "b.bias": torch.randn(3, generator=g).bfloat16(),
            "c.half": torch.randn(2, 3, 4, generator=g).half(), "d.ids": torch.arange(6, dtype=torch.int64),
            "e.scalar": torch.tensor(2.5)}


def test_blocks_are_the_view_in_row_major_order():
    base = torch.arange(4 * 6 * 5).reshape(4, 6, 5)
    for view in (base, base[:, 2:4], base[1:3, :, 1:], base.transpose(0, 1), base[:, :1]):
        pieces = list(raw_io.blocks(view))
        assert all(p.is_contiguous() for p in pieces)
        assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), view.reshape(-1))
    assert len(list(raw_io.blocks(base))) == 1 and len(list(raw_io.blocks(base[:, 2:4]))) == 4


def test_reads_what_safetensors_wrote_into_strided_views(tmp_path):
    path = str(tmp_path / "x.safetensors")
    tensors = _tensors()
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    header = safetensors_file.read_header(path)
    assert set(header) == set(tensors)
    for name, t in tensors.items():
        entry = header[name]
        assert (entry.dtype, entry.shape) == (t.dtype, tuple(t.shape))
        out = torch.empty(t.shape, dtype=t.dtype)
        safetensors_file.read_into(path, entry, out)
        assert torch.equal(out, t), name
    # into a strided view of a bigger tensor (a's 5 rows as rows 1..5 of columns 2..8 of 7 x 10)
    big = torch.zeros(7, 10)
    safetensors_file.read_into(path, header["a.weight"], big[1:6, 2:9])
    assert torch.equal(big[1:6, 2:9], tensors["a.weight"])
    big[1:6, 2:9] = 0
    assert not big.any()  # nothing outside the view was touched
    # another dtype: converted into place as torch would, through a buffer of a few elements
    wide = torch.empty(3)
    safetensors_file.read_into(path, header["b.bias"], wide)
    assert torch.equal(wide, tensors["b.bias"].float())
    narrow = torch.zeros(7, 10, dtype=torch.bfloat16)
    fd = os.open(path, os.O_RDONLY)
    try:
        raw_io.read_into(fd, header["a.weight"].offset, narrow[1:6, 2:9], torch.float32, buffer_bytes=12)
    finally:
        os.close(fd)
    assert torch.equal(narrow[1:6, 2:9], tensors["a.weight"].bfloat16()) and narrow.count_nonzero() == 35


def test_writes_what_safetensors_reads_from_strided_views_in_any_order(tmp_path):
    path = str(tmp_path / "y.safetensors")
    tensors = _tensors()
    fused = torch.randn(4, 9, 7)  # a's rows come from a strided view of it, as q from a fused qkv
    tensors["a.weight"] = fused[:, 2:7].reshape(-1, 7)[:5].clone()
    writer = safetensors_file.Writer(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                                     metadata={"format": "pt"})
    order = ["e.scalar", "c.half", "a.weight", "d.ids", "b.bias"]
    done = [writer.write(n, tensors[n] if n != "a.weight" else fused[:, 2:7].reshape(-1, 7)[:5]) for n in order]
    assert done == [False] * 4 + [True]
    back = safetensors_torch.load_file(path)
    assert set(back) == set(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert (8 + n) % 8 == 0 and json.loads(open(path, "rb").read()[8:8 + n])["__metadata__"] == {"format": "pt"}


@pytest.mark.parametrize("damage, says", [
    (lambda b: b[:6], "shorter than a safetensors header"),
    (lambda b: struct.pack("<Q", 10**6) + b[8:], "its header claims 1000000 bytes"),
    (lambda b: b[:8] + b"[" + b[9:], "its header is not JSON"),
    (lambda b: b[:len(b) - 4], "(truncated?)"),
    (lambda b: b.replace(b'"F32"', b'"F99"', 1), "is not a dtype, shape and data_offsets this reader knows"),
])
def test_damaged_shard_is_one_line(tmp_path, damage, says):
    make_hf(tmp_path / "hf", "llama", shard="40KB")
    shard = sorted(p for p in os.listdir(tmp_path / "hf") if p.endswith(".safetensors"))[1]
    path = tmp_path / "hf" / shard
    path.write_bytes(damage(path.read_bytes()))
    reader = hf_files.HFReader(str(tmp_path / "hf"))
    name = next(n for n, s in reader.shard_of.items() if s == shard)
    with pytest.raises(UserError) as exc:
        reader.read(name)
    line = str(exc.value)
    assert "\n" not in line and f"shard {shard} is damaged" in line and says in line, line
    assert line.endswith("download the model again")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])
def test_views_place_what_to_megatron_builds(tmp_path, arch):
    """Each HF tensor read into its view of the parameter (the converter's path) gives the
    parameter to_megatron builds, padding included, bitwise; and the views are the HF tensors."""
    from npuspeed.convert import architectures, hf_to_megatron, layout, name_table

    make_hf(tmp_path / "hf", arch, shard="40KB")
    reader = hf_files.HFReader(str(tmp_path / "hf"))
    spec = architectures.from_hf_config(reader.config)
    groups = name_table.groups(spec, layout.padded_vocab_size(spec.vocab_size, 128, 1))
    built = {g.megatron: g.to_megatron([reader.read(n) for n in g.hf]) for g in groups}
    params = {k: torch.empty(v.shape, device="meta") for k, v in built.items()}
    materialize = hf_to_megatron._materializer(groups, params, reader, [])
    assert all(g.views is not None for g in groups)
    for g in groups:
        value = materialize(g.megatron)
        assert torch.equal(value, built[g.megatron]), g.megatron
        for name, part in zip(g.hf, g.views(value)):
            assert torch.equal(part.reshape(reader.entry(name).shape), reader.read(name)), name


def _save_two_column_halves(path, full):
    """A dist_checkpointing checkpoint of `full` stored as two column halves (as TP2 stores a
    row-parallel weight), the second of them transposed in memory (a strided record)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    half = full.shape[1] // 2
    left = full[:, :half].clone()
    right = full[:, half:].t().contiguous().t()  # same values, column-major storage
    state = {"l": ShardedTensor.from_rank_offsets("w", left, (1, 0, 2), replica_id=0),
             "r": ShardedTensor.from_rank_offsets("w", right, (1, 1, 2), replica_id=0)}
    dist_checkpointing.save(state, str(path))


def test_reads_regions_across_chunks_as_torch_does(tmp_path, megatron_mp):
    full = torch.randn(6, 8)
    os.makedirs(tmp_path / "ck")
    _save_two_column_halves(tmp_path / "ck", full)
    ckpt = dcp_regions.Checkpoint(str(tmp_path / "ck"))
    records = [dcp_regions._Record(str(tmp_path / "ck" / i.relative_path), i.offset, i.length)
               for index, i in ckpt.metadata.storage_data.items() if index.fqn == "w"]
    assert sorted(r.contiguous() for r in records) == [False, True] and {r.size for r in records} == {(6, 4)}
    whole = torch.empty(6, 8)
    ckpt.read("w", (0, 0), whole)  # each chunk whole: straight into a strided view of `whole`
    assert torch.equal(whole, full)  # both paths ran: straight into place, and the strided record
    part = torch.empty(3, 5)
    ckpt.read("w", (2, 1), part)  # parts of both chunks
    assert torch.equal(part, full[2:5, 1:6])
    with pytest.raises(ValueError, match="holds 4 of the 6 elements"):
        ckpt.read("w", (4, 6), torch.empty(3, 2))  # rows 6.. do not exist


def test_one_parameter_alive_at_a_time(tmp_path, monkeypatch, megatron_mp):
    """hf-to-megatron makes each parameter only after the previous one is gone (torch's own
    FileSystemWriter keeps the last tensor it wrote while the next is made), and the CPU block
    cache is off meanwhile."""
    import weakref

    from npuspeed.convert import hf_to_megatron
    from npuspeed.ops import memory_tracker

    make_hf(tmp_path / "hf", "llama", shard="40KB")
    made, alive, limits = [], [], []
    plain = hf_to_megatron._materializer

    def watched(*args):
        materialize = plain(*args)

        def make(name):
            alive.append([m for m in made if m() is not None])
            limits.append(memory_tracker.cache_limit())
            out = materialize(name)
            made.append(weakref.ref(out.untyped_storage()))  # a view or detached copy keeps it alive
            return out
        return make

    monkeypatch.setattr(hf_to_megatron, "_materializer", watched)
    before = memory_tracker.cache_limit()
    hf_to_megatron.convert(str(tmp_path / "hf"), str(tmp_path / "mg"))
    assert len(made) > 10 and not any(alive), str([len(a) for a in alive])
    if memory_tracker.enabled():
        assert set(limits) == {0} and memory_tracker.cache_limit() == before
