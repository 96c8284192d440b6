"""Send order of the flat EP dispatcher: one all_to_all_single ("backend") vs point-to-point largest chunks first vs
rotating rounds (moestack.parallel.comm.SendOrder), dispatch + combine forward and backward, skewed routing.

    python benchmarks/a2a_order.py             # no torchrun: relaunches itself with torchrun, NCCL on all GPUs when
                                               # there are >= 2, else 4 gloo ranks on the CPU
    torchrun --nproc-per-node 8 benchmarks/a2a_order.py

Rows per rank: TOKENS tokens x top-K of E experts with Zipf(SKEW) popularity (some ranks receive several times the
mean), WIDTH-wide rows (the LatentMoE latent), an identity expert. Rank 0 prints markdown rows with the median
time per order (all orders timed side by side in one process, warmed up). What it can show on gloo: whether
point-to-point issuing costs more than the library's all-to-all (gloo's all_to_all is itself pairwise sends);
the hot-spot effect the orders target (many senders into one receiver link at once) needs real links (NCCL over
NVLink / InfiniBand), where "rotate" keeps every round a permutation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from a2a import routed_counts, timed

from moestack.parallel.comm import SEND_ORDERS
from moestack.parallel.expert import FlatDispatcher

TOKENS, WIDTH, EXPERTS, TOP_K, SKEW = 2048, 1024, 64, 8, 1.2


def _relaunch() -> None:
    gpus = torch.cuda.device_count()
    n = gpus if gpus >= 2 else 4
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOESTACK_A2A_CPU": "0" if gpus >= 2 else "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), __file__]
    sys.exit(subprocess.call(cmd, env=env))


def main() -> None:
    use_cuda = torch.cuda.is_available() and os.environ.get("MOESTACK_A2A_CPU") != "1"
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, width = (TOKENS, WIDTH) if use_cuda else (TOKENS // 4, WIDTH // 4)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    counts = routed_counts(tokens, EXPERTS, TOP_K, SKEW, seed=rank, device=device)
    h = torch.randn(int(counts.sum()), width, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(h)
    if rank == 0:
        backend = "nccl" if use_cuda else "gloo (CPU)"
        print(f"| order | ms fwd+bwd (median) | vs backend | {backend}, {world} ranks, {tokens} tok x top-{TOP_K} "
              f"of {EXPERTS}, width {width}, Zipf {SKEW} |")
        print("|---|---|---|---|")
    base = None
    for order in SEND_ORDERS:
        try:
            disp = FlatDispatcher(dist.group.WORLD, order)

            def step(disp=disp):
                y = disp(h, counts, lambda x, offs: x * 1.0)
                y.backward(grad)

            t = timed(step, warmup=3, iters=10, device=device)
            base = base or t
            if rank == 0:
                print(f"| {order} | {t * 1e3:.2f} | {t / base:.2f}x | |", flush=True)
        except Exception as e:  # noqa: BLE001 (one failing order must not hide the others)
            if rank == 0:
                print(f"| {order} | error: {type(e).__name__}: {str(e)[:120]} | | |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        _relaunch()
    main()
