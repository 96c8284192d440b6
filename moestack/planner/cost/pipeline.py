"""2. Terms, pipeline: in-flight micro-batches and step time per schedule (bubbles), and the split of the layers
into pipeline stages / virtual chunks (StageLayout)."""

from __future__ import annotations

from dataclasses import dataclass

from moestack.config.plan import V_SHAPE


def inflight_microbatches(schedule: str, p: int, v: int, m: int) -> float:
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of one micro-batch's
    activations for the whole rank (all its chunks).

    gpipe: all m (Huang et al. 2019). 1f1b: p (Narayanan et al. 2021). interleaved: Megatron warms up
    2(p-1) + (v-1)p chunk-micro-batches then holds one more: (vp + p - 1)/v rank-micro-batches. zbv: same peak as
    1F1B (Qi et al., ZB-V). dualpipev: p + 1 (DeepSeek-V3 report, Table 2).
    """
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p, m))
    if schedule == "interleaved_1f1b":
        return min(m * v, v * p + p - 1) / v
    if schedule == "zbv":
        return float(min(p, m))
    if schedule == "dualpipev":
        return float(min(p + 1, m))
    raise ValueError(schedule)


def pipeline_time(schedule: str, p: int, v: int, m: int, t_fwd: float, t_bwd: float, t_wgrad: float) -> float:
    """Time for m micro-batches through p ranks, given the slowest rank's forward, backward (incl. recompute) and
    the weight-gradient share of the backward, all per micro-batch for the whole rank.

    1f1b / gpipe: (m + p - 1)(F + B) (bubble (p-1)/m; Narayanan et al. 2021). interleaved: (m + (p-1)/v)(F + B).
    zbv (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-V): m(F + B) + (p-1)(F_c + B_c - 2 W_c) with chunk
    times half the rank's and B_c the input-gradient part. dualpipev (DeepSeek-V3 report Table 2, DualPipe bubble
    (PP/2-1)(F&B + B - 3W) with PP/2 -> p for the V variant): m(F + B) + (p-1)(F&B_c + B_c - 3 W_c).
    """
    t = t_fwd + t_bwd
    if p == 1:
        return m * t
    if schedule in ("1f1b", "gpipe"):
        return (m + p - 1) * t
    if schedule == "interleaved_1f1b":
        return (m + (p - 1) / v) * t
    fc, bc, wc = t_fwd / 2, (t_bwd - t_wgrad) / 2, t_wgrad / 2
    if schedule == "zbv":
        return m * t + (p - 1) * max(0.0, fc + bc - 2 * wc)
    if schedule == "dualpipev":
        return m * t + (p - 1) * max(0.0, (fc + bc + wc) + bc - 3 * wc)
    raise ValueError(schedule)


@dataclass
class StageLayout:
    """Which layers each pipeline chunk holds; chunk c lives on rank chunk_rank[c]."""

    chunks: list[list[int]]  # layer positions (0-based into ModelWork.layers) per chunk
    chunk_rank: list[int]


def chunk_ranks(p: int, v: int, schedule: str) -> list[int]:
    """Rank of each of the p*v chunks: interleaved round-robin (Megatron), V-shape for zbv / dualpipev."""
    if schedule in V_SHAPE:
        return list(range(p)) + list(reversed(range(p)))
    return [c % p for c in range(p * v)]


def balanced_chunks(costs: list[float], n: int, first_extra: float, last_extra: float) -> list[list[int]]:
    """Split layers (in order) into n contiguous non-empty chunks minimising the largest chunk cost; the first chunk
    also carries the embedding and the last the LM head (Llama 3 and Megatron-Bridge's DeepSeek-V3 layouts put
    fewer layers on those stages for the same reason). Binary search on the cap with a greedy fill."""
    L = len(costs)
    assert 1 <= n <= L
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    lo = max(max(costs), (prefix[-1] + first_extra + last_extra) / n)
    hi = prefix[-1] + first_extra + last_extra
    best = _greedy(prefix, n, hi * (1 + 1e-9), first_extra, last_extra)
    for _ in range(30):
        cap = (lo + hi) / 2
        bounds = _greedy(prefix, n, cap, first_extra, last_extra)
        if bounds is not None:
            best, hi = bounds, cap
        else:
            lo = cap
        if hi - lo <= 1e-4 * hi:
            break
    assert best is not None
    return [list(range(a, b)) for a, b in zip(best, best[1:])]


def uniform_chunks(layers: int, n: int, account: bool) -> list[list[int]]:
    """Megatron's default pipeline split (Plan.pipeline_split): the same number of layers in each of the n chunks
    (earlier chunks take the remainder), the embedding and the LM head extra on the first / last. `account`
    (Megatron's account_for_embedding / loss_in_pipeline_split): the embedding and the loss count as one layer each,
    so the first and the last chunk hold one layer less."""
    slots = layers + (2 if account else 0)
    sizes = [slots // n + (1 if c < slots % n else 0) for c in range(n)]
    if account:
        sizes[0] -= 1
        sizes[-1] -= 1
    if min(sizes) < 1:
        raise ValueError(f"pipeline: {n} chunks leave a chunk without layers ({layers} layers)")
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def _greedy(prefix: list[float], n: int, cap: float, first_extra: float, last_extra: float) -> list[int] | None:
    """Chunk boundaries filling each chunk up to `cap` (leaving at least one layer per remaining chunk)."""
    import bisect

    L = len(prefix) - 1
    bounds = [0]
    start = 0
    for c in range(n):
        room = cap - (first_extra if c == 0 else 0.0)
        end = bisect.bisect_right(prefix, prefix[start] + room) - 1
        end = min(end, L - (n - c - 1))
        if c == n - 1:
            end = L
        if end <= start:
            return None
        load = prefix[end] - prefix[start] + (first_extra if c == 0 else 0.0) + (last_extra if end == L else 0.0)
        if load > cap * (1 + 1e-9):
            if end == L and c < n - 1:
                end -= 1  # keep the head's extra off a chunk that cannot take it; the next chunk ends at L
                if end <= start:
                    return None
            else:
                return None
        bounds.append(end)
        start = end
    return bounds if start == L else None
