"""The dumper: wraps Megatron's schedule (one training iteration per call), attaches a forward
hook to the selected modules at the first dumped iteration, and after the
iteration's backward writes each parameter and its gradient (`main_grad` under Megatron's DDP:
after finalize_model_grads, i.e. reduced over data parallelism) and the iteration's losses.

The backward is seen through hooks on the tensors a module's forward returned and received (their
gradients as autograd produces them), not `register_full_backward_hook`: Megatron modifies module
outputs in place (the residual and bias-dropout-add), which full backward hooks' identity
function forbids ("Output 0 of BackwardHookFunction is a view and is being modified inplace").
An input's gradient is therefore the whole gradient of that tensor (the sum over every module
that read it, as for a layer's input that also feeds the residual).

Module names are the model's own (`decoder.layers.1.input_layernorm`) with the layer index made
global (`layer_number - 1`), so that a pipeline stage's layers carry the names they have in a
single-stage run. A forward run again inside the backward (activation recompute) is not recorded
twice: a forward hook that fires while autograd runs a node is skipped.
"""
from __future__ import annotations

import fnmatch
import functools
import re

import torch

from npuspeed import telemetry
from npuspeed.features.dump.layout import rank_layout
from npuspeed.features.dump.writer import DumpWriter

RECOMPUTE_SKIPPED = "dump.recompute_forwards_skipped"
_LAYER = re.compile(r"(.*\.)?layers\.(\d+)")


def unwrap(chunk):
    """The model inside DDP / Float16Module wrappers (each keeps it as `.module`)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def global_names(root) -> dict[str, str]:
    """{local module name: global name}: `...layers.<i>` renamed `...layers.<layer_number - 1>`."""
    renamed = {}
    for name, module in root.named_modules():
        match = _LAYER.fullmatch(name)
        number = getattr(module, "layer_number", None)
        if match and isinstance(number, int):
            renamed[name] = f"{match.group(1) or ''}layers.{number - 1}"

    def rename(name: str) -> str:
        for local in sorted(renamed, key=len, reverse=True):
            if name == local or name.startswith(local + "."):
                return renamed[local] + name[len(local):]
        return name

    return {name: rename(name) or "model" for name, _ in root.named_modules()}


def _flat(value) -> list:
    """The tensors (and Nones) of a module's output, depth first."""
    if torch.is_tensor(value) or value is None:
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat(v)]
    return []


def _scalars(value):
    if torch.is_tensor(value):
        return [float(x) for x in value.detach().float().reshape(-1).tolist()]
    if isinstance(value, (int, float)):
        return [float(value)]
    return None


class Dumper:
    def __init__(self, root: str, steps, globs, level: str, note):
        self.root, self.steps, self.globs, self.level, self.note = root, steps, globs, level, note
        self.step = 0
        self.active = False
        self.inside = False
        self.writer = None
        self.handles = []
        self.attached = set()
        self.chunks = []
        self.names = {}  # module -> global name
        self.calls = {}  # global name -> forward calls this step (the micro-batch index)
        self.seq = 0

    # --- the schedule -----------------------------------------------------------------------
    def wrap_schedule(self, schedule):
        @functools.wraps(schedule)
        def dumped(*args, **kwargs):
            if self.inside or kwargs.get("forward_only", False):
                return schedule(*args, **kwargs)
            self.inside = True
            try:
                return self._iteration(schedule, args, kwargs)
            finally:
                self.inside = False

        return dumped

    def _iteration(self, schedule, args, kwargs):
        self.step += 1
        dumping = self.steps is None or self.step in self.steps
        if self.writer is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.writer = DumpWriter(self.root, rank, self.level)
        model = kwargs.get("model")
        chunks = [unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]
        if dumping:
            self._attach(chunks)
            self.writer.start_step(self.step)
            self.calls, self.seq = {}, 0
        self.active = dumping
        try:
            losses = schedule(*args, **kwargs)
        finally:
            self.active = False
        if dumping:
            self._parameters()
            self.writer.end_step()
            if self.steps is not None and self.step >= max(self.steps):
                self._detach()
        self._loss(losses)
        return losses

    def _loss(self, losses) -> None:
        """This rank's losses of the iteration: {key: [value per micro-batch]} (the last pipeline
        stage's; other stages write an empty dict)."""
        values = {}
        for item in losses or []:
            if isinstance(item, dict):
                for key, value in item.items():
                    scalars = _scalars(value)
                    if scalars is not None:
                        values.setdefault(key, []).append(scalars)
        self.writer.loss(self.step, values)

    # --- hooks --------------------------------------------------------------------------------
    def _attach(self, chunks) -> None:
        new = [c for c in chunks if id(c) not in self.attached]
        if not new:
            return
        for chunk in new:
            self.attached.add(id(chunk))
            names = global_names(chunk)
            for local, module in chunk.named_modules():
                name = names[local]
                self.names[module] = name
                if any(fnmatch.fnmatchcase(name, g) for g in self.globs):
                    self.handles.append(module.register_forward_hook(self._forward, with_kwargs=True))
        self.chunks = self.chunks + new
        self.writer.write_layout(rank_layout(self.chunks, self._named_parameters()))
        if not any(True for _ in self.handles):
            self.note(f"--npuspeed-dump: --dump-modules {','.join(self.globs)} matches no module; only "
                      "parameters and losses are dumped")

    def _detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _named_parameters(self):
        out = []
        for chunk in self.chunks:
            names = global_names(chunk)
            for local, module in chunk.named_modules():
                for pname, p in module.named_parameters(recurse=False):
                    name = names[local]
                    out.append((f"{pname}" if name == "model" else f"{name}.{pname}", p))
        return out

    def _forward(self, module, args, kwargs, output):
        if not self.active:
            return None
        if torch._C._current_autograd_node() is not None:  # a recompute inside the backward
            telemetry.count(RECOMPUTE_SKIPPED)
            return None
        name, cls = self.names[module], type(module).__name__
        index = self.calls.get(name, 0)
        self.calls[name] = index + 1
        key = f"Module.{name}.{cls}.forward.{index}"
        self.seq += 1
        outputs = _flat(output)
        self.writer.record({"kind": "forward", "name": key, "module": name, "class": cls, "index": index,
                            "seq": self.seq,
                            "output": [self.writer.tensor(t, key, "output", i) for i, t in enumerate(outputs)]})
        inputs = _flat(list(args) + list(kwargs.values()))
        for slot, tensors in (("grad_output", outputs), ("grad_input", inputs)):
            for i, t in enumerate(tensors):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(functools.partial(self._grad, name, cls, index, slot, i))
        return None

    def _grad(self, name, cls, index, slot, i, grad):
        """A gradient reaching one of a module's outputs or inputs, as the backward produces it."""
        if not self.active:
            return None
        key = f"Module.{name}.{cls}.backward.{index}"
        self.seq += 1
        self.writer.record({"kind": "backward", "name": key, "module": name, "class": cls, "index": index,
                            "seq": self.seq, "slot": slot, "i": i,
                            slot: [self.writer.tensor(grad, key, f"{slot}.{i}", 0)]})
        return None

    def _parameters(self) -> None:
        for name, p in self._named_parameters():
            key = f"Parameter.{name}"
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            self.seq += 1
            self.writer.record({"kind": "parameter", "name": key, "module": name, "seq": self.seq,
                                "data": self.writer.tensor(p, key, "data", 0),
                                "grad": self.writer.tensor(grad, key, "grad", 0)})
