"""The exact top-k of the rows whose sampled threshold missed (triton_indexer_fused), without a host sync.

The fused indexer keeps the keys above a per-row threshold estimated from sampled scores. A row whose estimate was
too high (fewer than min(visible, top_k) candidates) or too low (more candidates than slots) is recomputed here over
all its visible keys, in fp32, as reference.indexer_topk_from_inputs scores it. Which rows missed is known on the
device only: `torch.nonzero_static` lists at most `capacity` of them into a fixed-size buffer (the rest of it points
at a spare row), so the step never waits for the device to say how many there were. Rows beyond the capacity keep
their threshold selection (a subset of the true top-k, or the first `cap` candidates in key order); their number is
returned on the device (`overflow`) for the caller's statistics. The benchmarks measured 0 missed rows at T = 32768
and 131072 and the tests below 1% of the rows; the capacity is max(64, rows / 32).
"""

from __future__ import annotations

import torch

from moestack.ops.dsa import reference as ref

MIN_ROWS = 64
ROW_FRACTION = 32  # capacity max(MIN_ROWS, B * T / ROW_FRACTION): the fallback costs ~2 / ROW_FRACTION of the scoring


def fallback_capacity(B: int, T: int) -> int:
    return min(B * T, max(MIN_ROWS, B * T // ROW_FRACTION))


@torch.no_grad()
def repair_missed_rows(idx: torch.Tensor, missed: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                       w: torch.Tensor, start_T: torch.Tensor, capacity: int | None = None,
                       block_bytes: int = 1 << 28) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """idx [B,T,K] int32, missed [B,T] bool, q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi], start_T [T] (first key
    each position sees) -> (idx with the missed rows' exact top-k, missed rows, rows beyond the capacity): the
    counts as device int64 scalars. A block of rows holds its [rows, T] fp32 scores and [rows, keys, Hi + Di] fp32
    products of a key chunk (<= block_bytes each)."""
    B, T, K = idx.shape
    Hi, Di = q_idx.shape[2], q_idx.shape[3]
    M = capacity if capacity is not None else fallback_capacity(B, T)
    flat_missed = missed.reshape(B * T)
    rows = torch.nonzero_static(flat_missed, size=M, fill_value=B * T).squeeze(1)  # [M]; B * T = no row
    r = rows.clamp(max=B * T - 1)
    b_M, t_M = r // T, r % T
    keys = torch.arange(T, device=idx.device)
    R = max(1, min(M, block_bytes // (4 * T)))
    S = max(1, block_bytes // (4 * R * (Hi + Di)))
    exact = []
    for i in range(0, M, R):
        b, t = b_M[i : i + R], t_M[i : i + R]
        q = q_idx[b, t].float()  # [R, Hi, Di]
        wr = w[b, t].float()  # [R, Hi]
        scores = torch.empty(len(b), T, device=idx.device, dtype=torch.float32)
        for s0 in range(0, T, S):
            k = k_idx[b, s0 : s0 + S].float()  # [R, S, Di]
            dots = torch.einsum("rhd,rsd->rsh", q, k).relu_()
            scores[:, s0 : s0 + S] = torch.einsum("rsh,rh->rs", dots, wr)
        visible = (keys[None, :] <= t[:, None]) & (keys[None, :] >= start_T[t][:, None])
        exact.append(ref.indexer_topk(scores.masked_fill_(~visible, float("-inf"))[None], K)[0])
    flat = torch.cat([idx.reshape(B * T, K), idx.new_empty(1, K)])  # the spare row takes the buffer's unused slots
    flat.index_put_((rows,), torch.cat(exact).to(idx.dtype))
    n_missed = flat_missed.sum()
    return flat[: B * T].view(B, T, K), n_missed, (n_missed - M).clamp_(min=0)
