"""Planner output: the ranked table, why the other plans lost, one plan's breakdowns, JSON, and PNG plots.

Plain text (no terminal colours) so the same strings go to the console, the JSON and the tests.
"""

from __future__ import annotations

from pathlib import Path

from moestack.config.cluster import GIB
from moestack.planner.cost.step import PlanCost
from moestack.planner.search import SearchResult

TIME_ORDER = ("gemm", "attention", "kda", "elementwise", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_bubble",
              "pp_p2p", "dp_comm", "optimizer", "offload")
MEMORY_ORDER = ("weights", "fp8_weights", "gradients", "optimizer", "activations", "buffers", "reserved")


def plan_label(c: PlanCost) -> str:
    p = c.plan
    sched = p.schedule if p.vpp == 1 else f"{p.schedule}/v{p.vpp}"
    return (f"{p.short()} mbs{p.micro_batch_size} {sched} rc:{p.recompute.short()} off:{p.offload.short()}"
            f" {p.dispatcher}")


def ranked_table(result: SearchResult, top: int) -> str:
    """The top plans: step time, tokens/s, TFLOP/s per device, MFU, peak memory and the binding constraint."""
    rows = [("#", "plan", "step s", "tok/s", "TFLOP/s", "MFU", "mem GiB", "binding")]
    for i, c in enumerate(result.ranked[:top], 1):
        rows.append((str(i), plan_label(c), f"{c.step_time_s:.2f}", f"{c.tokens_per_s:,.0f}",
                     f"{c.tflops_per_device:.0f}", f"{c.mfu:.1%}", f"{c.memory_total / GIB:.1f}", c.binding))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if j in (1, 7) else cell.rjust(w) for j, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def why_others_lost(result: SearchResult, top: int) -> list[str]:
    """One line per runner-up (its largest extra time component vs the best) and the rejection counts."""
    out = []
    best = result.best
    if best is not None:
        best_tpt = best.step_time_s / best.plan.tokens_per_step
        for i, c in enumerate(result.ranked[1:top], 2):
            tpt = c.step_time_s / c.plan.tokens_per_step
            scale = best.plan.tokens_per_step / c.plan.tokens_per_step  # compare per token
            diffs = {k: c.time.get(k, 0.0) * scale - best.time.get(k, 0.0) for k in set(c.time) | set(best.time)}
            key = max(diffs, key=diffs.get)
            out.append(f"#{i} is {tpt / best_tpt - 1:+.1%} per token: most of it {key} "
                       f"(+{diffs[key]:.2f} s/step)")
    if result.rejected:
        parts = ", ".join(f"{n} {r}" for r, n in result.rejected.most_common())
        out.append(f"rejected: {parts}")
    out.append(f"{result.evaluated} plans evaluated in {result.elapsed_s:.1f} s")
    return out


def breakdown(c: PlanCost) -> list[str]:
    """Memory and time of one plan, component by component."""
    lines = [f"plan: {plan_label(c)}",
             f"step {c.step_time_s:.3f} s | {c.tokens_per_s:,.0f} tokens/s | {c.tflops_per_device:.1f} TFLOP/s per "
             f"device | MFU {c.mfu:.1%} | binding: {c.binding}"]
    mem = " + ".join(f"{k} {c.memory[k] / GIB:.1f}" for k in MEMORY_ORDER if c.memory.get(k, 0) > 0)
    lines.append(f"memory per device (GiB): {mem} = {c.memory_total / GIB:.1f} of {c.hbm_bytes / GIB:.1f} "
                 f"({c.memory_fraction:.0%})")
    if c.host_bytes > 0:
        lines.append(f"host memory per device: {c.host_bytes / GIB:.1f} of {c.host_capacity / GIB:.1f} GiB")
    parts = " | ".join(f"{k} {c.time[k]:.2f}" for k in TIME_ORDER if c.time.get(k, 0) > 0)
    lines.append(f"time per step (s, critical rank, exposed): {parts}")
    layers = [len(ch) for ch in c.layout.chunks]
    lines.append(f"layers per pipeline chunk: {layers}")
    lines += [f"note: {n}" for n in c.notes]
    return lines


def cost_json(c: PlanCost) -> dict:
    return {
        "plan": c.plan.model_dump(mode="json", exclude={"predicted"}),
        "step_time_s": c.step_time_s,
        "tokens_per_s": c.tokens_per_s,
        "tflops_per_device": c.tflops_per_device,
        "mfu": c.mfu,
        "memory_gib": {k: v / GIB for k, v in c.memory.items()},
        "memory_total_gib": c.memory_total / GIB,
        "hbm_gib": c.hbm_bytes / GIB,
        "host_gib": c.host_bytes / GIB,
        "time_s": dict(c.time),
        "binding": c.binding,
        "layers_per_chunk": [len(ch) for ch in c.layout.chunks],
    }


def result_json(result: SearchResult, top: int) -> dict:
    pb = result.problem
    return {
        "model": pb.model,
        "cluster": pb.cluster.name,
        "devices": pb.cluster.num_devices,
        "seq_len": pb.seq_len,
        "calibration": pb.cal.source,
        "plans": [cost_json(c) for c in result.ranked[:top]],
        "closest_unfit": cost_json(result.closest) if (result.closest and not result.ranked) else None,
        "rejected": dict(result.rejected),
        "evaluated": result.evaluated,
        "elapsed_s": result.elapsed_s,
    }


def plot_memory(costs: list[PlanCost], path: str | Path) -> Path:
    """Stacked bars of per-device memory by component, one bar per plan, with the HBM line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(costs) + 3), 4.5))
    bottoms = [0.0] * len(costs)
    for key in MEMORY_ORDER:
        vals = [c.memory.get(key, 0.0) / GIB for c in costs]
        ax.bar(range(len(costs)), vals, bottom=bottoms, label=key)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    if costs:
        ax.axhline(costs[0].hbm_bytes / GIB, color="k", linestyle="--", linewidth=1, label="HBM")
    ax.set_xticks(range(len(costs)), [f"#{i + 1}" for i in range(len(costs))])
    ax.set_ylabel("GiB per device")
    ax.set_title("memory per device by component")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def simulate_pipeline(c: PlanCost, m: int) -> list[tuple[int, float, float, str, int]]:
    """(rank, start, end, "F"|"B", micro-batch) boxes of a list-scheduled pipeline: F(i, k) after F(i, k-1),
    B(i, k) after F(i, k) and B(i, k+1); each rank prefers a ready backward (1F1B), and runs forwards in
    micro-batch order while it holds fewer than the schedule's in-flight limit (gpipe: no limit)."""
    from moestack.planner.cost.pipeline import inflight_microbatches

    p, v = c.plan.pp, c.plan.vpp
    ranks = c.layout.chunk_rank
    n = len(ranks)
    per_rank = [ranks.count(r) for r in range(p)]
    f_t = [c.rank_fwd_bwd[ranks[k]][0] / per_rank[ranks[k]] for k in range(n)]
    b_t = [c.rank_fwd_bwd[ranks[k]][1] / per_rank[ranks[k]] for k in range(n)]
    limit = m * v if c.plan.schedule == "gpipe" else max(1, round(inflight_microbatches(c.plan.schedule, p, v, m) * v))
    f_done: dict[tuple[int, int], float] = {}
    b_done: dict[tuple[int, int], float] = {}
    clock = [0.0] * p
    held = [0] * p
    boxes = []
    total = 2 * m * n
    while len(f_done) + len(b_done) < total:
        best = None
        for r in range(p):
            for k in (kk for kk in range(n) if ranks[kk] == r):
                for i in range(m):  # first backward of chunk k not yet done
                    if (i, k) not in b_done:
                        break
                else:
                    i = None
                if i is not None and (i, k) in f_done and (k == n - 1 or (i, k + 1) in b_done):
                    ready = max(f_done[(i, k)], b_done.get((i, k + 1), 0.0))
                    cand = (max(clock[r], ready), 0, r, "B", i, k)
                    best = cand if best is None or cand < best else best
                for i in range(m):  # next forward of chunk k
                    if (i, k) not in f_done:
                        break
                else:
                    i = None
                if i is not None and held[r] < limit and (k == 0 or (i, k - 1) in f_done):
                    ready = f_done.get((i, k - 1), 0.0)
                    cand = (max(clock[r], ready), 1, r, "F", i, k)
                    best = cand if best is None or cand < best else best
        assert best is not None, "pipeline simulation deadlocked"
        start, _, r, kind, i, k = best
        end = start + (f_t[k] if kind == "F" else b_t[k])
        if kind == "F":
            f_done[(i, k)] = end
            held[r] += 1
        else:
            b_done[(i, k)] = end
            held[r] -= 1
        clock[r] = end
        boxes.append((r, start, end, kind, i))
    return boxes


def plot_timeline(c: PlanCost, path: str | Path, max_microbatches: int = 16) -> Path:
    """Pipeline timeline PNG: one row per rank, forward (blue) / backward (orange) boxes per micro-batch chunk,
    from simulate_pipeline with the cost model's per-rank forward and backward times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, v = c.plan.pp, c.plan.vpp
    m = min(c.plan.num_microbatches, max_microbatches)
    boxes = simulate_pipeline(c, m)
    span = max(end for _, _, end, _, _ in boxes)
    fig, ax = plt.subplots(figsize=(12, 0.45 * p + 1.5))
    for r, start, end, kind, mb in boxes:
        color = "#4c78a8" if kind == "F" else "#f58518"
        ax.broken_barh([(start, end - start)], (r - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
        if end - start > 0.015 * span:
            ax.text((start + end) / 2, r, str(mb), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"{c.plan.schedule} (v={v}), first {m} micro-batches: forward blue, backward orange")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
