"""3. Assemble, one sub-layer: part_cost prices a PartWork for one micro-batch on one device (compute, exposed
communication, recompute, saved activations) from the terms."""

from __future__ import annotations

from moestack.planner.cost.comm import _cp_times, a2a_time, ring_time, tp_comm_times, tp_grad_sum_time
from moestack.planner.cost.compute import (
    GEMM_RECIPES,
    dsa_head_block_factor,
    elementwise_time,
    fp8_cast_bytes,
    fp8_recipe_runs,
    gemm_time,
    moe_time_imbalance,
    recipe_cast_bytes,
)
from moestack.planner.cost.context import Ctx, PartCost
from moestack.planner.cost.memory import activation_bytes, autocast_weight_copies, recompute_mode
from moestack.planner.cost.work import BF16, PartWork


def part_cost(part: PartWork, ctx: Ctx) -> PartCost:
    """Time and saved bytes of one sub-layer for one micro-batch on one device (see module docstring)."""
    plan, cluster, cal = ctx.plan, ctx.cluster, ctx.cal
    tp, etp, ep = plan.tp, plan.etp, plan.ep
    T, Tsp = ctx.tokens, ctx.tokens_sp
    peak = cluster.device.peak_flops("bf16")
    out = PartCost()
    # routed rows on this device: its SP shard's copies gathered over etp, spread over E/ep local experts
    imbalance = moe_time_imbalance(plan, ctx.spec) if part.kind == "moe" else 1.0
    expert_rows = Tsp * part.top_k * etp * imbalance if part.kind == "moe" else 0.0
    rows_per_expert = expert_rows * ep / part.num_experts if part.kind == "moe" else 0.0

    g_fwd = sel_fwd = 0.0
    cast_f = cast_b = 0.0
    for g in part.gemms:
        if g.expert:
            rows, per = expert_rows, rows_per_expert
        elif g.seq_shard:
            rows = per = Tsp  # router / MoE latent projections: replicated weight on the sequence-parallel shard
        else:
            rows = per = T
        t = gemm_time(g, rows, per, tp, etp, plan.precision, cluster, cal)
        g_fwd += t
        if g.selective:
            sel_fwd += t
        if g.fp8 and plan.precision != "fp8" and fp8_recipe_runs(plan.precision, cluster):
            cf, cb = recipe_cast_bytes(g, rows, tp, etp, GEMM_RECIPES[plan.precision], plan.num_microbatches)
            cast_f += cf
            cast_b += cb
        elif g.fp8 and fp8_recipe_runs(plan.precision, cluster):
            cf, cb = fp8_cast_bytes(g, rows, tp, etp)
            cast_f += cf
            cast_b += cb
    attn_f = part.attn_flops * T / tp / (peak * cal.flash_attn_fwd_eff)
    attn_b = 2.5 * part.attn_flops * T / tp / (peak * cal.flash_attn_bwd_eff)
    head_blocks = dsa_head_block_factor(part.heads, tp, cal.sparse_attn_heads) if part.sparse_attn_flops else 1.0
    sparse_f = part.sparse_attn_flops * T * head_blocks / (peak * cal.sparse_attn_fwd_eff)
    sparse_b = 2.0 * part.sparse_attn_flops * T * head_blocks / (peak * cal.sparse_attn_bwd_eff)
    kda_f = part.kda_flops * T / tp / (peak * cal.kda_fwd_eff)
    kda_b = 2.0 * part.kda_flops * T / tp / (peak * cal.kda_bwd_eff)
    # the DSA indexer is replicated: every TP rank scores and selects for the whole sequence (tensor.py)
    idx_f = part.indexer_flops * T / (peak * cal.flash_attn_fwd_eff) + part.topk_elems * T / cal.topk_elems_per_s
    idx_b = 2.0 * part.indexer_flops * T / (peak * cal.flash_attn_bwd_eff)
    # without sequence parallelism the norms and residual adds run on the whole sequence on every TP rank
    sp_whole = part.sp_elem * T * (1 - 1 / tp) if not plan.sequence_parallel else 0.0
    elem_f = elementwise_time(part.elem_bytes * T / tp + sp_whole + cast_f, cluster, cal)
    elem_b = elementwise_time(2.0 * (part.elem_bytes * T / tp + sp_whole) + cast_b, cluster, cal)
    # what a whole-part measurement (tune) found beyond the analytic terms, per token; priced as elementwise work
    # (it is recomputed under selective and full recompute alike)
    measured = cal.parts.get(part.kind)
    if measured is not None:
        elem_f += measured.fwd_fixed_s + measured.fwd_extra_s_per_token * T / tp
        elem_b += measured.bwd_fixed_s + measured.bwd_extra_s_per_token * T / tp
    over = cal.kernel_overhead_s
    core_f = attn_f + sparse_f + kda_f + idx_f
    core_b = attn_b + sparse_b + kda_b + idx_b
    comp_f = g_fwd + core_f + elem_f + over
    comp_b = 2.0 * g_fwd + core_b + elem_b + over

    # tensor parallel (sequence parallel): fwd all-gather in + reduce-scatter out; bwd adds the re-gather of the
    # saved input for wgrad (Korthikanti et al. 2022, Sec. 4.2.2; moestack/parallel/tensor.py keeps the gathered
    # input instead: one collective less, T x h x (1 - 1/tp) more saved bytes per unit, not modelled). moestack's
    # collectives are DTensor redistributes on the compute stream: exposed
    tp_f = tp_b = 0.0
    h = ctx.spec.hidden_size
    if tp > 1 and part.tp_comm:
        coll = ring_time(cluster, T * h * BF16, tp, 1, "ag", ctx.cal.comm)
        tp_f, tp_b = tp_comm_times(plan, coll, g_fwd)
    # the gradient all-reduce of the replicated weights whose local use was partial, in every micro-batch's backward
    # (tensor.py `_LocalView`: synchronous, on the critical path); plan.tp_grad_reduce = deferred sums them once per
    # step instead (CostModel.evaluate, "tp_grad_sum")
    if plan.tp_grad_reduce != "deferred":
        tp_b += tp_grad_sum_time(part, ctx)
    # context parallel (moestack/parallel/context.py): all-gather of the MLA latent (+ indexer keys) overlapped with
    # the attention core; recurrent mixers relay their final state rank to rank, so the ranks run the layer one
    # after another (sequential, exposed), or (KDA, plan.cp_kda = scan) run at once and pay the scan's extra work
    cp_f = cp_b = 0.0
    if plan.cp > 1:
        cp_f, cp_b = _cp_times(part, ctx, attn_f + sparse_f + idx_f, attn_b + sparse_b + idx_b, kda_f, kda_b)
    # expert parallel all-to-all: dispatch + combine each way (+ ETP gather / scatter of dispatched tokens)
    a2a_one = 0.0
    if part.kind == "moe":
        moe = ctx.spec.moe
        assert moe is not None
        # moestack's dispatcher sends bf16 rows under the fp8 recipe too (the experts quantise after it); fp8 rows with
        # per-128 scales only where the plan says so (DeepEP runs; support.py: not launchable here)
        wbytes = 1.03 if plan.ep_dispatch_dtype == "fp8" else BF16
        nbytes = Tsp * part.top_k * part.dispatch_width * imbalance
        groups = None
        if moe.router.topk_groups < moe.router.num_groups:
            groups = moe.router.topk_groups
        disp = a2a_time(cluster, nbytes * wbytes, ep, etp, plan.dispatcher == "hierarchical", part.top_k, groups,
                        ctx.cal.comm)
        comb = a2a_time(cluster, nbytes * BF16, ep, etp, plan.dispatcher == "hierarchical", part.top_k, groups,
                        ctx.cal.comm)
        a2a_one = disp + comb
        if plan.ep_replicas and ep > 1:  # replica weights fetched from their owners (bf16), gradients sent back
            expert_params = sum(g.params for g in part.gemms if g.expert)
            a2a_one += a2a_time(cluster, plan.ep_replicas * expert_params * BF16, ep, 1, False, 1, None,
                                ctx.cal.comm)
        if etp > 1:
            a2a_one += 2 * ring_time(cluster, expert_rows * part.dispatch_width * BF16, etp, 1, "ag", ctx.cal.comm)

    mode = recompute_mode(plan, part)
    out.fwd = comp_f + tp_f + cp_f
    out.bwd = comp_b + tp_b + cp_b
    out.wgrad = g_fwd
    out.a2a = 2 * a2a_one
    if mode == "selective":
        out.recompute = sel_fwd + elem_f
    elif mode == "full":
        out.recompute = comp_f + tp_f + cp_f
        out.a2a += a2a_one
    out.parts = {
        "gemm": 3 * g_fwd,
        "attention": attn_f + attn_b + sparse_f + sparse_b + idx_f + idx_b,
        "kda": kda_f + kda_b,
        "elementwise": elem_f + elem_b + 2 * over,
        "recompute": out.recompute,
        "tp_comm": tp_f + tp_b,
        "cp_comm": cp_f + cp_b,
    }
    out.act = activation_bytes(part, mode, ctx)
    out.act_kept = autocast_weight_copies(part, ctx) if mode == "none" else 0.0
    return out
