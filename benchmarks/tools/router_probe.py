"""Router probe (issue #27): train a model for a few steps, capture every MoE router's input in the last step, and
print per layer what the balancer did with that batch against what the exact coordinate steps would do.

    python3 benchmarks/tools/router_probe.py --model proxy --steps 100            # one H200: ~1 min
    python3 benchmarks/tools/router_probe.py --model tiny --seq-len 64 --steps 5 --device cpu   # a check of the script
    python3 benchmarks/tools/router_probe.py ... --save OUT.pt --save-layer 1     # keep one layer's batch for study

Columns per MoE layer: the run's max/mean tokens per expert (that micro-batch) and idle experts; the library's
batch solver (moestack.ops.moe.quantile.batch_bias, the router's spec) and `--exact-steps` exact sort-based
coordinate steps (moestack.ops.moe.reference.quantile_balancing_bias) on the same fp32 scores; the logits' scale
(|logit| median, p99, max) and the share of scores within 1e-4 of 1. `--save` writes the chosen layer's router input
(bf16), weight, selection bias and top-k, so a solver can be studied on a real batch without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moestack.config.train_spec import TrainSpec  # noqa: E402
from moestack.ops.moe import quantile, reference  # noqa: E402
from moestack.planner.profile import load_any_model_spec  # noqa: E402
from moestack.train.trainer import Trainer  # noqa: E402


def _max_mean(counts: torch.Tensor) -> float:
    c = counts.double()
    return float(c.max() / c.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="proxy")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=None, help="default: the TrainSpec default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--exact-steps", type=int, default=8)
    ap.add_argument("--save", default=None, help="write one layer's batch to this .pt file")
    ap.add_argument("--save-layer", default=None, help="MoE layer name (default: the first)")
    ap.add_argument("--capture-from", type=int, default=None,
                    help="from this step on keep, per layer, the batch the run balanced worst; --save-worst N writes "
                         "the N worst (layer, step) batches to --save-dir")
    ap.add_argument("--save-worst", type=int, default=4)
    ap.add_argument("--save-dir", default=".")
    args = ap.parse_args()

    spec = load_any_model_spec(args.model)
    with tempfile.TemporaryDirectory() as out:
        train = TrainSpec(model=args.model, out_dir=out, steps=args.steps, micro_batch_size=1, seq_len=args.seq_len,
                          device=args.device, eval_every=0, checkpoint={"every": 0, "save_final": False},
                          logging={"tensorboard": False, "progress": False, "every": 10_000},
                          **({"optimizer": {"lr": args.lr}} if args.lr else {}))
        trainer = Trainer(train, spec, log=lambda *a, **k: None)
        moes = trainer.model.moe_layers()
        captured: dict[str, torch.Tensor] = {}
        capture = {"on": False, "step": 0}

        last_in: dict[str, dict] = {}  # with --capture-from: this step's router inputs
        worst: dict[str, dict] = {}

        def hook(name):
            def pre(module, inputs):
                if capture["on"]:
                    captured[name] = inputs[0].detach().clone()
                if args.capture_from is not None and capture["step"] >= args.capture_from:
                    last_in[name] = {"x": inputs[0].detach().to(torch.bfloat16).clone(),
                                     "selection_bias": module.selection_bias.detach().clone(),
                                     "jitter_seed": int(module.jitter_seed), "step": capture["step"] + 1}
            return pre

        for name, moe in moes.items():
            moe.router.register_forward_pre_hook(hook(name))
        t0, losses = time.time(), []
        for step in range(args.steps):
            capture["on"], capture["step"] = step == args.steps - 1, step
            stats = trainer.train_step()
            if stats is not None:
                losses.append(round(stats.loss, 3))
            for name, snap in last_in.items():
                mm = _max_mean(moes[name].last_expert_counts)
                if name not in worst or mm > worst[name]["max_mean"]:
                    worst[name] = {**snap, "max_mean": mm, "weight": moes[name].router.weight.detach().float().clone()}
            last_in.clear()
        print(f"{args.model}: {args.steps} steps in {time.time() - t0:.0f} s, loss {losses[0]} -> {losses[-1]}")
        print("| layer | run max/mean | idle | solver | exact | abs logit p50 / p99 / max | s > 1-1e-4 | bias range |")
        print("|---|---|---|---|---|---|---|---|")
        for name, moe in moes.items():
            x = captured.get(name)
            if x is None:
                continue
            router = moe.router
            K, rs = router.top_k, router.spec
            logits = F.linear(x.float(), router.weight.detach().float())
            s = torch.sigmoid(logits) if rs.score == "sigmoid" else torch.softmax(logits, dim=-1)
            E = s.shape[1]
            solved = quantile.batch_bias(s, router.selection_bias, K, rs.quantile_bins, rs.quantile_iterations)
            exact = torch.zeros(E, device=s.device)
            for _ in range(args.exact_steps):
                exact = reference.quantile_balancing_bias(s, exact, K)

            def load(b):
                return torch.bincount((s + b).topk(K, -1).indices.flatten(), minlength=E)

            counts = moe.last_expert_counts
            a = logits.abs().flatten()
            p99 = float(a.kthvalue(max(1, int(a.numel() * 0.99))).values)
            bias = router.selection_bias
            print(f"| {name} | {_max_mean(counts):.2f} | {int((counts == 0).sum())} | {_max_mean(load(solved)):.2f} | "
                  f"{_max_mean(load(exact)):.2f} | {float(a.median()):.1f} / {p99:.1f} / {float(a.max()):.1f} | "
                  f"{float((s > 1 - 1e-4).float().mean()):.3f} | {float(bias.min()):.3f}..{float(bias.max()):.3f} |")
        if args.save:
            name = args.save_layer or next(iter(captured))
            router = moes[name].router
            torch.save({"x": captured[name].to(torch.bfloat16).cpu(), "weight": router.weight.detach().float().cpu(),
                        "selection_bias": router.selection_bias.cpu(), "top_k": router.top_k, "layer": name,
                        "model": args.model, "steps": args.steps}, args.save)
            print(f"saved layer {name} to {args.save}")
        if worst:
            print("| layer | worst run max/mean | at step |")
            print("|---|---|---|")
            for name, w in worst.items():
                print(f"| {name} | {w['max_mean']:.2f} | {w['step']} |")
            for name, w in sorted(worst.items(), key=lambda kv: -kv[1]["max_mean"])[:args.save_worst]:
                router = moes[name].router
                path = Path(args.save_dir) / f"batch_{name}_step{w['step']}.pt"
                torch.save({**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in w.items()},
                            "top_k": router.top_k, "spec": router.spec.model_dump(), "layer": name,
                            "model": args.model}, path)
                print(f"saved {path}")


if __name__ == "__main__":
    main()
