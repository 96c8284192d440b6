"""The batch-scope quantile solver on synthetic batches with a cluster of near-duplicate tokens (issue #27's proxy:
28% of the built-in corpus' byte tokens are spaces), with and without a selection jitter (Switch Transformer-style
noise, here added to the scores that choose experts only).

    python3 benchmarks/tools/balance_solver_synth.py          # CPU, ~1 min

Each batch: T tokens whose logits are low-rank (rank 16) plus per-expert offsets, of which a fraction `cluster` is
replaced by one shared logit vector plus N(0, noise). The table gives max/mean tokens per expert after
moestack.ops.moe.quantile.batch_bias (4 and 8 coordinate steps from a zero bias) on scores + eps * U[0, 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moestack.ops.moe import quantile  # noqa: E402


def max_mean(s: torch.Tensor, b: torch.Tensor, k: int) -> float:
    c = torch.bincount((s + b).topk(k, -1).indices.flatten(), minlength=s.shape[1]).double()
    return float(c.max() / c.mean())


def main() -> None:
    T, E, K = 4096, 128, 16
    g = torch.Generator().manual_seed(1)
    eps_list = (0.0, 3e-3, 1e-2, 3e-2)
    print(f"# T={T} E={E} top-{K}; cells: max/mean after 4 / 8 coordinate steps")
    print("| cluster | noise | " + " | ".join(f"eps {e:g}" for e in eps_list) + " |")
    print("|---|---|" + "---|" * len(eps_list))
    for cluster, noise in [(0.28, 0.05), (0.28, 0.2), (0.1, 0.05), (0.0, 0.0)]:
        logits = torch.randn(T, 16, generator=g) @ torch.randn(E, 16, generator=g).T * 0.75 \
            + torch.randn(E, generator=g)
        n = int(T * cluster)
        if n:
            idx = torch.randperm(T, generator=g)[:n]
            logits[idx] = torch.randn(E, generator=g) * 2.5 + torch.randn(n, E, generator=g) * noise
        s = torch.sigmoid(logits)
        cells = []
        for eps in eps_list:
            sj = s + eps * torch.rand(T, E, generator=torch.Generator().manual_seed(5))
            four = quantile.batch_bias(sj, torch.zeros(E), K, 1000, 4)
            eight = quantile.batch_bias(sj, torch.zeros(E), K, 1000, 8)
            cells.append(f"{max_mean(sj, four, K):.2f} / {max_mean(sj, eight, K):.2f}")
        print(f"| {cluster} | {noise} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
