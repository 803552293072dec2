"""The files of a dump, streamed: nothing of a step is kept in memory but the tensor being written.

    DIR/rank{R}/layout.json          this rank's layout (layout.py), written once
    DIR/rank{R}/loss.jsonl           one line per training iteration: {"step", "values"}
    DIR/step{N}/rank{R}/records.jsonl one line per record, appended and flushed as it happens
    DIR/step{N}/rank{R}/dump_tensor_data/<record>.<slot>.<i>.pt   (--dump-level tensors)
    DIR/step{N}/rank{R}/dump.json    MindStudio Probe's layout of the same step, written at its end

Record names and statistic keys are MindStudio Probe's (`Module.<name>.<Class>.forward.<n>`,
Max/Min/Mean/Norm, `data_name`), so its tools can open one rank's step; what it lacks (the
layout, the gradients of parameters, the loss, an append-only stream) is in the files above.
"""
from __future__ import annotations

import json
import os

import torch

from npuspeed import telemetry
from npuspeed.features.dump.stats import describe

RECORDS = "dump.records"
FORMAT = "npuspeed-dump/1"


class DumpWriter:
    def __init__(self, root: str, rank: int, level: str):
        self.root, self.rank, self.level = root, rank, level
        self.rank_dir = os.path.join(root, f"rank{rank}")
        os.makedirs(self.rank_dir, exist_ok=True)
        self._records = None
        self.step_dir = None

    def write_layout(self, layout: dict) -> None:
        with open(os.path.join(self.rank_dir, "layout.json"), "w") as f:
            json.dump(layout, f, indent=1)

    def loss(self, step: int, values: dict) -> None:
        with open(os.path.join(self.rank_dir, "loss.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "values": values}) + "\n")

    def start_step(self, step: int) -> None:
        self.step_dir = os.path.join(self.root, f"step{step}", f"rank{self.rank}")
        os.makedirs(self.step_dir, exist_ok=True)
        path = os.path.join(self.step_dir, "records.jsonl")
        self._records = open(path, "w")  # a rerun into the same folder replaces the step

    def tensor(self, t, record: str, slot: str, i: int) -> dict | None:
        """The entry for one tensor: its statistics and, at level tensors, the file it went to."""
        entry = describe(t)
        if entry is not None and self.level == "tensors":
            folder = os.path.join(self.step_dir, "dump_tensor_data")
            os.makedirs(folder, exist_ok=True)
            name = f"{record}.{slot}.{i}.pt"
            # clone: a view would save its whole storage; cpu: loadable anywhere (one tensor at a time)
            torch.save(t.detach().to("cpu", copy=True).contiguous(), os.path.join(folder, name))
            entry["data_name"] = name
        return entry

    def record(self, rec: dict) -> None:
        self._records.write(json.dumps(rec) + "\n")
        self._records.flush()
        telemetry.count(RECORDS)

    def end_step(self) -> None:
        if self._records is None:
            return
        self._records.close()
        self._records = None
        write_msprobe_json(self.step_dir, self.level)


def write_msprobe_json(step_dir: str, level: str) -> None:
    """The step's records in MindStudio Probe's dump.json layout (read back from the stream)."""
    data = {}
    with open(os.path.join(step_dir, "records.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec["kind"] == "forward":
                data[rec["name"]] = {"input_args": [], "input_kwargs": {}, "output": rec["output"]}
            elif rec["kind"] == "backward":  # MindStudio Probe: input = grads of outputs, output = of inputs
                entry = data.setdefault(rec["name"], {"input": [], "output": []})
                entry["input" if rec["slot"] == "grad_output" else "output"].extend(rec[rec["slot"]])
            elif rec["kind"] == "parameter":
                data[rec["name"]] = {"data": rec["data"], "grad": rec["grad"]}
    doc = {"task": "tensor" if level == "tensors" else "statistics", "level": "L0", "framework": "pytorch",
           "dump_data_dir": os.path.join(step_dir, "dump_tensor_data") if level == "tensors" else None, "data": data}
    with open(os.path.join(step_dir, "dump.json"), "w") as f:
        json.dump(doc, f, indent=1)
