"""--moe-alltoall-overlap-comm: MoELayer.forward with the all-to-all dispatcher runs route,
permute, then the chunked dispatch / experts / combine pipeline (pipeline.py), then
unpermute, with the shared experts computed while the first chunk is in flight.

It reuses the dispatcher's own steps (its permutation, its count exchange, its unpermute), so
only the middle changes. Layers it cannot serve take upstream's forward, said once in the log
and the report: activation recompute of the whole MoE layer, latent projections, CUDA-graph
partial capture, expert tensor parallelism (tokens must be whole rows per rank).
"""
from __future__ import annotations

import functools

import torch

from npuspeed import telemetry
from npuspeed.accelerator.devices import for_device
from npuspeed.features.moe_alltoall_overlap import candidates, pipeline

MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
MEGATRON_RANGE = ">=0.16,<0.20"  # route / preprocess / combine_postprocess as separate steps
#: 0.17+: forward computes the shared experts first and calls modules through apply_module, and
#: adds modes this path bypasses (checked in `unsupported`): the dispatch-backward / expert-wgrad
#: overlap, the inference dispatcher, zero-copy expert buffers (those only with the flex/NCCL-EP ones)
RANGES = (">=0.16,<0.17", ">=0.17,<0.20")


def unsupported(layer, intermediate_tensors) -> str | None:
    """Why this call takes upstream's forward, or None."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    disp = layer.token_dispatcher
    if not isinstance(disp, MoEAlltoAllTokenDispatcher):
        return f"the {type(disp).__name__} (only the all-to-all dispatcher is chunked)"
    if disp.tp_size > 1:
        return "expert tensor parallelism (use --moe-tp-extend-ep or --expert-tensor-parallel-size 1)"
    if disp.ep_size == 1:
        return "expert-parallel size 1 (no all-to-all to overlap)"
    if intermediate_tensors is not None or list(getattr(layer, "fwd_execution_map", ())) != [
            "route", "expert_compute", "postprocess"]:
        return "CUDA-graph partial capture"
    if layer.moe_layer_recompute:
        return "recompute of the whole MoE layer ('moe' in --recompute-modules)"
    if layer.config.moe_latent_size:
        return "MoE latent projections"
    if layer.shared_expert_overlap:
        return "Megatron's own --moe-shared-expert-overlap"
    if layer.config.moe_router_padding_for_quantization:
        return "router padding for quantization"
    if getattr(layer.config, "overlap_dispatch_backward_with_experts_wgrad", False):
        return "Megatron's --overlap-dispatch-backward-with-experts-wgrad"
    if getattr(layer, "_inference_token_dispatcher", None) is not None:
        return "the inference-optimized dispatcher"
    return None


def _counts(disp, routing_map) -> tuple[list[list[int]], list[list[int]]]:
    """(send[j][l], recv[s][l]) from what the dispatcher computed (no new collective)."""
    ep, local = disp.ep_size, disp.num_local_experts
    if disp.drop_and_pad:
        full = [[int(disp.capacity)] * local for _ in range(ep)]
        return full, [row[:] for row in full]
    sent = routing_map.sum(dim=0).tolist()
    send = [sent[j * local:(j + 1) * local] for j in range(ep)]
    if local > 1:
        got = torch.as_tensor(disp.num_global_tokens_per_local_expert).reshape(ep, local).tolist()
    else:
        got = [[int(n)] for n in disp.output_splits]
    return send, got


def forward_wrapper(chunks: int, note):
    def wrap(original):
        @functools.wraps(original)
        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if not candidates.chunked_now():  # the step trial's turn, or its decision: Megatron's layer
                telemetry.count("moe.a2a_overlap.megatron_layer")
                return original(self, hidden_states, intermediate_tensors, padding_mask)
            why = unsupported(self, intermediate_tensors)
            if why:
                note(f"--moe-alltoall-overlap-comm: a MoE layer runs Megatron's unchunked path: {why}")
                telemetry.count("moe.a2a_overlap.fallback")
                return original(self, hidden_states, intermediate_tensors, padding_mask)
            if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
                raise ValueError("During training, performance may degrade if MoE and tensor parallelism"
                                 "are enabled without also enabling sequence parallelism.")
            if padding_mask is not None:
                padding_mask = padding_mask.transpose(0, 1).bool()
            probs, routing_map = self.route(hidden_states, padding_mask)
            tokens, probs = self.preprocess(hidden_states, probs, routing_map)
            disp = self.token_dispatcher
            send, recv = _counts(disp, disp.routing_map)
            plan = pipeline.make_plan(send, recv, chunks, tokens.device)
            shared = None
            if self.use_shared_expert:
                shared = functools.partial(_shared_experts, self, hidden_states)
            # Megatron's unfused unpermute and npuspeed's CPU op read sorted_indices as "row r
            # belongs to token idx[r]", so the chunk-major rows go straight in with the index
            # composed (no reordering copy); torch_npu's and TE's fused ops keep their own maps.
            compose = (plan.to_chunks is not None and not for_device(tokens).has_vendor_kernels()
                       and not self.config.moe_permute_fusion)
            rows, shared_out = pipeline.run(self.experts, tokens, probs, plan, disp.ep_group, shared,
                                            restore_order=not compose)
            if compose:
                disp.reversed_local_input_permutation_mapping = (
                    disp.reversed_local_input_permutation_mapping.index_select(0, plan.to_chunks))
            disp.tokens_per_expert = None
            output = disp.combine_postprocess(rows)
            if shared_out is not None:
                output = output + shared_out
            return output, None

        return forward

    return wrap


def _shared_experts(layer, hidden_states):
    """Megatron's shared_experts_compute, called while the first chunk is in flight."""
    from megatron.core import tensor_parallel

    if layer.shared_experts_recompute:
        return tensor_parallel.checkpoint(layer.shared_experts, False, hidden_states)
    return layer.shared_experts(hidden_states)
