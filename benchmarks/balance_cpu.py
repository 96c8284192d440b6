"""Expert balance on CPU in minutes: a many-expert MoE stack trained at the default lr, the routing before issue #27
(the sign bias update) against the presets' defaults (quantile balancing, batch scope), per-layer max/mean at the end.

The model: byte embedding -> L x [x += W_mix * causal_mean(x); x += MoE(norm(x))] -> norm -> head, with the
library's MoE layer (moestack.model.moe, the tiny preset's MoE and router, E experts top-K, one shared expert) and
the trainer's optimizer / schedule (AdamW, TrainSpec defaults: lr 3e-3, cosine) on bytes of the built-in corpus.
The causal mean stands in for attention: without it the first MoE layer sees only the token embedding, and equal
tokens (spaces: ~15% of the bytes) tie in every router, which no bias can split. The bias moves once per step from
the step's counts, as in Trainer._update_router_biases.

    python benchmarks/balance_cpu.py [--steps 200] [--experts 64] [--top-k 8] [--layers 2] [--batch 16] [--seq 32]
        [--from-step N] [--only NAME,...]

Prints a `|` table: per setting, the worst layer's max/mean tokens per expert and idle experts at the last step and
over the window (--from-step to the end; default the second half), and the mean loss of the last 10 steps.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch
from torch import nn

from moestack.config.model_spec import MoESpec, load_model_spec
from moestack.config.train_spec import load_train_spec
from moestack.model.moe import MoE, set_jitter_seeds
from moestack.model.norm import RMSNorm
from moestack.train.data import builtin_corpus_files
from moestack.train.optim import build_optimizer, build_scheduler

# the routing of before issue #27: DeepSeek-V3's sign update at 1e-3 and the sequence-wise loss
SIGN = {"bias_update": "sign", "bias_update_rate": 1e-3}
SETTINGS = {"sign (before #27)": SIGN, "quantile, step scope": {"bias_update": "quantile", "quantile_scope": "step"},
            "quantile, step scope, jitter 0.01": {"bias_update": "quantile", "quantile_scope": "step",
                                                  "selection_jitter": 0.01},
            "quantile, batch scope, no jitter": {"selection_jitter": 0.0},
            "quantile, batch scope, jitter 0.01": {"selection_jitter": 0.01},
            "quantile, batch scope, jitter 0.03": {"selection_jitter": 0.03},
            "preset default": {},
            # the proxy preset's whole router (batch scope, 8 coordinate steps, momentum 0.7, jitter 0.05)
            "proxy preset routing": {k: v for k, v in load_model_spec("proxy").moe.router.model_dump().items()
                                     if k.startswith(("bias_update", "quantile_", "selection_"))}}


class MoEStack(nn.Module):
    def __init__(self, spec: MoESpec, hidden: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(256, hidden)
        self.mix = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
        self.norms = nn.ModuleList(RMSNorm(hidden) for _ in range(layers))
        self.moes = nn.ModuleList(MoE(hidden, spec, "situ_glu", 1.0, 25.0, 1e-5) for _ in range(layers))
        self.out, self.head = RMSNorm(hidden), nn.Linear(hidden, 256, bias=False)

    def forward(self, x_BT: torch.Tensor) -> torch.Tensor:
        h = self.emb(x_BT)
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        for mix, norm, moe in zip(self.mix, self.norms, self.moes, strict=True):
            h = h + mix(h.cumsum(1) / steps)
            h = h + moe(norm(h))
        return self.head(self.out(h))


def moe_spec(router: dict, experts: int, top_k: int) -> MoESpec:
    """The tiny preset's MoE at E experts top-K (small widths), with the training presets' balancing (the proxy's
    quantile scope: tiny, the test model, uses step scope) updated by `router`."""
    m = load_model_spec("tiny").moe.model_dump()
    m.update(num_experts=experts, top_k=top_k, expert_intermediate_size=32, latent_size=None, num_shared_experts=1,
             shared_intermediate_size=64)
    m["router"]["quantile_scope"] = load_model_spec("proxy").moe.router.quantile_scope
    m["router"].update(router)
    return MoESpec.model_validate(m)


def corpus_bytes(n: int = 1 << 20) -> np.ndarray:
    data = b"".join(p.read_bytes() for p in builtin_corpus_files(n))[:n]
    return np.frombuffer(data, dtype=np.uint8)


def train(router: dict, steps: int, experts: int = 64, top_k: int = 8, layers: int = 2, batch: int = 16,
          seq: int = 32, hidden: int = 64, seed: int = 0) -> list[tuple[float, list[float], list[int]]]:
    """Per step: (loss, max/mean tokens per expert per layer, idle experts per layer)."""
    torch.manual_seed(seed)
    net = MoEStack(moe_spec(router, experts, top_k), hidden, layers)
    for moe in net.moes:
        moe.init_weights(0.02)
    data = corpus_bytes()
    spec = load_train_spec(None, {"schedule.warmup_steps": 5})
    opt = build_optimizer(net, spec.optimizer)
    sched = build_scheduler(opt, spec.schedule, steps, spec.optimizer.lr)
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        set_jitter_seeds({f"moes.{i}": moe.router for i, moe in enumerate(net.moes)}, step)
        starts = rng.integers(0, len(data) - seq - 1, batch)
        w = torch.from_numpy(np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64))
        loss = nn.functional.cross_entropy(net(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        counts = [moe.router.update_selection_bias().double() for moe in net.moes]
        out.append((float(loss.detach()), [float(c.max() / c.mean()) for c in counts],
                    [int((c == 0).sum()) for c in counts]))
    return out


def summary(rows: list[tuple[float, list[float], list[int]]], from_step: int | None = None) -> dict[str, float]:
    """half_*: the worst over steps from_step..end (1-based), by default the second half."""
    window = rows[len(rows) // 2:] if from_step is None else rows[from_step - 1:]
    return {"last_max_mean": max(rows[-1][1]), "last_idle": max(rows[-1][2]),
            "half_max_mean": max(max(r[1]) for r in window), "half_idle": max(max(r[2]) for r in window),
            "loss": sum(r[0] for r in rows[-10:]) / len(rows[-10:]),
            "layers_last": rows[-1][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--from-step", type=int, default=None, help="window start (1-based), default: the second half")
    ap.add_argument("--only", default="", help="comma-separated substrings: run the settings whose name has one")
    a = ap.parse_args()
    preset = moe_spec({}, a.experts, a.top_k).router
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{a.experts} experts top-{a.top_k}, {a.layers} MoE layers, {a.batch}x{a.seq} tokens/step, {a.steps} steps; "
          f"preset router: bias_update {preset.bias_update}, quantile_scope {preset.quantile_scope}")
    first = a.from_step or a.steps // 2 + 1
    print(f"| routing | max/mean per layer, last step | worst max/mean, steps {first}-{a.steps} | "
          "idle experts, worst layer, last / window | loss, last 10 steps | s |")
    print("|---|---|---|---|---|---|")
    for name, router in SETTINGS.items():
        if a.only and not any(part in name for part in a.only.split(",")):
            continue
        t0 = time.perf_counter()
        s = summary(train(router, a.steps, a.experts, a.top_k, a.layers, a.batch, a.seq), a.from_step)
        layers = " / ".join(f"{v:.2f}" for v in s["layers_last"])
        print(f"| {name} | {layers} | {s['half_max_mean']:.2f} | {s['last_idle']} / {s['half_idle']} | "
              f"{s['loss']:.3f} | {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
