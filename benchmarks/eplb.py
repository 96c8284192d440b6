"""Hot-expert replication (moestack.parallel.replicate) on skewed routing: max/mean tokens per EP rank before/after.

    torchrun --nproc-per-node 8 benchmarks/eplb.py                       # gloo on CPU: Zipf(1.2), 64 experts, top-8
    torchrun --nproc-per-node 8 benchmarks/eplb.py --experts 256 --slots 1 2 4 --skew 1.0 1.2 1.5

Every rank routes `tokens` tokens to top_k of `experts` experts with Zipf(skew) expert popularity (benchmarks/a2a.py's
routing; the popularity ranks shuffled over the experts with a fixed seed, so hot experts sit on any rank). The
replica plan is made from one measured batch and applied to the NEXT batch (other tokens, same popularity), as in
training where the plan comes from past steps. The EP layer then runs its real forward (split, weight fetch,
dispatcher, local experts) and each rank counts the rows its local experts received: max/mean over the ranks is the
load the busiest rank sets the pace with. Rank 0 prints one markdown table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from moestack.config.model_spec import MoESpec, RouterSpec
from moestack.config.plan import make_plan
from moestack.model.moe import MoE
from moestack.parallel import apply_expert_parallel, build_meshes, make_dispatcher
from moestack.parallel.replicate import apply_replication, set_replica_plan


def zipf_counts(tokens: int, experts: int, top_k: int, skew: float, seed: int, shuffle_seed: int) -> torch.Tensor:
    """Rows per expert [E] for `tokens` tokens choosing top_k distinct experts (Gumbel-top-k on Zipf popularity)."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.randperm(experts, generator=torch.Generator().manual_seed(shuffle_seed))
    popularity = (rank + 1).double().pow(-skew)
    scores = torch.rand(tokens, experts, generator=g, dtype=torch.float64).log() / popularity
    return torch.bincount(scores.topk(top_k, dim=-1).indices.reshape(-1), minlength=experts)


def rows_per_rank(moe: MoE, counts_E: torch.Tensor, width: int) -> float:
    """Run the EP experts on rows laid out by `counts_E`; returns the rows this rank's local experts received."""
    seen = []
    experts = moe.experts
    name = "_physical_local_forward" if getattr(experts, "replica_plan", None) is not None else "local_forward"
    inner = getattr(experts, name)
    setattr(experts, name, lambda x, offs: (seen.append(x.shape[0]), inner(x, offs))[1])
    h = torch.randn(int(counts_E.sum()), width)
    with torch.no_grad():
        experts(h, torch.cumsum(counts_E, 0).to(torch.int32))
    delattr(experts, name)
    return float(sum(seen))


def max_mean(value: float) -> tuple[float, float]:
    t = torch.tensor([value, value], dtype=torch.float64)
    peak, total = t[:1].clone(), t[1:].clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    return float(peak), float(peak / (total / dist.get_world_size()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--width", type=int, default=32, help="row width (small: this measures load, not speed)")
    ap.add_argument("--skew", type=float, nargs="+", default=[1.2])
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4], help="replica slots per rank")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    E = args.experts
    assert E % world == 0, "experts must be divisible by the number of ranks"
    plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=64, global_batch_size=world,
                     dp_shard=world, zero_stage=3, ep=world)
    meshes = build_meshes(plan, "cpu")
    rows = []
    for skew in args.skew:
        # the global batch's load: every rank's tokens (seed per rank), same popularity (shuffle seed)
        measured = sum(zipf_counts(args.tokens, E, args.top_k, skew, 1000 + r, 7) for r in range(world))
        nxt = zipf_counts(args.tokens, E, args.top_k, skew, 2000 + rank, 7)
        nxt_global = nxt.clone()
        dist.all_reduce(nxt_global)
        for slots in [0, *args.slots]:
            torch.manual_seed(0)
            spec = MoESpec(num_experts=E, top_k=args.top_k, expert_intermediate_size=16, router=RouterSpec())
            moe = MoE(args.width, spec, "swiglu")
            moe.init_weights(0.02)
            apply_expert_parallel(torch.nn.ModuleDict({"moe": moe}), meshes.ep, make_dispatcher("flat", meshes.ep))
            copies = 0
            if slots:
                apply_replication(torch.nn.ModuleDict({"moe": moe}), meshes.ep.get_group(), slots)
                rp = set_replica_plan(moe.experts, measured)
                copies = sum(map(len, rp.slot_expert))
            peak, ratio = max_mean(rows_per_rank(moe, nxt, args.width))
            rows.append({"skew": skew, "slots": slots, "replicas": copies, "max_rows": peak, "max_mean": ratio})
    if rank == 0:
        print(f"EP {world} ranks (gloo), {E} experts top-{args.top_k}, {args.tokens} tokens per rank; plan from one "
              "batch, measured on the next")
        print("| Zipf skew | replica slots / rank | replicas placed | max rows / rank | max/mean tokens per rank |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['skew']} | {r['slots']} | {r['replicas']} | {r['max_rows']:.0f} | {r['max_mean']:.3f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
