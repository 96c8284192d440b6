"""Cross-entropy over a large vocabulary without materialising all logits at once.

The LM head and the loss run chunk by chunk over tokens; each chunk is checkpointed, so backward recomputes
its logits instead of keeping [tokens, vocab] fp32 logits alive (163840-wide for K3: 640 KB per token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(h_ND: torch.Tensor, w_VD: torch.Tensor, t_N: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h_ND, w_VD)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 softmax (fp64 stays fp64)
    return F.cross_entropy(logits, t_N, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    h_BTD: torch.Tensor, w_VD: torch.Tensor, targets_BT: torch.Tensor, chunk_tokens: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token losses and the number of counted tokens (targets == -100 are ignored).

    h_BTD: final hidden states (after the final norm); w_VD: LM-head weight; targets_BT: int64.
    Returns (loss_sum scalar in at least fp32, count int64 scalar); mean loss = loss_sum / count.
    """
    h_ND = h_BTD.reshape(-1, h_BTD.shape[-1])
    t_N = targets_BT.reshape(-1)
    total = h_ND.new_zeros((), dtype=torch.promote_types(h_ND.dtype, torch.float32))
    for start in range(0, h_ND.shape[0], chunk_tokens):
        h_c, t_c = h_ND[start : start + chunk_tokens], t_N[start : start + chunk_tokens]
        if torch.is_grad_enabled() and (h_c.requires_grad or w_VD.requires_grad):
            total = total + checkpoint(_chunk_loss_sum, h_c, w_VD, t_c, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h_c, w_VD, t_c)
    return total, (t_N != IGNORE_INDEX).sum()
