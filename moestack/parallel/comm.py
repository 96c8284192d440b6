"""Collectives the model path needs, and the global (all-rank) operations of a training step.

- `all_to_all`: a differentiable `all_to_all_single` with uneven splits. Its backward is the reverse exchange;
  it saves only the two split lists (no tensors), so activation recompute cannot leak buffers through it.
- `exchange_counts`: the small integer all-to-all that tells every rank how many rows it will receive.
- `global_grad_norm` / `clip_grad_norm_`: the L2 norm over every gradient of every parameter group, whatever its
  sharding (plain, FSDP-sharded, expert-parallel, several meshes at once), optionally across pipeline stages.
- `all_reduce_sum_` / `all_reduce_mean`: one coalesced all-reduce of several tensors (router load counts) and the
  data-parallel mean of a scalar (the logged loss).

Legend: N rows, D row width, P ranks in the group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

Group = dist.ProcessGroup | None

# Set on the pipeline's second copy of a tied weight (the last stage's LM head, see moestack.parallel.pipeline):
# its gradient equals the first copy's, so the global norm leaves it out (clipping still scales it).
TIED_COPY_ATTR = "_moestack_tied_copy"


# Send orders of an all-to-all (see `send_schedule`): "backend" = one all_to_all_single (the library orders the
# transfers), "largest_first" = point-to-point, biggest chunks posted first, "rotate" = point-to-point in P-1 rounds,
# round s sends to rank (me + s) % P (every round is a permutation: no rank receives from all others at once).
SendOrder = Literal["backend", "largest_first", "rotate"]
SEND_ORDERS = ("backend", "largest_first", "rotate")


class _AllToAll(torch.autograd.Function):
    """y = all_to_all_single(x) with uneven splits along dim 0; dx = the reverse exchange of dy."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group,
                order: SendOrder) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.order = out_splits, in_splits, group, order  # no tensors
        return _all_to_all(x_ND, out_splits, in_splits, group, order)

    @staticmethod
    def backward(ctx, dy_ND: torch.Tensor):
        return _all_to_all(dy_ND, ctx.in_splits, ctx.out_splits, ctx.group, ctx.order), None, None, None, None


def _all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group,
                order: SendOrder = "backend") -> torch.Tensor:
    assert x_ND.shape[0] == sum(in_splits), f"{x_ND.shape[0]} rows but in_splits sum to {sum(in_splits)}"
    x_ND = x_ND.contiguous()
    y_ND = x_ND.new_empty((sum(out_splits), *x_ND.shape[1:]))
    if order == "backend":
        dist.all_to_all_single(y_ND, x_ND, out_splits, in_splits, group=group)
    else:
        _all_to_all_p2p(y_ND, x_ND, out_splits, in_splits, group, order)
    return y_ND


def send_schedule(in_splits: list[int], me: int, order: SendOrder) -> list[list[int]]:
    """The peers this rank sends to, as rounds (each round is waited for before the next starts).

    largest_first: one round, peers by descending chunk size (ties by distance from me, so that not every rank
    starts with rank 0), empty chunks dropped. rotate: P-1 rounds of one peer, (me + s) % P (empty chunks still
    take their round: the receiver of round s expects this rank then)."""
    P = len(in_splits)
    peers = [(me + s) % P for s in range(1, P)]
    if order == "largest_first":
        return [sorted((p for p in peers if in_splits[p]), key=lambda p: -in_splits[p])]
    if order == "rotate":
        return [[p] for p in peers]
    raise ValueError(f"order: unknown send order {order!r}; use one of {SEND_ORDERS}")


def _all_to_all_p2p(y_ND: torch.Tensor, x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: Group, order: SendOrder) -> None:
    """all_to_all_single as point-to-point transfers in the order `send_schedule` gives (chunks along dim 0 of
    contiguous tensors are contiguous views, so nothing is copied besides the local chunk)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    send = x_ND.split(in_splits)
    recv = y_ND.split(out_splits)
    recv[me].copy_(send[me])
    peer = (lambda p: dist.get_global_rank(group, p)) if group is not None else (lambda p: p)
    rounds = send_schedule(in_splits, me, order)
    if order == "largest_first":  # every receive posted up front, then the sends largest first
        reqs = [dist.irecv(recv[p], src=peer(p), group=group) for p in range(P) if p != me and out_splits[p]]
        reqs += [dist.isend(send[p], dst=peer(p), group=group) for p in rounds[0]]
        for r in reqs:
            r.wait()
        return
    for s, (dst,) in enumerate(rounds, start=1):  # rotate: round s sends to me + s, receives from me - s
        src = (me - s) % P
        reqs = []
        if out_splits[src]:
            reqs.append(dist.irecv(recv[src], src=peer(src), group=group))
        if in_splits[dst]:
            reqs.append(dist.isend(send[dst], dst=peer(dst), group=group))
        for r in reqs:
            r.wait()


def all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group = None,
               order: SendOrder = "backend") -> torch.Tensor:
    """Send rows in_splits[p] (consecutive, in rank order) of x_ND [N, ...] to rank p of `group`; receive
    out_splits[p] rows from rank p. Returns [sum(out_splits), ...], rows grouped by source rank. Differentiable.
    order: how the transfers are issued (SendOrder above); the result is the same."""
    if order not in SEND_ORDERS:
        raise ValueError(f"order: unknown send order {order!r}; use one of {SEND_ORDERS}")
    return _AllToAll.apply(x_ND, list(out_splits), list(in_splits), group, order)


def exchange_counts(send_counts_PX: torch.Tensor, group: Group = None) -> torch.Tensor:
    """send_counts_PX [P, X] int64: row p is what this rank will send to rank p (per chunk x). Returns
    recv_counts_PX [P, X]: row p is what rank p will send to this rank. One small all-to-all, no host sync."""
    recv_PX = torch.empty_like(send_counts_PX)
    dist.all_to_all_single(recv_PX, send_counts_PX.contiguous(), group=group)
    return recv_PX


# ---------------------------------------------------------------------------------------------------------------
# global operations of a training step


def _local_norm_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of plain tensors, in fp32 (fp64 stays fp64)."""
    dtype = torch.promote_types(grads[0].dtype, torch.float32)
    return torch.stack([g.detach().to(dtype).pow(2).sum() for g in grads]).sum()


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], pp_group: Group = None) -> torch.Tensor:
    """L2 norm of the gradients of `params` over all ranks: fp32 scalar (fp64 for fp64 gradients), identical on
    every rank.

    DTensor gradients are grouped by (mesh, placements); each group's norm is reduced over its own mesh by DTensor
    (a sharded dim sums squares, a replicated dim does not), so dense (FSDP), expert (EP x FSDP) and TP-sharded
    gradients on different meshes each count exactly once. Plain tensors count as they are (replicated or
    single-process). With pipeline stages, pass `pp_group`: stages hold disjoint parameters, so their squared
    norms add up; the head copy of a tied embedding (marked TIED_COPY_ATTR) is left out.
    """
    grads = [p.grad for p in params if p.grad is not None and not getattr(p, TIED_COPY_ATTR, False)]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32  # fp64 stays fp64
    total_sq = torch.zeros((), dtype=dtype, device=device)
    for key, group in groups.items():
        if key[0] == "plain":
            total_sq = total_sq + _local_norm_sq(group).to(dtype)
        else:
            norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)  # DTensor, reduced over its mesh below
            total_sq = total_sq + norm.full_tensor().to(dtype).pow(2)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, pp_group: Group = None) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) with the global norm of `global_grad_norm`.

    Returns the norm measured before clipping (fp32 scalar, the same on all ranks). max_norm 0 disables clipping;
    a non-finite norm leaves the gradients untouched (the trainer skips that step).
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, pp_group)
    if max_norm > 0:
        value = float(norm)  # one host sync; the same number on every rank
        if math.isfinite(value) and value > max_norm:
            coef = max_norm / (value + 1e-6)
            for p in params:
                p.grad.mul_(coef)
    return norm


def all_reduce_sum_(tensors: list[torch.Tensor], group: Group = None) -> None:
    """Sum each tensor over `group` in place with ONE all-reduce (the tensors are packed into a flat buffer).
    All tensors must share dtype and device."""
    if not tensors or group is None and not dist.is_initialized():
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce_mean(value: float, group: Group = None, device: torch.device | str = "cpu") -> float:
    """Mean of a Python float over the ranks of `group` (identity without a process group)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)  # SUM: gloo has no AVG
    return float(t) / dist.get_world_size(group)
