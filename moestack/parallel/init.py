"""Materialise a model built on meta and sharded by `parallelize`, with exactly the values of a full build.

    model = build_model(spec, "meta"); parallelize(model, plan, meshes)     # or per pipeline stage
    materialize(stage_view, whole=model, device=device, seed=seed)           # = the shards of build_model(spec, seed)

`moestack.model.init.init_model` draws every tensor per row block from (seed, name, block); `dtensor_locate` tells
it which global rows / columns this rank's shard of a DTensor holds, for any nesting of Shard / _StridedShard
placements (tensor, expert, expert-tensor and FSDP sharding, in mesh order as DTensor applies them), so each rank
draws only the blocks it needs. Replicated placements hold the whole dim. A pipeline rank materialises its stages
only; `whole` (the complete model tree, other stages still on meta) fixes every tensor's name and the computed
tensors' random stream, so every layout gives the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard

from moestack.model.init import Located, init_model, plain_locate


def global_indices(shape: torch.Size, mesh, placements) -> tuple[torch.Tensor | None, ...]:
    """Per dim of a DTensor of global `shape`: the global indices (int64, in local order) this rank's local tensor
    holds, or None for a whole (unsharded) dim. Mirrors DTensor's left-to-right shard order."""
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the DTensor's mesh"
    sizes = list(shape)
    held: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        d = p.dim
        size, idx = _get_shard_size_and_offsets(sizes[d], mesh.size(mesh_dim), coord[mesh_dim], p, held.get(d),
                                                shape[d], False)
        sizes[d] = size
        held[d] = idx.long() if size > 0 else torch.zeros(0, dtype=torch.long)
    return tuple(held.get(d) for d in range(len(shape)))


def dtensor_locate(t: torch.Tensor) -> Located:
    """init_model's locate for parallelised models: a DTensor's local shard and its global indices."""
    if not isinstance(t, DTensor):
        return plain_locate(t)
    local = t._local_tensor
    if local.is_meta:
        return None
    index = global_indices(t.shape, t.device_mesh, t.placements)
    expect = tuple(local.shape)
    got = tuple(t.shape[d] if i is None else i.numel() for d, i in enumerate(index))
    assert got == expect, f"shard indices {got} do not match the local shape {expect}"
    return local, index


@torch.no_grad()
def materialize(model: nn.Module, whole: nn.Module, device: torch.device | str, seed: int) -> None:
    """Allocate `model` (what this rank runs: a parallelised model or pipeline-stage view, still on meta) on
    `device` and give it the values `build_model(spec, device, seed)` would have, shard by shard.

    whole: the complete Transformer the stages were cut from (the same object as `model` without pipelining).
    """
    model.to_empty(device=device)
    init_model(whole, seed, device, locate=dtensor_locate)
