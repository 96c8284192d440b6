"""2. Terms, memory: gradient, optimizer-state and bf16 weight-copy bytes, the recompute mode of a part, and the
saved activation bytes of a sub-layer per recompute mode (moestack's and Megatron's layouts)."""

from __future__ import annotations

from moestack.config.cluster import ClusterSpec
from moestack.config.plan import Plan
from moestack.planner.cost.compute import fp8_recipe_runs, gemm_recipe
from moestack.planner.cost.context import Ctx
from moestack.planner.cost.work import BF16, FP32, PartWork
from moestack.planner.host_profile import framework_of

# activation offload (moestack.memory.offload.ActivationOffloader, max_inflight=2): two layers' saved tensors wait for
# their device-to-host copies while a third is produced (the copies are slower than the compute that fills them);
# a prior: Calibration.act_factors['activation_offload'] scales it (0.58 measured on the H200, ~1.7 layers)
ACT_OFFLOAD_LAYERS = 3


# Dropless routing: the busiest EP rank sets the pace (Plan.moe_load_imbalance, lowered by hot-expert replication:
# moe_time_imbalance); buffers are sized for a 1.5x burst.
MOE_MEMORY_HEADROOM = 1.5


def grad_bytes(plan: Plan) -> float:
    """Bytes per gradient element in the gradient buffers and their data-parallel reduction (Plan.grad_dtype)."""
    return FP32 if plan.grad_dtype == "fp32" else BF16


def bf16_weight_copy(plan: Plan, cluster: ClusterSpec, dense: float, expert: float, vocab: float) -> float:
    """Parameters of one rank held as a bf16 compute copy next to the fp32 master weights (FSDP2's gathered
    parameters; Megatron's bf16 model parameters). With Plan.quantized_params the low-precision GEMMs' weights are
    held only in their GEMM format (the fp8_weights term), so just the embedding / head and the rest stay bf16."""
    if plan.quantized_params and fp8_recipe_runs(plan.precision, cluster):
        return min(dense, vocab)
    return dense + expert


def optimizer_bytes_per_param(optimizer: str) -> float:
    """Optimizer state bytes per parameter: AdamW fp32 m, v (8); AdamW with bf16 m, v (4); Muon momentum (4)."""
    return {"adamw": 8.0, "adamw_bf16": 4.0, "muon": 4.0}[optimizer]


def optimizer_step_bytes(optimizer: str) -> float:
    """HBM traffic per parameter of one optimizer step (read param, grad, states; write param, states)."""
    return {"adamw": 28.0, "adamw_bf16": 20.0, "muon": 20.0}[optimizer]


def recompute_mode(plan: Plan, part: PartWork) -> str:
    r = plan.recompute
    return {"kda": r.kda, "mamba2": r.kda, "mla": r.attention, "gqa": r.attention, "dense": r.mlp,
            "moe": r.moe}[part.kind]


# Not modelled: tensor.py keeps each unit's all-gathered input for backward where Megatron keeps the shard and
# re-gathers (~0.4 GiB per micro-batch on the proxy tp2). Counting it would put the published Megatron runs of
# test_validation.py out of memory (Llama 3 405B TP8 PP16: 177 GiB per GPU); the fix belongs in tensor.py.
def activation_bytes(part: PartWork, mode: str, ctx: Ctx) -> float:
    """Saved bytes of one sub-layer for one micro-batch on one device under recompute `mode`.

    Sequence/tensor parallel split everything but the replicated MLA latents by tp (Korthikanti et al. 2022);
    context parallel splits tokens. Expert-side tensors live on the device that ran the expert: SP-shard tokens x
    top-k copies, with MOE_MEMORY_HEADROOM for dropless bursts. full: only the sub-layer input (SP-sharded).
    """
    T, tp = ctx.tokens, ctx.plan.tp
    factors = ctx.cal.act_factors
    if mode == "full":
        whole = tp if not ctx.plan.sequence_parallel else 1  # plain TP keeps the whole input on every rank
        return T * ctx.spec.hidden_size * BF16 / tp * whole * factors.get("full", 1.0)
    scale = factors.get(mode, 1.0) * (factors.get("fp8", 1.0) if ctx.plan.precision == "fp8" else 1.0)
    # no extra term under expert parallelism: its local experts run the same activation as one device (Experts.glu)
    return scale * _saved_bytes(part, mode, ctx)


def _saved_bytes(part: PartWork, mode: str, ctx: Ctx) -> float:
    """activation_bytes before the measured technique factors (none / selective)."""
    T, tp = ctx.tokens, ctx.plan.tp
    copies = autocast_weight_copies(part, ctx) if mode == "none" else 0.0
    measured = ctx.cal.parts.get(part.kind)
    if measured is not None:
        # measured bytes per token (bf16 storage, no recompute); selective keeps the analytic fraction of them;
        # fp8 storage takes off what the analytic terms say it saves
        frac = 1.0
        if mode == "selective":
            frac = _analytic_act(part, "selective", ctx, False) / max(_analytic_act(part, "none", ctx, False), 1e-9)
        fp8_saving = 0.0
        if ctx.plan.precision == "fp8":
            fp8_saving = _analytic_act(part, mode, ctx, False) - _analytic_act(part, mode, ctx, True)
        # the replicated share (MLA latents, DSA indexer) is not split by tp
        rep = min(part.act_replicated, measured.act_bytes_per_token)
        per_token = (measured.act_bytes_per_token - rep) / tp + rep
        return max(0.0, T * per_token * frac - fp8_saving) + copies + _no_sp_act(part, mode, ctx)
    return _analytic_act(part, mode, ctx, ctx.plan.precision == "fp8") + copies + _no_sp_act(part, mode, ctx)


def _no_sp_act(part: PartWork, mode: str, ctx: Ctx) -> float:
    """Plain TP (no sequence parallelism): the sequence-parallel region's saved tensors (norm input; under no
    recompute also the norm output that feeds the first TP GEMM) are whole on every TP rank, not 1/tp of them
    (Korthikanti et al. 2022, Eq. 2 vs Eq. 4)."""
    tp = ctx.plan.tp
    if ctx.plan.sequence_parallel or tp <= 1:
        return 0.0
    kept = part.sp_keep + (part.sp_sel if mode == "none" else 0.0)
    return ctx.tokens * kept * (1 - 1 / tp)


def autocast_weight_copies(part: PartWork, ctx: Ctx) -> float:
    """bf16 copies of fp32 GEMM weights that autocast makes in forward and autograd keeps for backward: the
    single-device trainer keeps fp32 weights under autocast (distributed plans run FSDP2 with bf16 params, no
    copies). Selective and full recompute redo the casts (memory/recompute.py). The routed experts' copies are
    not kept when their GEMMs go through moestack.memory's expert seam (expert offload, FP8 saved inputs): the
    seam's autograd.Function casts inside its forward and keeps the fp32 weight (or nothing, when offloaded)."""
    if ctx.plan.devices != 1:
        return 0.0
    dense = sum(g.params for g in part.gemms if not g.expert and not g.fp32)
    expert = sum(g.params for g in part.gemms if g.expert) * part.num_experts
    if ctx.plan.offload.experts or ctx.plan.precision == "fp8":
        expert = 0.0
    return BF16 * (dense + expert)


def megatron_saved_delta(part: PartWork, mode: str, plan: Plan, cluster: ClusterSpec) -> float:
    """Saved bytes per token Megatron-Core / Transformer Engine keep beyond (or short of) moestack's terms.

    Megatron applies the routing probabilities inside the experts' activation (the experts take the permuted
    probabilities), so the combine keeps no expert outputs for its backward, only the probabilities. Under a
    low-precision recipe every Transformer Engine linear layer saves its own quantised input for the weight gradient
    (elem + scale bytes): the inputs that only feed GEMMs (the norm output, the activation outputs feeding the down
    projections, the dispatched expert inputs) are stored quantised instead of in bf16; the attention output is
    quantised in addition to the bf16 copy the attention backward reads. plan.fp8_activation_input stores the
    activation function's input (the gate / up outputs) quantised as well."""
    delta = part.top_k * FP32 - part.expert_out if part.kind == "moe" else 0.0
    recipe = gemm_recipe(plan.precision, cluster)
    if recipe is None:
        return delta
    q = recipe.elem_bytes + recipe.scale_bytes
    saved = 1 - q / BF16
    delta -= part.expert_fp8_saved * saved
    if mode == "none":
        delta -= (part.expert_act_selective + part.fc2_in + part.sp_sel) * saved
    if plan.fp8_activation_input:  # the activation function's input kept quantised too (Megatron, DeepSeek-V3)
        delta -= (part.fc1_out + part.expert_fc1_out) * saved
    return delta + part.o_in * q / BF16


def _analytic_act(part: PartWork, mode: str, ctx: Ctx, fp8: bool) -> float:
    """Saved bytes from the analytic per-token terms (`fp8`: GEMM inputs stored in one byte)."""
    T, tp = ctx.tokens, ctx.plan.tp
    if framework_of(ctx.plan.host_profile) == "megatron":  # its own saved-tensor convention instead of the fp8 one
        base = _analytic_act_moestack(part, mode, ctx, False)
        return base + T * megatron_saved_delta(part, mode, ctx.plan, ctx.cluster) / tp
    return _analytic_act_moestack(part, mode, ctx, fp8)


def _analytic_act_moestack(part: PartWork, mode: str, ctx: Ctx, fp8: bool) -> float:
    """_analytic_act as moestack's trainer saves them."""
    T, tp = ctx.tokens, ctx.plan.tp
    # summed over many layers and micro-batches, expert loads average out: stored expert activations use the mean
    # load (the transient dispatch buffers carry MOE_MEMORY_HEADROOM instead)
    keep = part.act_keep - (part.fp8_saved / 2 if fp8 else 0.0)
    expert = part.expert_act - (part.expert_fp8_saved / 2 if fp8 else 0.0)
    if mode == "selective":
        return T * (keep / tp + part.act_replicated + expert / tp)
    sel = part.act_selective + part.expert_act_selective / (2 if fp8 else 1)
    return T * ((keep + sel) / tp + part.act_replicated + expert / tp)
