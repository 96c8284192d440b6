"""Cost model: memory per device and time per step of one Plan, from the model's shapes and the cluster.

Three layers, lowest first (a module imports only the ones above it in this list):
  1. Work      work.py: what one token costs in each sub-layer, forward: the GEMMs (with their shapes and how
               tensor parallelism splits them), attention / KDA / sparse-attention FLOPs, elementwise HBM
               traffic, saved activation bytes and parameters. Pure shape arithmetic from the ModelSpec.
               context.py: Ctx (what pricing a part needs) and PartCost (what it returns).
  2. Terms     one function per physical term, each with its source. compute.py: GEMM time (calibrated
               efficiency), elementwise time (HBM roofline), FP8 recipes. comm.py: alpha-beta collectives per
               network tier (ring all-reduce / reduce-scatter / all-gather, flat and hierarchical all-to-all,
               p2p), TP / CP communication. memory.py: gradient, optimizer and activation bytes per recompute
               mode. pipeline.py: pipeline bubbles and in-flight micro-batches per schedule, stage layouts.
  3. evaluate  parts.py: one sub-layer's price (part_cost). step.py: CostModel assembles the terms for a Plan into
               a PlanCost: memory breakdown, time breakdown, step time, tokens/s, TFLOP/s per device and MFU
               (model FLOPs from the profile), and the binding constraint.

Legend: T tokens, h hidden size, s sequence length, H heads, E experts, k top-k, L latent width, I intermediate
size, V vocab, p = pp, v = vpp, m micro-batches per step. Bytes: bf16 = 2. "per token" is always forward.
Model FLOPs (MFU) come from `profile.profile_model` (Megatron's definition); the GEMM list here is the hardware
work, which additionally counts recompute, replicated MLA down-projections under TP, and FlashAttention's
backward recompute.
"""
