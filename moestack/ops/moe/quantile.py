"""Quantile balancing (Kimi K3) from a histogram: accumulated on the device per micro-batch, summed over ranks,
solved once per optimizer step. reference.quantile_balancing_bias is the exact (sort-based) spec.

Per token t and expert j the required bias is r_tj = a_t - s_tj, with a_t the (k+1)-th largest s_t + b (the
token's cutoff): expert j gets token t for any bias above r_tj. The balanced bias of j is the k/E quantile of
r_.j over the step's tokens (every token, every micro-batch, every data-parallel rank). Scores lie in (0, 1), so
r lies in (min b - 1, max b + 1): B uniform bins over that range (the report's App. D: 1000) hold the counts,
int32 [E, B] per layer, and the quantile is read with linear interpolation inside its bin. Histograms add
exactly, so micro-batches and ranks reduce with one integer sum, and the result is independent of how the
step's tokens were split. The range comes from the bias itself, which is the same on every rank and fixed
during the step.

Legend: T tokens, E experts, K top-k, B bins.
"""

from __future__ import annotations

import torch


def histogram_range(bias_E: torch.Tensor, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(low edge, bin width) as fp32 device scalars for the current bias: [min b - 1, max b + 1] in B bins."""
    b = bias_E.detach().float()
    lo = b.min() - 1.0
    return lo, (b.max() + 1.0 - lo) / num_bins


@torch.no_grad()
def accumulate_histogram_(hist_EB: torch.Tensor, scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int
                          ) -> torch.Tensor:
    """Add this batch's required-bias counts to hist_EB (int32 [E, B], in place; no host sync). Returns it."""
    E, B = hist_EB.shape
    s_TE = scores_TE.detach().float()
    choice_TE = s_TE + bias_E.detach().float()
    cutoff_T = choice_TE.topk(top_k + 1, dim=-1, sorted=True).values[:, top_k]
    lo, width = histogram_range(bias_E, B)
    bin_TE = ((cutoff_T[:, None] - s_TE - lo) / width).floor_().clamp_(0, B - 1).long()
    flat_TE = bin_TE + torch.arange(E, device=bin_TE.device) * B
    hist_EB.view(-1).scatter_add_(0, flat_TE.view(-1), torch.ones(flat_TE.numel(), dtype=hist_EB.dtype,
                                                                  device=hist_EB.device))
    return hist_EB


@torch.no_grad()
def solve_histogram(hist_EB: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """The next bias [E] (fp32, mean 0) from a step's summed histogram; `bias_E` (the bias the histogram was
    taken under) where the histogram is empty. No host sync."""
    E, B = hist_EB.shape
    h_EB = hist_EB.long()
    cum_EB = h_EB.cumsum(-1)
    n_E = cum_EB[:, -1]
    target_E = n_E.double() * (top_k / E)
    # first bin whose cumulative count reaches the target, and the fraction of it below the target
    bin_E = (cum_EB.double() < target_E[:, None]).sum(-1).clamp_(max=B - 1)
    in_bin_E = h_EB.gather(1, bin_E[:, None]).squeeze(1)
    before_E = cum_EB.gather(1, bin_E[:, None]).squeeze(1) - in_bin_E
    frac_E = ((target_E - before_E.double()) / in_bin_E.clamp_min(1).double()).clamp_(0.0, 1.0)
    lo, width = histogram_range(bias_E, B)
    b_E = (lo.double() + (bin_E.double() + frac_E) * width.double())
    b_E = (b_E - b_E.mean()).float()
    return torch.where(n_E > 0, b_E, bias_E.detach().float())


__all__ = ["accumulate_histogram_", "histogram_range", "solve_histogram"]
