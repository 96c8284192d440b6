"""Router balance terms beyond the sequence-wise loss (moe.sequence_aux_loss): Qwen3's global-batch balance loss
and the router z-loss (ST-MoE). Both are differentiable losses the MoE layer attaches to its output
(moestack.model.aux_loss); the quantile / sign updates of the selection bias are not losses (Router).

Sharding conventions (shared with sequence_aux_loss): `seq_group` is the set of ranks one micro-batch's sequences
are split over (tensor / sequence / context parallelism). Each rank returns its share of the loss of the whole
micro-batch (the token mean divides by T * |seq_group|), so the shares add up and backward through a share gives
exactly its tokens' gradient. `group` (global loss) is every rank of the pipeline stage holding other tokens (data
parallel and sequence shards): the load fraction is counted over all of them.

Legend: T tokens on this rank, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tokens_in_batch(T: int, seq_group: dist.ProcessGroup | None) -> int:
    return T * (dist.get_world_size(seq_group) if seq_group is not None else 1)


def global_load_counts(counts_E: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This micro-batch's routed slots per expert summed over `group` (int64 [E], a copy; one all-reduce)."""
    total_E = counts_E.detach().to(torch.int64).clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total_E, group=group)
    return total_E


def global_balance_loss(scores_TE: torch.Tensor, load_E: torch.Tensor, coef: float,
                        seq_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """coef * E * sum_i f_i P_i (Qwen3, "Demons in the Detail", arXiv:2501.11873).

    load_E [E]: routed slots per expert over the global batch (no gradient); f_i = load_i / sum(load), so
    sum_i f_i = 1. P_i = mean over this micro-batch's tokens of s_ti / sum_j s_tj (differentiable, fp32+).
    Balanced routing with uniform scores gives coef. Returns this rank's share (module docstring).
    """
    T, E = scores_TE.shape
    s_TE = scores_TE.to(torch.promote_types(scores_TE.dtype, torch.float32))
    load = load_E.detach().to(s_TE.dtype)
    f_E = load / load.sum().clamp_min(1.0)
    P_E = (s_TE / s_TE.sum(-1, keepdim=True)).sum(0) / _tokens_in_batch(T, seq_group)
    return coef * E * (f_E * P_E).sum()


def router_z_loss(logits_TE: torch.Tensor, coef: float, seq_group: dist.ProcessGroup | None = None
                  ) -> torch.Tensor:
    """coef * mean_t logsumexp_j(logits_tj)^2 (ST-MoE, arXiv:2202.08906, eq. 5), in fp32+: keeps router logits
    small. Returns this rank's share (module docstring)."""
    T = logits_TE.shape[0]
    z_T = torch.logsumexp(logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)), dim=-1)
    return coef * z_T.square().sum() / _tokens_in_batch(T, seq_group)


__all__ = ["global_balance_loss", "global_load_counts", "router_z_loss"]
