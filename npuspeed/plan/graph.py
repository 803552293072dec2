"""A small allocation simulator: a forward as a list of ops, its backward derived from it.

Peak memory under autograd is not a sum of textbook terms: what a step holds is the set of
tensors some op saved for backward (a dropout's mask, a softmax's output, a linear's input),
each storage once however many ops share it; transients come on top (the logits before
their fp32 copy, a weight gradient before it is added into the DDP buffer, a gradient
accumulated from two branches). So each model piece (npuspeed/plan/ops.py) is written as
the ops Megatron-Core 0.16's local modules run, with the tensors each creates and saves,
and this module replays it: forward (allocate outputs, free what nothing reads or saved),
then backward in reverse (allocate input gradients, free output gradients and the saved
tensors whose last reader has run). The results per micro-batch are what the pipeline
schedule (schedule.py) stacks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: storages under this many bytes stay on the device under --swap-attention (its MIN_BYTES)
SWAP_MIN_BYTES = 16 * 1024


@dataclass
class Op:
    name: str
    #: tensors read
    inputs: tuple = ()
    #: tensors made here: name -> bytes (0-byte outputs are views, see `views`)
    outputs: dict = field(default_factory=dict)
    #: tensors (inputs, outputs or extras) kept for backward
    saves: tuple = ()
    #: tensors made here only to be saved (dropout mask, norm statistics): name -> bytes
    extras: dict = field(default_factory=dict)
    #: output name -> the tensor whose storage it views (no allocation)
    views: dict = field(default_factory=dict)
    #: inputs that get a gradient in backward (default: every input that needs one)
    grad_inputs: tuple | None = None
    #: workspace alive during the forward only (a cast copy, an all-gather buffer)
    fwd_temp: int = 0
    #: workspace alive during the backward only (weight gradient before it is accumulated)
    bwd_temp: int = 0
    #: inputs whose gradient is the output's gradient itself (an add: no new tensor)
    pass_grad: tuple = ()
    #: the first input's gradient is written into this op's first saved tensor (in place)
    grad_in_saved: bool = False
    #: the breakdown term this op's saved tensors count under
    term: str = ""
    #: layer whose swapped module (--swap-attention) this op runs in (-1: none): a tensor
    #: only such ops of one layer save leaves the device after its last forward reader and
    #: comes back when backward reaches that layer's module, with the layer below's (prefetch)
    swap: int = -1
    #: a checkpointed block (Megatron's full recompute, ops.py): the layers it reruns in
    #: backward, replayed for this op's temporaries (with `inner_grad` arriving at its output)
    inner: "Graph | None" = None
    inner_grad: int = 0


@dataclass
class Graph:
    ops: list = field(default_factory=list)
    #: tensors that exist before the first op (not freed by the graph): name -> bytes
    inputs: dict = field(default_factory=dict)
    #: tensors without gradients (token ids, masks, positions)
    no_grad: set = field(default_factory=set)

    def add(self, op: Op) -> Op:
        self.ops.append(op)
        return op


@dataclass
class Replay:
    #: bytes the forward leaves allocated (the saved tensors), per micro-batch
    held: int
    #: largest bytes above the start during the forward
    fwd_peak: int
    #: largest bytes above (start + held) during the backward, with the incoming output gradient
    bwd_peak: int
    #: saved bytes by breakdown term
    by_term: dict
    #: bytes swapped to the host per layer (--swap-attention on a device backend)
    swapped: dict = field(default_factory=dict)


def _sizes(graph: Graph):
    size, base, producer = dict(graph.inputs), {}, {}
    for i, op in enumerate(graph.ops):
        for name, nbytes in {**op.outputs, **op.extras}.items():
            producer[name] = i
            if name in op.views:
                root = op.views[name]
                base[name] = base.get(root, root)
                size[name] = nbytes  # the view's own size (its gradient's size)
            else:
                size[name] = nbytes
    return size, base, producer


def replay(graph: Graph, output_grad: int = 0) -> Replay:
    """Forward then backward of one micro-batch; `output_grad` is the gradient arriving for the
    graph's last output (the pipeline's received gradient; 0 for a loss)."""
    for op in graph.ops:
        if op.inner is not None:  # forward: the block's own peak; backward: it all again, then its backward
            r = replay(op.inner, output_grad=op.inner_grad)
            op.fwd_temp, op.bwd_temp = r.fwd_peak, r.held + r.bwd_peak
    size, base, producer = _sizes(graph)
    root = lambda name: base.get(name, name)  # noqa: E731
    last_read, saved_by = {}, {}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            last_read[root(name)] = i
        for name in op.saves:
            saved_by.setdefault(root(name), []).append(i)
    # swapped: saved only by ops of one layer's swapped module -> that layer
    swapped_root = {}
    for r, ix in saved_by.items():
        layers = {graph.ops[i].swap for i in ix}
        if len(layers) == 1 and min(layers) >= 0 and size.get(r, 0) >= SWAP_MIN_BYTES and r not in graph.inputs:
            swapped_root[r] = layers.pop()
    swap_layers = sorted(set(swapped_root.values()))
    last_output = None
    if graph.ops:
        outs = [n for n in graph.ops[-1].outputs]
        last_output = root(outs[-1]) if outs else None

    # Forward.
    alive: dict[str, int] = {}
    cur = peak = 0
    by_term: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for name, nbytes in {**op.outputs, **op.extras}.items():
            if name not in op.views:
                alive[name] = nbytes
                cur += nbytes
        peak = max(peak, cur + op.fwd_temp)
        for name in list(alive):
            if name in saved_by and name not in swapped_root or name == last_output:
                continue
            made = producer.get(name, -1)
            done = max(last_read.get(name, made), max(saved_by.get(name, [made])))
            if done <= i:
                cur -= alive.pop(name)
        for name in op.saves:
            r = root(name)
            if r in alive and r not in swapped_root and saved_by[r][0] == i and op.term:
                by_term[op.term] = by_term.get(op.term, 0) + alive[r]
    held_end = cur
    if last_output in alive and last_output not in saved_by:
        cur -= alive.pop(last_output)  # sent on (pipeline) or a loss: freed by the schedule
    held = cur
    fwd_peak = max(peak, held_end)

    # Backward: gradients flow from the last output.
    start = cur
    grads: dict[str, int] = {}
    if last_output is not None:
        grads[last_output] = output_grad
        cur += output_grad
    bpeak = cur
    first_saver = {r: min(ix) for r, ix in saved_by.items()}
    swapped = {}
    for r, layer in swapped_root.items():
        swapped[layer] = swapped.get(layer, 0) + size.get(r, 0)
    fetched = set()

    def fetch(layer):
        nonlocal cur
        if layer in fetched:
            return
        fetched.add(layer)
        for r, lay in swapped_root.items():
            if lay == layer:
                alive[r] = size.get(r, 0)
                cur += alive[r]

    for i in range(len(graph.ops) - 1, -1, -1):
        op = graph.ops[i]
        if op.swap >= 0 and op.swap in swapped:  # the layer's first unpack: it, and the layer below ahead
            fetch(op.swap)
            below = [layer for layer in swap_layers if layer < op.swap]
            if below:
                fetch(below[-1])
            bpeak = max(bpeak, cur)
        live_out = [n for n in op.outputs if n in grads]
        if live_out:
            wanted = op.grad_inputs if op.grad_inputs is not None else op.inputs
            passed = None
            for name in wanted:
                if name in graph.no_grad or name not in size:
                    continue
                nbytes = size[name]
                if name in op.pass_grad and passed is None and name not in grads:
                    passed = name  # takes over the output's gradient below
                    continue
                if op.grad_in_saved and name == wanted[0] and op.saves:
                    r = root(op.saves[0])
                    if r in alive:
                        cur -= alive.pop(r)  # the saved tensor becomes the gradient
                if name in grads:
                    bpeak = max(bpeak, cur + nbytes + op.bwd_temp)  # a + b, then the old one goes
                else:
                    grads[name] = nbytes
                    cur += nbytes
            bpeak = max(bpeak, cur + op.bwd_temp)
            for name in live_out:
                if passed is not None:
                    grads[passed] = grads.pop(name)
                    passed = None
                else:
                    cur -= grads.pop(name)
        for r, first in first_saver.items():
            if first == i and r in alive:
                cur -= alive.pop(r)
    return Replay(held=held, fwd_peak=fwd_peak, bwd_peak=max(bpeak - start, 0), by_term=by_term, swapped=swapped)
