"""DualPipeV step time with and without the expert all-to-all overlap (plan.ep_comm_overlap), under torchrun.

    torchrun --nproc-per-node 4 benchmarks/overlap_fb.py --model proxy            # PP2 x EP2 on 4 GPUs
    torchrun --nproc-per-node 8 benchmarks/overlap_fb.py --model proxy --ep 4      # PP2 x EP4 on 8 GPUs
    torchrun --nproc-per-node 4 benchmarks/overlap_fb.py --model tiny --steps 3   # gloo on CPU: runs, no speed claim

Both runs use the same plan (pp 2, dualpipev, ep experts folded over the dp = world / 2 data-parallel ranks of each
stage, ZeRO-1, micro-batches `--microbatches` per rank), the trainer's own step (`Trainer.train_step`), the same
seed and data; only `ep_comm_overlap` differs. Rank 0 prints one `|` table: median step seconds over the steps
after `--warmup`, tokens/s, the loss of the last step (identical in both rows: the overlap changes no number), and
the planner's step time for the same plan (which credits the overlap only when it is on).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="proxy")
    ap.add_argument("--cluster", default="h200-cluster", help="cluster preset the planner prices (not the launch)")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: world / 2)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    from moestack.config.base import ConfigError
    from moestack.config.plan import make_plan
    from moestack.config.train_spec import load_train_spec
    from moestack.planner.profile import load_any_model_spec
    from moestack.planner.search import load_problem
    from moestack.train.trainer import Trainer

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    assert world % 2 == 0 and world >= 4, "needs pp 2 x ep >= 2 (4+ ranks)"
    model = load_any_model_spec(args.model)
    seq = min(args.seq_len, model.max_seq_len)
    rows = []
    for overlap in (False, True):
        plan = make_plan(model=args.model, cluster=args.cluster, devices=world, seq_len=seq, micro_batch_size=1,
                         global_batch_size=args.microbatches * world // 2, pp=2, vpp=2, schedule="dualpipev",
                         dp_shard=world // 2, zero_stage=1, ep=args.ep or world // 2, ep_comm_overlap=overlap)
        with tempfile.TemporaryDirectory() as out:
            spec = load_train_spec(None, {"out_dir": out, "steps": args.steps, "logging.progress": False,
                                          "logging.tensorboard": False, "eval_every": 0, "data.eval_fraction": 0.0,
                                          "checkpoint.save_final": False})
            trainer = Trainer(spec, model, log=lambda *a, **k: None, plan=plan)
            times, loss = [], None
            for _ in range(args.steps):
                t0 = time.perf_counter()
                stats = trainer.train_step()
                times.append(time.perf_counter() - t0)
                loss = stats.loss if stats is not None else float("nan")
        step = statistics.median(times[args.warmup:] or times)
        try:
            predicted = load_problem(args.model, args.cluster, world, seq).cost.evaluate(plan).step_time_s
        except ConfigError as err:  # the planner may not price this cluster / size
            predicted = float("nan")
            if rank == 0:
                print(f"planner: {err}")
        rows.append((overlap, step, plan.tokens_per_step / step, loss, predicted))
        dist.barrier()
    if rank == 0:
        dev = torch.cuda.get_device_name() if cuda else "cpu (gloo)"
        print(f"{args.model}, {world} x {dev}, pp2 dualpipev ep{args.ep or world // 2}, seq {seq}, "
              f"{args.microbatches} micro-batches / rank")
        print("| ep_comm_overlap | step s (median) | tokens/s | last loss | planner step s |")
        print("|---|---|---|---|---|")
        for overlap, step, tps, loss, predicted in rows:
            print(f"| {overlap} | {step:.3f} | {tps:,.0f} | {loss:.6f} | {predicted:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
