"""What the four MoE features share, and no feature: the expert layout the command line asks for
and each flag's needs of it (layout.py), and the weight-gradient sum over the chunks of one step
that the overlapped all-to-all and the grouped experts agree on (grad_sink.py), the experts'
weight gradient owed by their backward and run later (deferred_wgrad.py: the grouped experts and
the forward/backward overlap), the all-to-all clock (a2a_clock.py). The features:
moe_grouped_gemm/, moe_fused_permute/, moe_alltoall_overlap/, moe_tp_extend_ep/."""
