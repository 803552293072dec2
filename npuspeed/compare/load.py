"""Reading one dump (the files npuspeed/features/dump/writer.py streams), checked as it is read:
a missing rank, a damaged line or a folder that is no dump is one UserError naming the file."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from npuspeed.errors import UserError

FORMAT = "npuspeed-dump/1"


def _json_lines(path: str, label: str) -> list[dict]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{label}: {path} line {n} is damaged ({exc.msg}); rerun the dump of that step") from None
    return out


@dataclass
class Dump:
    label: str  # "A" or "B"
    path: str
    layouts: dict[int, dict]  # rank -> layout.json
    losses: dict[int, dict[int, dict]] = field(default_factory=dict)  # rank -> step -> values
    steps: list[int] = field(default_factory=list)  # dumped steps

    @property
    def first(self) -> dict:
        return self.layouts[min(self.layouts)]

    def records(self, step: int) -> dict[int, list[dict]]:
        """rank -> that rank's records of `step`, each with `_dir` (where its tensors are)."""
        out = {}
        for rank in self.layouts:
            folder = os.path.join(self.path, f"step{step}", f"rank{rank}")
            path = os.path.join(folder, "records.jsonl")
            if not os.path.isfile(path):
                raise UserError(f"{self.label}: {path} is missing (step {step} of rank {rank}); the dump is "
                                "incomplete: rerun it, or compare other --steps")
            records = _json_lines(path, self.label)
            for rec in records:
                rec["_dir"] = os.path.join(folder, "dump_tensor_data")
            out[rank] = records
        return out


def load(path: str, label: str) -> Dump:
    if not os.path.isdir(path):
        raise UserError(f"{label}: {path} is not a folder; give the folder a run's --npuspeed-dump wrote")
    ranks = sorted(int(m.group(1)) for name in os.listdir(path) if (m := re.fullmatch(r"rank(\d+)", name))
                   and os.path.isfile(os.path.join(path, name, "layout.json")))
    if not ranks:
        raise UserError(f"{label}: {path} is not an npuspeed dump (no rank*/layout.json); give the folder a "
                        "run's --npuspeed-dump wrote")
    layouts = {}
    for rank in ranks:
        file = os.path.join(path, f"rank{rank}", "layout.json")
        try:
            with open(file) as f:
                layouts[rank] = json.load(f)
        except json.JSONDecodeError as exc:
            raise UserError(f"{label}: {file} is damaged ({exc.msg}); rerun the dump") from None
        if layouts[rank].get("format") != FORMAT:
            raise UserError(f"{label}: {file} is format {layouts[rank].get('format')!r}, this npuspeed reads {FORMAT!r}")
    world = layouts[ranks[0]]["world_size"]
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise UserError(f"{label}: {path} lacks rank(s) {missing} of a {world}-rank run; copy every rank's folder")
    dump = Dump(label, path, layouts)
    for rank in ranks:
        file = os.path.join(path, f"rank{rank}", "loss.jsonl")
        lines = _json_lines(file, label) if os.path.isfile(file) else []
        dump.losses[rank] = {line["step"]: line["values"] for line in lines}
    dump.steps = sorted(int(m.group(1)) for name in os.listdir(path) if (m := re.fullmatch(r"step(\d+)", name)))
    return dump


def step_loss(dump: Dump, step: int) -> float | None:
    """The iteration's loss as the run logs it: each data-parallel replica's mean over micro-batches
    (a [sum, count] pair, Megatron-LM's form, as sum/count), averaged over replicas; read from the
    last pipeline stage's TP-rank-0, CP-rank-0 ranks."""
    per_replica = []
    for rank, layout in dump.layouts.items():
        if layout["tp_rank"] or layout["cp_rank"] or layout["pp_rank"] != layout["pp_size"] - 1:
            continue
        values = dump.losses.get(rank, {}).get(step)
        if not values:
            continue
        key = "lm loss" if "lm loss" in values else sorted(values)[0]
        micro = values[key]
        if all(len(v) == 2 for v in micro):  # [sum, count]
            per_replica.append(sum(v[0] for v in micro) / max(sum(v[1] for v in micro), 1e-30))
        else:
            per_replica.append(sum(v[0] for v in micro) / len(micro))
    return sum(per_replica) / len(per_replica) if per_replica else None


def loss_steps(dump: Dump) -> list[int]:
    return sorted({s for per_rank in dump.losses.values() for s in per_rank})
