"""One pipeline message's shape, as Megatron's own sends shape it: DualPipeV's sends and receives
(dualpipev/links.py) and the bubble measure's timed exchange (bubble/measure.py) use it."""
from __future__ import annotations


def message_shape(config, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
    """One pipeline message, as Megatron's own sends shape it: [sequence, micro-batch, hidden],
    the sequence split over context-parallel ranks and, with sequence parallelism, over TP."""
    from megatron.core import parallel_state

    seq = seq_length // parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        seq //= parallel_state.get_tensor_model_parallel_world_size()
    return (seq, micro_batch_size, config.hidden_size)
