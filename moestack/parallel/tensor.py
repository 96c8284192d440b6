"""Tensor parallelism (Megatron-style head / column sharding) with optional sequence parallelism, from outside.

`apply_tp(model, tp_mesh, sequence_parallel)` turns every parameter it owns into a DTensor on the 1-D TP mesh --
Shard(0) for column-parallel weights and per-head parameters, Shard(1) for row-parallel weights, Replicate for the
rest -- so the optimizer, gradient clipping, FSDP2 and DCP see global shapes. The model code stays single-device:

* Parameters. During the forward of a "TP unit" (a mixer, an FFN, a norm, the embedding, the LM head) a wrapper
  of the instance's forward swaps the unit's DTensor parameters for their local shards, so the projections and
  direct weight reads (KDA `A_log` / `dt_bias` / short convs, MLA `kv_b_proj.weight` in the absorbed sparse path,
  the LM-head weight read by the chunked loss) all see this rank's heads; the mixers take their head counts from
  their projections' widths (`view(B, T, -1, K)`), so nothing else changes. After the forward the global DTensors
  are restored. In backward the local
  gradient is wrapped back into a DTensor with the parameter's placement; a replicated parameter whose local use
  saw only part of the work (it feeds head-sharded projections, or runs on a sequence shard) has its gradient
  summed over the TP group first ("sum"), and the DSA indexer's gradient is averaged ("avg", see below).
* Activations stay plain local tensors; the collectives at unit boundaries are DTensor redistributes:
  without SP, Megatron's f (identity, all-reduce in backward) before a sharded unit and g (all-reduce) after it;
  with SP the residual stream is sequence-sharded [B, T/tp, D] and they become all-gather / reduce-scatter.

Per module (H heads, tp ranks, H % tp == 0):
  KDA        q/k/v/g (or g_b), f (or f_b), b projections and the three short convs by head (Shard(0)); A_log,
             dt_bias by head; f_a / g_a (low rank) and o_norm (one [K] weight shared by all heads) replicated,
             gradients summed; o_proj row-wise.
  Gated MLA  q_b (or q), kv_b, g projections by head; q_a, kv_a and their norms replicated (low rank), gradients
             summed; o_proj row-wise. The lightning indexer is replicated and runs on every rank: its scores and
             top-k are identical everywhere. Its KL target is the attention distribution averaged over the heads,
             so each rank's target covers only its heads; the KL gradient is linear in the target and every head
             group has H/tp heads, so the mean over ranks of the local gradients is the exact gradient ("avg").
             (`last_indexer_loss` is the rank-local KL, for logging.)
  GQA        q/k/v (+ biases), g by head (num_kv_heads % tp == 0); q_norm / k_norm replicated, summed; o_proj
             row-wise.
  dense MLP  gate/up column-wise, down row-wise.
  MoE        token-sharded: each TP rank runs router, dispatch and experts on its own tokens (with SP: its
             sequence shard, no communication; without: a slice of the replicated input, outputs all-gathered).
             Two ranks of one TP group must never both process a token: with expert parallelism folded onto the
             TP ranks that would count every token twice. Router, latent down/up projections and latent norm are
             replicated with summed gradients; routed experts are left to expert parallelism when they are
             already DTensors (`moestack.parallel.expert`), else replicated with summed gradients. The fused
             shared experts are column/row sharded over all tokens of the group (all-gather / reduce-scatter of
             rows). The sequence-wise aux loss needs the expert counts of the whole sequence: apply_tp sets
             `moe.seq_shard_group`, over which MoE.sequence_aux_loss must sum its counts (a model change; without
             it the aux-loss gradient uses each shard's own counts and is not exact).
  embedding  replicated; with SP every rank embeds the whole sequence and keeps its shard (backward: all-gather
             of the output gradient, so the weight gradient is complete without an all-reduce).
  LM head    replicated (the chunked cross-entropy takes the full [V, D] weight); with SP the loss is computed on
             the local sequence shard and combined exactly: sum of token losses / number of counted tokens over
             the TP group. `model(tokens)` without targets returns all-gathered logits.
  norms      replicated; with SP their gradients (from sequence shards) are summed. The same for the Attention
             Residual mixes (Block.attn_res / ffn_res, Transformer.out_res: token-local, like a norm).

Requirements: T % tp == 0 with SP; with SP call the model through `model(tokens, targets)` (the hooks on the
root slice the targets and combine the loss; `hidden_states()` alone returns the local sequence shard).
Order with other parallelisms: expert parallelism before apply_tp (apply_tp leaves parameters that are already
DTensors alone); activation recompute and FSDP2 after it (recompute then reruns the swap; the unit-boundary
collectives are module hooks, outside the recomputed region). Initialise weights before apply_tp (the full model
is sharded by slicing), or build on meta, parallelise, then `moestack.parallel.init.materialize` (the same values).

Cost: with `grad_reduce="eager"` (default) the "sum" / "avg" gradient reductions run in every backward (each
micro-batch), one synchronous all-reduce per parameter. That is cheap for norms, low-rank projections and the
indexer, but not for the token-sharded MoE's replicated weights (router, latent down / up projections, routed
experts without expert parallelism) nor, with SP, for the [V, D] LM head. `grad_reduce="deferred"` keeps the local
partial gradients through all micro-batches (and FSDP's reduce-scatter: sums over TP and over DP commute, so it
then reduces the smaller sharded gradient) and sums them over TP once per optimizer step in a few flat buckets:
`finish_tp_grad_reduce(model)` after the step's last backward, before anything reads the gradients (the optimizer
refuses to step while sums are pending once `guard_tp_grad_reduce` is installed; the trainer does both). A
parameter with a partial use gets ONE sum over TP, so its other uses are pre-divided by tp in backward: "avg"
uses, and complete (rule None) uses of a tied weight, e.g. the embedding tied to an SP LM head. The head still
wants a vocab-parallel chunked cross-entropy.

Legend: B batch, T tokens (T_l = T / tp with SP), D hidden, H heads, N rows (tokens) of a flattened batch.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from moestack.model.dsa import GatedMLA
from moestack.model.gqa import GQAAttention
from moestack.model.kda import KDAAttention
from moestack.model.loss import IGNORE_INDEX, chunked_cross_entropy
from moestack.model.mlp import GLUMLP
from moestack.model.moe import MoE
from moestack.model.transformer import Transformer
from moestack.model.wrappers import wrap_forward

Reduce = Literal["sum", "avg"] | None
GradReduce = Literal["eager", "deferred"]  # when partial gradients are summed over TP: every backward, once a step
COL, ROW, REP = Shard(0), Shard(1), Replicate()
SEQ_DIM = 1  # the sequence dim of [B, T, D] activations and [B, T] tokens

# ---------------------------------------------------------------------------------------------------------------
# activation mappings: local tensor in, local tensor out; the DTensor wrapper only describes the collective


def copy_to_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Megatron f: identity forward; backward all-reduces the partial input gradients of a sharded unit."""
    return DTensor.from_local(x, mesh, (REP,), run_check=False).to_local(grad_placements=(Partial(),))


def reduce_from_tp(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Megatron g: all-reduce (sum) of partial outputs; backward identity (every rank holds the same output)."""
    return DTensor.from_local(x, mesh, (Partial(),), run_check=False).redistribute(mesh, (REP,)).to_local()


def gather_shards(x: torch.Tensor, mesh: DeviceMesh, dim: int, partial_grad: bool) -> torch.Tensor:
    """All-gather the shards along `dim`. Backward: reduce-scatter when the consumer is sharded (each rank's
    gradient is a partial sum, `partial_grad`), else keep this rank's slice of the (replicated) gradient."""
    full = DTensor.from_local(x, mesh, (Shard(dim),), run_check=False).redistribute(mesh, (REP,))
    return full.to_local(grad_placements=(Partial(),) if partial_grad else None)


def scatter_shards(x: torch.Tensor, mesh: DeviceMesh, dim: int, partial: bool) -> torch.Tensor:
    """This rank's shard along `dim`: reduce-scatter of partial outputs (`partial`) or a slice of a replicated
    tensor. Backward: all-gather of the shard gradients."""
    assert x.shape[dim] % mesh.size() == 0, f"dim {dim} of size {x.shape[dim]} does not split over {mesh.size()} ranks"
    src = (Partial(),) if partial else (REP,)
    return DTensor.from_local(x, mesh, src, run_check=False).redistribute(mesh, (Shard(dim),)).to_local()


def shard_slice(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """This rank's contiguous block of a replicated, gradient-free tensor (token ids, targets) along `dim`."""
    n = mesh.size()
    assert x.shape[dim] % n == 0, f"dim {dim} of size {x.shape[dim]} does not split over {n} TP ranks"
    return x.chunk(n, dim=dim)[mesh.get_local_rank()]


# ---------------------------------------------------------------------------------------------------------------
# parameter views


class _PendingTPGrads:
    """The deferred TP gradient sums of one `apply_tp(..., grad_reduce="deferred")`: `pending` is set by every
    backward through a deferred view and cleared by `finish_tp_grad_reduce`."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.pending = False


class _LocalView(torch.autograd.Function):
    """DTensor parameter -> its local tensor; the local gradient comes back as a DTensor with the parameter's
    placement, summed (or averaged) over the mesh first when `reduce` says the local use was partial.

    With `defer` (grad_reduce="deferred", the parameter has a partial use) nothing is communicated: the sum over
    the mesh happens once per step in `finish_tp_grad_reduce`, so a use that must not be summed ("avg", or a
    complete use of a tied weight) is divided by the mesh size here (the later sum restores it)."""

    @staticmethod
    def forward(ctx, param: DTensor, reduce: Reduce, defer: _PendingTPGrads | None) -> torch.Tensor:
        ctx.spec = (param.device_mesh, param.placements, param.shape, param.stride())
        ctx.reduce, ctx.defer = reduce, defer
        local = param.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mesh, placements, shape, stride = ctx.spec
        grad = grad.contiguous()
        if ctx.defer is not None:
            ctx.defer.pending = True
            if ctx.reduce != "sum":
                grad = grad / mesh.size()
        elif ctx.reduce is not None:
            grad = grad.clone()  # all_reduce writes in place
            dist.all_reduce(grad, group=mesh.get_group())  # SUM: gloo has no AVG
            if ctx.reduce == "avg":
                grad.div_(mesh.size())
        grad = DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)
        return grad, None, None


def _local_view(param: DTensor, reduce: Reduce, defer: _PendingTPGrads | None = None) -> torch.Tensor:
    if torch.is_grad_enabled() and param.requires_grad:
        return _LocalView.apply(param, reduce, defer)
    return param.to_local()


class _Unit:
    """The parameters (owner module, attribute, reduce, deferred-sum tracker or None) swapped while one module runs.
    Head counts are not swapped: the mixers read theirs from their projections' widths."""

    def __init__(self, params: list[tuple[nn.Module, str, Reduce, _PendingTPGrads | None]]):
        self.params = params
        self._saved: list[list] = []  # a stack: one frame per active forward

    def enter(self) -> None:
        frame = []
        for owner, name, reduce, defer in self.params:
            param = owner._parameters[name]
            frame.append((owner, name, param))
            owner._parameters[name] = _local_view(param, reduce, defer)  # a plain tensor for the module's forward
        self._saved.append(frame)

    def exit(self) -> None:
        for owner, name, value in reversed(self._saved.pop()):
            if getattr(owner._parameters[name], "_no_weight_decay", False):  # tagged by init_weights
                value._no_weight_decay = True
            owner._parameters[name] = value


def _wrap_forward(module: nn.Module, unit: _Unit) -> None:
    """Run the module's forward with the unit entered. The swap lives in the instance's `forward` (not in a module
    hook) so that activation recompute applied afterwards (moestack.memory.recompute wraps `forward`) reruns it."""

    def make(inner):
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            unit.enter()
            try:
                return inner(*args, **kwargs)
            finally:
                unit.exit()

        return forward

    wrap_forward(module, "tp", make)


# ---------------------------------------------------------------------------------------------------------------
# sharding plans: parameter name (relative to the unit) -> (placement, gradient reduction)

Rule = tuple[Placement, Reduce]
PARTIAL_REP: Rule = (REP, "sum")  # replicated, local use is partial: sum the gradients over TP


def _kda_plan(m: KDAAttention, tp: int) -> dict[str, Rule]:
    _check_div(m.num_heads, tp, "kda.num_heads")
    _check_div(m.num_v_heads, tp, "kda.num_v_heads")
    col = (COL, None)
    plan = {f"{p}.weight": col for p in ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv", "b_proj")}
    plan |= {"f_proj.weight": col, "f_b_proj.weight": col, "f_a_proj.weight": PARTIAL_REP}
    plan |= {"g_proj.weight": col, "g_b_proj.weight": col, "g_a_proj.weight": PARTIAL_REP}
    plan |= {"A_log": col, "dt_bias": col, "o_norm.weight": PARTIAL_REP, "o_proj.weight": (ROW, None)}
    return plan


def _mla_plan(m: GatedMLA, tp: int) -> dict[str, Rule]:
    _check_div(m.num_heads, tp, "mla.num_heads")
    col = (COL, None)
    plan = {"q_proj.weight": col, "q_b_proj.weight": col, "kv_b_proj.weight": col, "g_proj.weight": col}
    plan |= {f"{p}.weight": PARTIAL_REP for p in ("q_a_proj", "q_a_norm", "kv_a_proj", "kv_a_norm")}
    plan["o_proj.weight"] = (ROW, None)
    if m.indexer is not None:
        plan |= {f"indexer.{n}": (REP, "avg") for n, _ in m.indexer.named_parameters()}
    return plan


def _gqa_plan(m: GQAAttention, tp: int) -> dict[str, Rule]:
    _check_div(m.num_kv_heads, tp, "gqa.num_kv_heads")
    assert m.o_proj.bias is None, "a row-parallel o_proj bias would be added tp times"
    col = (COL, None)
    plan = {f"{p}.{w}": col for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")}
    plan |= {"g_proj.weight": col, "q_norm.weight": PARTIAL_REP, "k_norm.weight": PARTIAL_REP}
    plan["o_proj.weight"] = (ROW, None)
    return plan


def _glu_plan(m: GLUMLP, tp: int, prefix: str = "") -> dict[str, Rule]:
    _check_div(m.gate_proj.out_features, tp, "intermediate size")
    return {f"{prefix}gate_proj.weight": (COL, None), f"{prefix}up_proj.weight": (COL, None),
            f"{prefix}down_proj.weight": (ROW, None)}


def _moe_plan(m: MoE, tp: int) -> dict[str, Rule]:
    plan = {"router.weight": PARTIAL_REP, "down_proj.weight": PARTIAL_REP, "up_proj.weight": PARTIAL_REP,
            "latent_norm.weight": PARTIAL_REP, "experts.w_gate_up": PARTIAL_REP, "experts.w_down": PARTIAL_REP}
    if m.shared is not None:
        plan |= _glu_plan(m.shared, tp, "shared.")
    return plan


def _check_div(n: int, tp: int, what: str) -> None:
    if n % tp:
        raise ValueError(f"tensor parallelism: {what} ({n}) is not divisible by tp ({tp})")


# ---------------------------------------------------------------------------------------------------------------
# applying a plan


class _Distributor:
    """Converts parameters to DTensors once (tied weights stay tied) and builds the units."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self._done: dict[int, nn.Parameter] = {}

    def unit(self, module: nn.Module, plan: dict[str, Rule], default: Rule | None = None) -> _Unit:
        """Distribute every plain parameter under `module` by `plan` (names relative to `module`; a name not in
        the plan takes `default`, or is an error without one) and return the unit swapping them."""
        params = []
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if isinstance(param, DTensor):
                continue  # distributed by someone else (expert parallelism): not ours to swap
            rule = plan.get(name, default)
            if rule is None:
                raise KeyError(f"tensor parallelism: no sharding rule for {type(module).__name__}.{name}")
            placement, reduce = rule
            setattr(owner, leaf, self._distribute(param, placement))
            params.append((owner, leaf, reduce, None))  # deferral is decided once all units exist
        return _Unit(params)

    def _distribute(self, param: nn.Parameter, placement: Placement) -> nn.Parameter:
        if id(param) not in self._done:  # a tied weight is converted once, through its first module
            if isinstance(placement, Shard):
                _check_div(param.shape[placement.dim], self.mesh.size(), f"dim {placement.dim} of {tuple(param.shape)}")
            # src_data_rank None: slice the local copy, no communication (every rank holds the same weights)
            dt = distribute_tensor(param.detach(), self.mesh, [placement], src_data_rank=None)
            new = nn.Parameter(dt, requires_grad=param.requires_grad)
            if getattr(param, "_no_weight_decay", False):
                new._no_weight_decay = True
            self._done[id(param)] = new
        return self._done[id(param)]


def _hook_sharded_io(module: nn.Module, mesh: DeviceMesh, sp: bool, dim: int = SEQ_DIM) -> None:
    """Input / output collectives of a unit whose work is split over the TP ranks (heads or columns).

    With SP: all-gather the `dim` shards in (reduce-scatter in backward), reduce-scatter the partial output.
    Without: f (all-reduce in backward) in, g (all-reduce) out.
    """

    def pre(m, args, kwargs):
        x = gather_shards(args[0], mesh, dim, partial_grad=True) if sp else copy_to_tp(args[0], mesh)
        return (x, *args[1:]), kwargs

    def post(m, args, out):
        return scatter_shards(out, mesh, dim, partial=True) if sp else reduce_from_tp(out, mesh)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post)


def _hook_token_shard_io(module: nn.Module, mesh: DeviceMesh) -> None:
    """A replicated input [B, T, D] -> this rank's sequence shard; the output shards are all-gathered back."""
    module.register_forward_pre_hook(
        lambda m, args: (scatter_shards(args[0], mesh, SEQ_DIM, partial=False), *args[1:])
    )
    module.register_forward_hook(lambda m, args, out: gather_shards(out, mesh, SEQ_DIM, partial_grad=False))


def _mixer_plan(attn: nn.Module, tp: int) -> dict[str, Rule]:
    if isinstance(attn, KDAAttention):
        return _kda_plan(attn, tp)
    if isinstance(attn, GatedMLA):
        return _mla_plan(attn, tp)
    if isinstance(attn, GQAAttention):
        return _gqa_plan(attn, tp)
    raise NotImplementedError(f"tensor parallelism has no plan for the mixer {type(attn).__name__}")


def _apply_ffn(ffn: nn.Module, mesh: DeviceMesh, sp: bool, dist_: _Distributor) -> list[tuple[nn.Module, _Unit]]:
    """(module, unit) pairs whose forward swaps the unit's parameters, inner modules first."""
    tp = mesh.size()
    if isinstance(ffn, GLUMLP):
        unit = dist_.unit(ffn, _glu_plan(ffn, tp))
        _hook_sharded_io(ffn, mesh, sp)
        return [(ffn, unit)]
    if isinstance(ffn, MoE):
        plan = _moe_plan(ffn, tp)
        # The router is its own unit: with bf16 compute FSDP shards it separately (fp32 policy), and FSDP's
        # pre-forward unshard on router.__call__ would put the DTensor back after the MoE unit's swap.
        router_plan = {k.removeprefix("router."): plan.pop(k) for k in list(plan) if k.startswith("router.")}
        router_unit = dist_.unit(ffn.router, router_plan)
        unit = dist_.unit(ffn, plan)  # skips router.weight: already a DTensor
        if not sp:  # with SP the input already is this rank's sequence shard
            _hook_token_shard_io(ffn, mesh)
        if ffn.shared is not None:  # rows of x_TD [N, D]: all tokens of the TP group, sharded columns
            _hook_sharded_io(ffn.shared, mesh, sp=True, dim=0)
        ffn.seq_shard_group = mesh.get_group()  # the model reduces sequence statistics (aux loss) over it
        if ffn.balance_group is None:  # batch-scope balancing over at least the ranks the tokens are split over
            ffn.balance_group = mesh.get_group()  # (parallelize sets the stage's group, a superset, first)
        return [(ffn.router, router_unit), (ffn, unit)]
    raise NotImplementedError(f"tensor parallelism has no plan for the ffn {type(ffn).__name__}")


def _hook_sp_root(model: Transformer, mesh: DeviceMesh) -> None:
    """SP at the model boundary: keep this rank's sequence shard of the embedding output, slice the targets,
    combine the local losses into the exact mean over the whole sequence, gather logits when no targets."""
    counts: list[torch.Tensor | None] = []  # stack: one entry per active forward

    if model.embed is not None:  # every rank embeds the whole sequence and keeps its shard (see apply_tp)
        model.embed.register_forward_hook(lambda m, args, out: scatter_shards(out, mesh, SEQ_DIM, partial=False))

    def pre(m, args, kwargs):
        if len(args) > 1:
            args = (args[0], shard_slice(args[1], mesh, SEQ_DIM), *args[2:]) if args[1] is not None else args
            targets = args[1]
        else:
            targets = kwargs.get("targets")
            if targets is not None:
                kwargs = {**kwargs, "targets": shard_slice(targets, mesh, SEQ_DIM)}
                targets = kwargs["targets"]
        counts.append(None if targets is None else (targets != IGNORE_INDEX).sum())
        return args, kwargs

    def post(m, args, out):
        count = counts.pop()
        if count is None:  # logits (or hidden states of a headless stage): every rank gets the whole sequence
            # the T dim of [B, T, V] logits and [B, T, D] hidden, and of the [n + 1, B, T, D] AttnRes stage state
            return gather_shards(out, mesh, out.dim() - 2, partial_grad=False)
        # out = sum_local / max(count_local, 1): recover the sum, add the sums and the counts of all ranks
        total = reduce_from_tp(out * count.clamp(min=1), mesh)
        n = count.clone()
        dist.all_reduce(n, group=mesh.get_group())
        return total / n.clamp(min=1)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post)


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = True,
             grad_reduce: GradReduce = "eager") -> None:
    """Shard `model` (a Transformer or a pipeline-stage Transformer) over the 1-D `tp_mesh` in place.

    Every rank must call it with the same model: each rank slices its shards out of its own full copy (no
    communication; works on meta). sequence_parallel: keep the residual stream sequence-sharded [B, T/tp, D]
    between units (norms, residual adds and the MoE run on 1/tp of the tokens); needs T % tp == 0. grad_reduce:
    "eager" sums partial gradients over TP in every backward, "deferred" once per optimizer step in
    `finish_tp_grad_reduce` (module docstring, "Cost"). See the module docstring for the per-module plans.
    Parameters that already are DTensors (expert parallelism) are left alone. After it, `model._tp_units` /
    `_tp_mesh` / `_tp_sequence_parallel` describe the sharding (`lm_head_loss_sum` reads them) and every unit's
    module carries its unit as `_tp_unit`.
    """
    assert tp_mesh.ndim == 1, f"apply_tp needs a 1-D TP mesh, got {tp_mesh.ndim}-D"
    assert grad_reduce in ("eager", "deferred"), f"grad_reduce must be 'eager' or 'deferred', got {grad_reduce!r}"
    sp, tp = sequence_parallel, tp_mesh.size()
    dist_ = _Distributor(tp_mesh)
    units: list[_Unit] = []
    seq_rule: Rule = (REP, "sum" if sp else None)  # replicated; with SP it runs on the local sequence shard only

    def add(module: nn.Module, unit: _Unit, run_in: nn.Module | None = None) -> None:
        _wrap_forward(run_in or module, unit)
        module._tp_unit = unit  # found by finish_tp_grad_reduce from any module holding this one (PP stage views)
        units.append(unit)

    if model.embed is not None:
        # With SP the embedding runs on all tokens and the output is sliced: its gradient is then complete on every
        # rank (an all-gather of [B, T, D] activation gradients instead of an all-reduce of the [V, D] weight's).
        add(model.embed, dist_.unit(model.embed, {}, default=(REP, None)))
    for block in model.layers.values():
        # norms and Attention Residual mixes (token-local, replicated): like the norms
        for norm in (block.attn_norm, block.ffn_norm, block.attn_res, block.ffn_res):
            if norm is not None:
                add(norm, dist_.unit(norm, {}, default=seq_rule))
        add(block.attn, dist_.unit(block.attn, _mixer_plan(block.attn, tp)))
        _hook_sharded_io(block.attn, tp_mesh, sp)
        for module, unit in _apply_ffn(block.ffn, tp_mesh, sp, dist_):
            add(module, unit)
    if getattr(model, "out_res", None) is not None:
        add(model.out_res, dist_.unit(model.out_res, {}, default=seq_rule))
    if model.norm is not None:
        add(model.norm, dist_.unit(model.norm, {}, default=seq_rule))
    if model.lm_head is not None:  # the loss reads lm_head.weight directly: swap it for the whole forward
        add(model.lm_head, dist_.unit(model.lm_head, {}, default=seq_rule), run_in=model)
    if sp:
        _hook_sp_root(model, tp_mesh)
    if grad_reduce == "deferred":
        _defer_grad_sums(units, tp_mesh)
    model._tp_units = units
    model._tp_mesh = tp_mesh
    model._tp_sequence_parallel = sp


def _defer_grad_sums(units: list[_Unit], mesh: DeviceMesh) -> None:
    """Defer the TP sum of every parameter with a partial ("sum" / "avg") use, in all of its uses: a weight tied
    to a partial one (embedding and SP LM head) is found by identity, before FSDP replaces the parameters."""
    tracker = _PendingTPGrads(mesh)
    partial = {id(owner._parameters[name]) for unit in units for owner, name, reduce, _ in unit.params if reduce}
    for unit in units:
        unit.params = [(owner, name, reduce, tracker if id(owner._parameters[name]) in partial else None)
                       for owner, name, reduce, _ in unit.params]


def _units_in(model: nn.Module) -> list[_Unit]:
    return [m._tp_unit for m in model.modules() if getattr(m, "_tp_unit", None) is not None]


def _trackers_in(model: nn.Module) -> set[_PendingTPGrads]:
    return {defer for unit in _units_in(model) for *_, defer in unit.params if defer is not None}


def tp_grads_pending(model: nn.Module) -> bool:
    """True while some deferred TP gradient sum of `model` (any module under it) waits for finish_tp_grad_reduce."""
    return any(tracker.pending for tracker in _trackers_in(model))


TP_GRAD_BUCKET_BYTES = 64 << 20  # per all-reduce: large enough to be bandwidth-bound, small enough for one buffer


@torch.no_grad()
def finish_tp_grad_reduce(model: nn.Module, bucket_bytes: int = TP_GRAD_BUCKET_BYTES) -> int:
    """Sum the deferred gradients (apply_tp grad_reduce="deferred") of `model` over their TP group, in place.

    Call once per optimizer step, after the last micro-batch's backward (and after FSDP's gradient reduction, i.e.
    with gradient sync on for that backward) and before clipping / the optimizer / anything that reads `.grad`.
    `model` is any module holding the TP units (a whole model, a pipeline stage, or the trainer's stage view). It
    reduces whatever tensor holds each gradient now: `owner.<name>.grad` of the parameter registered at that
    attribute (FSDP's sharded parameter, whose local tensor is the DP shard: TP peers hold the same shard). Tensors
    are packed per (group, dtype) into flat buckets of at most `bucket_bytes` (a larger tensor goes alone): one
    all_reduce each, every TP rank in the same order (the same model and graph). Returns the all_reduce count
    (0 when nothing is pending). No-op for eager or non-TP models.
    """
    groups: dict[tuple, tuple[dist.ProcessGroup, dict[int, torch.Tensor]]] = {}  # (group, dtype) -> grads by param
    trackers = set()
    for unit in _units_in(model):
        assert not unit._saved, "finish_tp_grad_reduce inside a forward"
        for owner, name, _, defer in unit.params:
            if defer is None or not defer.pending:
                continue
            trackers.add(defer)
            param = owner._parameters[name]
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad  # no_grad: the storage
            group = defer.mesh.get_group()
            groups.setdefault((id(group), grad.dtype), (group, {}))[1].setdefault(id(param), grad)  # a tie once
    calls = 0
    for group, by_param in groups.values():
        bucket, size = [], 0
        for grad in [*by_param.values(), None]:
            nbytes = 0 if grad is None else grad.numel() * grad.element_size()
            if bucket and (grad is None or size + nbytes > bucket_bytes):
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                for g, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    g.copy_(summed)
                calls, bucket, size = calls + 1, [], 0
            if grad is not None:
                bucket.append(grad)
                size += nbytes
    for tracker in trackers:
        tracker.pending = False
    return calls


def guard_tp_grad_reduce(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Make `optimizer.step()` raise while deferred TP gradient sums of `model` are pending (a forgotten
    finish_tp_grad_reduce would otherwise train silently on per-rank partial gradients). No-op without deferral."""
    trackers = _trackers_in(model)  # found once: the model's structure is final after parallelize

    def check(opt, args, kwargs) -> None:
        if any(tracker.pending for tracker in trackers):
            raise RuntimeError("optimizer step with deferred TP gradient sums pending: call "
                               "moestack.parallel.tensor.finish_tp_grad_reduce(model) after the step's last backward")

    if trackers:
        optimizer.register_step_pre_hook(check)


def lm_head_loss_sum(model: Transformer, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy of the whole sequence through model.lm_head (chunked), for callers that run the
    head outside `model.forward` (the last pipeline stage).

    Plain model: chunked_cross_entropy(h, lm_head.weight, targets)[0]. After `apply_tp`: h_BTD is this rank's
    hidden state (its sequence shard [B, T/tp, D] with SP), targets_BT the full [B, T]; the result is the sum
    over the whole sequence, the same on every TP rank, and backward reaches this rank's tokens and head weight.
    """
    weight = model.lm_head.weight
    mesh: DeviceMesh | None = getattr(model, "_tp_mesh", None)
    if mesh is None or not isinstance(weight, DTensor):
        return chunked_cross_entropy(h_BTD, weight, targets_BT)[0]
    (_, _, reduce, defer), = model.lm_head._tp_unit.params  # the head unit's rule, as model.forward would use it
    if not model._tp_sequence_parallel:  # h is replicated: every rank computes the same loss
        return chunked_cross_entropy(h_BTD, _local_view(weight, reduce, defer), targets_BT)[0]
    local_sum, _ = chunked_cross_entropy(h_BTD, _local_view(weight, reduce, defer),
                                         shard_slice(targets_BT, mesh, SEQ_DIM))
    return reduce_from_tp(local_sum, mesh)
