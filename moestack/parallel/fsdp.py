"""ZeRO through FSDP2 (`fully_shard`), with separate meshes for dense and routed-expert parameters.

Groups (one all-gather / reduce-scatter each), innermost first:
    block.ffn.experts        over the expert-data-parallel mesh (edp), when experts are EP-sharded DTensors
    block.ffn.router         own group with fp32 params when the others gather in bf16 (MODEL.md: router in fp32)
    block                    every other parameter of the layer, over the dense dp mesh
    root (the model)         embedding, final norm, LM head (the head is used as a weight, not called as a
                             module, so it must belong to the root group whose pre-forward gathers it)

ZeRO stage -> FSDP2: 3 = reshard after forward (params gathered again for backward); 1 and 2 = keep the gathered
params from forward to backward (FSDP2 always shards gradients and optimizer state, so 1 behaves like 2); 0 = plain
data parallelism, i.e. FSDP2 over a (dp_replicate, dp_shard=1) mesh: parameters replicated, gradients all-reduced.
HSDP = dp_replicate > 1 and dp_shard > 1 on the 2-D mesh.

Gradient scaling: each rank's loss is the mean over its own tokens, so every gradient must be divided by the
number of data-parallel ranks (dp). FSDP2 divides dense gradients by the size of their mesh (= dp). Expert
gradients are reduced over edp only, but each owner already summed the contributions of all ep ranks' tokens
(through the all-to-all backward), so their divide factor is set to dp as well (edp * ep = dp without TP/CP).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moestack.model.moe import MoE


def mixed_precision(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None = torch.float32
                    ) -> MixedPrecisionPolicy:
    """FSDP2 policy: params gathered (and computed) in param_dtype, gradients reduced in reduce_dtype, fp32
    master weights and optimizer state in the sharded parameters. None = keep the parameter dtype (fp32)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    mp_policy: MixedPrecisionPolicy | None = None,
    expert_mesh: DeviceMesh | None = None,
    expert_grad_divide: float | None = None,
    dense_grad_divide: float | None = None,
) -> nn.Module:
    """Shard `model` (a whole Transformer or a pipeline stage of one) with FSDP2, in place; returns it.

    dp_mesh: 2-D (dp_replicate, dp_shard) mesh for dense params. expert_mesh: the edp mesh for EP-sharded expert
    weights (None when experts are not EP-sharded: they then shard with their block). expert_grad_divide: the
    data-parallel degree dp (see the module docstring). dense_grad_divide: the divide factor of every other group
    when dp_mesh holds more than the data-parallel ranks (under CP: dp, not dp * cp). The root group covers what is
    left (embed, norm, head).
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    reshard = zero_stage == 3
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    layers = getattr(model, "layers", None)
    blocks = list(layers.values()) if layers is not None else []
    for block in blocks:
        moe = block.ffn if isinstance(getattr(block, "ffn", None), MoE) else None
        if moe is not None and expert_mesh is not None:
            _shard(moe.experts, expert_mesh, reshard, mp_policy)
            if expert_grad_divide is not None:
                _set_divide_factor(moe.experts, expert_mesh, expert_grad_divide)
        if moe is not None and mp_policy.param_dtype not in (None, torch.float32):
            _shard(moe.router, dp_mesh, reshard, fp32_policy)
        _shard(block, dp_mesh, reshard, mp_policy)
        if dense_grad_divide is not None:
            _set_divide_factor(block, dp_mesh, dense_grad_divide)
            if moe is not None and mp_policy.param_dtype not in (None, torch.float32):
                _set_divide_factor(moe.router, dp_mesh, dense_grad_divide)
    # the root's parameters are used first (embed) and last (head): resharding them after forward buys nothing
    _shard(model, dp_mesh, False, mp_policy)
    if dense_grad_divide is not None:
        _set_divide_factor(model, dp_mesh, dense_grad_divide)
    return model


def _shard(module: nn.Module, mesh: DeviceMesh, reshard: bool, mp_policy: MixedPrecisionPolicy) -> None:
    # fully_shard registers new (sharded) Parameters: carry the modules' tags over (KDA's A_log / dt_bias
    # `_no_weight_decay`, which the optimizer groups read)
    tagged = [name for name, p in module.named_parameters() if getattr(p, "_no_weight_decay", False)]
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    for name in tagged:
        module.get_parameter(name)._no_weight_decay = True
    if mesh.device_type == "cpu" and mesh.size() > 1:
        # gloo has neither AVG nor PREMUL_SUM: reduce with SUM, then divide. (Not on a mesh of one rank: there
        # torch 2.13 would divide by a custom divide factor twice.)
        module.set_force_sum_reduction_for_comms(True)


def _set_divide_factor(module: nn.Module, mesh: DeviceMesh, factor: float) -> None:
    """Divide the reduced gradients of FSDP `module` by `factor`. On a one-rank mesh (experts with edp 1) torch
    2.13 applies a custom factor twice unless the reduce dtype is fp32 / bf16 (its pre/post division and its
    no-collective copy both do), so there the division runs in FSDP's post-reduce hook instead."""
    if mesh.size() == 1:
        module.set_all_reduce_hook(lambda grad, factor=float(factor): grad.div_(factor))
    else:
        module.set_gradient_divide_factor(float(factor))


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (False) or run (True) the gradient reduce-scatter / all-reduce in the next backward: off for all but
    the last micro-batch of an accumulation step. No-op for a model without FSDP."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


def set_reshard_after_backward(model: nn.Module, enabled: bool) -> None:
    """Free (True) or keep (False) the gathered parameters after the next backward. The trainer keeps them between
    the micro-batches of one step under ZeRO 0-2 (which keep them from forward to backward anyway): the next
    micro-batch's forward then neither gathers nor casts them to bf16 again, and the step's last backward frees
    them before the optimizer changes the shards. No-op for a model without FSDP."""
    setter = getattr(model, "set_reshard_after_backward", None)
    if setter is not None:
        setter(enabled)
