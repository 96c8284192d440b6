"""Expert-parallel dispatch + combine vs raw `all_to_all_single` moving the same rows, on every rank of a torchrun job.

    torchrun --nproc-per-node 4 benchmarks/a2a.py                                  # gloo on CPU (small shapes)
    torchrun --nproc-per-node 8 benchmarks/a2a.py --tokens 8192 --width 3584 --experts 256 --top-k 8
    torchrun --nproc-per-node 8 benchmarks/a2a.py --dispatcher hierarchical --domain 4 --skew 1.2

Per rank: `tokens` tokens, each routed to `top_k` of `experts` experts (uniform, or Zipf(skew) expert popularity,
so some ranks receive much more than others), rows of `width` elements (the LatentMoE latent). The dispatcher
(moestack.parallel.expert) runs its full path: count exchange, one host sync, the row all-to-all(s), the regroup
gathers, an identity "expert", the reverse path; forward only, and forward+backward (the backward is two more
exchanges). The baseline is `dist.all_to_all_single` with the same split sizes, there and back, on preallocated
buffers: the floor any dispatcher built on it can reach. Bandwidth = rows moved off-rank x width x bytes, both
directions, per second and per rank (rows a rank keeps for itself are not counted). Rank 0 prints one markdown
table; --json writes the numbers. NCCL on CUDA, gloo on CPU, chosen by device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from moestack.parallel.expert import FlatDispatcher, HierarchicalDispatcher


def routed_counts(tokens: int, experts: int, top_k: int, skew: float, seed: int, device) -> torch.Tensor:
    """Rows per expert [E] int64 for `tokens` tokens choosing top_k distinct experts each."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, experts + 1, dtype=torch.float64).pow(-skew) if skew > 0 else torch.ones(experts)
    scores = torch.rand(tokens, experts, generator=g, dtype=torch.float64).log() / popularity  # Gumbel-top-k
    idx = scores.topk(top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(idx, minlength=experts).to(device)


def timed(fn, warmup: int, iters: int, device) -> float:
    """Median seconds per call, with a barrier before each call so ranks start together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--width", type=int, default=512, help="row width (LatentMoE latent)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of expert popularity (0 = uniform)")
    ap.add_argument("--dispatcher", choices=["flat", "hierarchical"], default="flat")
    ap.add_argument("--domain", type=int, default=None, help="ranks per fast domain (hierarchical); default "
                                                              "LOCAL_WORLD_SIZE")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the numbers here (rank 0)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.experts % world == 0, "experts must be divisible by the number of ranks"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]

    if args.dispatcher == "flat":
        dispatcher = FlatDispatcher(dist.group.WORLD)
        domain = world
    else:
        domain = args.domain or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        assert world % domain == 0, "--domain must divide the number of ranks"
        ranks = torch.arange(world).view(world // domain, domain)
        intra = cross = None
        for d in range(world // domain):  # every rank creates every group, in the same order
            g = dist.new_group(ranks[d].tolist())
            intra = g if rank // domain == d else intra
        for l in range(domain):
            g = dist.new_group(ranks[:, l].tolist())
            cross = g if rank % domain == l else cross
        dispatcher = HierarchicalDispatcher(intra, cross)

    counts_E = routed_counts(args.tokens, args.experts, args.top_k, args.skew, seed=rank, device=device)
    N = int(counts_E.sum())
    h = torch.randn(N, args.width, device=device, dtype=dtype)
    send_P = counts_E.view(world, -1).sum(1)
    recv_P = torch.empty_like(send_P)
    dist.all_to_all_single(recv_P, send_P)
    in_splits, out_splits = send_P.tolist(), recv_P.tolist()
    recv_buf = h.new_empty(sum(out_splits), args.width)
    back_buf = h.new_empty(N, args.width)

    def raw():
        dist.all_to_all_single(recv_buf, h, out_splits, in_splits)
        dist.all_to_all_single(back_buf, recv_buf, in_splits, out_splits)

    def identity(x, offs):
        return x

    def ours():
        with torch.no_grad():
            dispatcher(h, counts_E, identity)

    hg = h.detach().requires_grad_(True)

    def ours_fwd_bwd():
        y = dispatcher(hg, counts_E, identity)
        y.backward(torch.ones_like(y))

    t_raw = timed(raw, args.warmup, args.iters, device)
    t_ours = timed(ours, args.warmup, args.iters, device)
    t_fb = timed(ours_fwd_bwd, args.warmup, args.iters, device)
    with torch.no_grad():
        assert torch.equal(dispatcher(h, counts_E, identity), h), "dispatch+combine must return the rows unchanged"

    off_rank = N - in_splits[rank]  # rows that leave this rank (each also comes back)
    moved = torch.tensor([2.0 * off_rank * args.width * h.element_size()], dtype=torch.float64, device=device)
    dist.all_reduce(moved, op=dist.ReduceOp.MAX)  # the busiest rank sets the pace
    bw = lambda t: float(moved) / t / 1e9  # noqa: E731
    row = {"backend": dist.get_backend(), "ranks": world, "dispatcher": args.dispatcher, "domain": domain,
           "tokens": args.tokens, "width": args.width, "experts": args.experts, "top_k": args.top_k,
           "skew": args.skew, "dtype": str(dtype).removeprefix("torch."), "raw_ms": t_raw * 1e3,
           "ours_ms": t_ours * 1e3, "ours_fwd_bwd_ms": t_fb * 1e3, "raw_GB_s": bw(t_raw), "ours_GB_s": bw(t_ours),
           "ours_over_raw": t_ours / t_raw}
    if rank == 0:
        print("| backend | ranks | dispatcher | tokens/rank | width | E | k | skew | raw a2a there+back | "
              "dispatch+combine | fwd+bwd | raw GB/s | ours GB/s | ours / raw time |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        kind = args.dispatcher if args.dispatcher == "flat" else f"{args.dispatcher} ({domain}/domain)"
        print(f"| {row['backend']} | {world} | {kind}"
              f" | {args.tokens} | {args.width} | {args.experts} | {args.top_k} | {args.skew} | {t_raw * 1e3:.2f} ms"
              f" | {t_ours * 1e3:.2f} ms | {t_fb * 1e3:.2f} ms | {row['raw_GB_s']:.2f} | {row['ours_GB_s']:.2f} | "
              f"{row['ours_over_raw']:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
