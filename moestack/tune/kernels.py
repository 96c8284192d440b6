"""`moestack tune`, op selection: every available backend of each hot op at the model's shapes, checked against
the reference and timed forward + backward; the fastest correct one is recorded in the tuned-ops cache
(moestack/ops/tuned.py) that the dispatchers read at run time.

Correctness gate: relative RMS error of the output and of the first input's gradient against the reference
backend run on fp32 copies of the same inputs, at most REL_TOL (bf16 kernels land near 1e-2 and below; FP8 is
excluded here: it changes the numerics and is a plan choice, not a kernel choice).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestack.ops import tuned
from moestack.tune.timer import median_seconds

REL_TOL = 3e-2


@dataclass
class OpChoice:
    op: str
    key: str
    backend: str
    ms: dict[str, float]
    rel_err: dict[str, float]


def _median_ms(fn: Callable[[], None], reps: int = 5) -> float:
    return 1e3 * median_seconds(fn, reps=reps, warmup=1)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _choose(op: str, key: str, run: Callable[[str, bool], tuple[torch.Tensor, torch.Tensor]],
            candidates: list[str]) -> OpChoice:
    """run(backend, fp32) -> (output, grad of the first input) after one forward + backward."""
    ref_out, ref_grad = run("reference", True)
    ms, errs = {}, {}
    for name in candidates:
        try:
            out, grad = run(name, False)
            err = max(_rel_rms(out, ref_out), _rel_rms(grad, ref_grad))
            errs[name] = err
            if not math.isfinite(err) or err > REL_TOL:
                continue
            ms[name] = _median_ms(lambda n=name: run(n, False))
        except Exception as exc:  # noqa: BLE001 - a backend that fails at this shape is simply not chosen
            errs[name] = float("nan")
            print(f"  {op} {key}: backend {name} failed: {str(exc).splitlines()[0][:160]}")
    if not ms:
        return OpChoice(op, key, "reference", ms, errs)
    best = min(ms, key=ms.get)
    return OpChoice(op, key, best, ms, errs)


def tune_kda(heads: int, dim: int, tokens: int) -> OpChoice:
    from moestack.ops import kda

    g = torch.Generator(device="cuda").manual_seed(0)
    base = {
        "q": F.normalize(torch.randn(1, tokens, heads, dim, device="cuda", generator=g), dim=-1),
        "k": F.normalize(torch.randn(1, tokens, heads, dim, device="cuda", generator=g), dim=-1),
        "v": torch.randn(1, tokens, heads, dim, device="cuda", generator=g),
        "g": -5 * torch.sigmoid(torch.randn(1, tokens, heads, dim, device="cuda", generator=g)),
        "beta": torch.sigmoid(torch.randn(1, tokens, heads, device="cuda", generator=g)),
    }
    do = torch.randn(1, tokens, heads, dim, device="cuda", generator=g)

    def run(backend: str, fp32: bool):
        args = {n: (t if fp32 or n == "g" else t.bfloat16()).clone().requires_grad_() for n, t in base.items()}
        o, _ = kda.chunk_kda(args["q"], args["k"], args["v"], args["g"], args["beta"], backend=backend)
        o.backward(do.to(o.dtype))
        return o.float(), args["v"].grad.float()

    q_probe = base["q"].bfloat16()
    cands = [n for n in kda.registered_backends() if n != "fla" and _kda_usable(kda, n, q_probe)]
    return _choose("kda", tuned.kda_key(q_probe), run, cands)


def _kda_usable(kda, name: str, q: torch.Tensor) -> bool:
    try:
        return kda.resolve_backend(name, q) == name
    except (RuntimeError, ValueError):
        return False


def tune_sparse_attention(heads: int, d_qk: int, d_v: int, top_k: int, tokens: int) -> OpChoice:
    from moestack.ops import dsa

    g = torch.Generator(device="cuda").manual_seed(0)
    q0 = torch.randn(1, tokens, heads, d_qk, device="cuda", generator=g)
    kv0 = torch.randn(1, tokens, d_qk, device="cuda", generator=g)
    t = torch.arange(tokens, device="cuda")
    # a random causal selection: keys drawn from [0, t], -1 where fewer than top_k are visible
    draw = (torch.rand(tokens, top_k, device="cuda", generator=g) * (t[:, None] + 1)).long()
    slots = torch.arange(top_k, device="cuda")
    idx = torch.where(slots[None] <= t[:, None], draw, -1).to(torch.int32)[None]
    do = torch.randn(1, tokens, heads, d_v, device="cuda", generator=g)
    scale = d_qk ** -0.5

    def run(backend: str, fp32: bool):
        q = (q0 if fp32 else q0.bfloat16()).clone().requires_grad_()
        kv = (kv0 if fp32 else kv0.bfloat16()).clone().requires_grad_()
        o, _ = dsa.sparse_mqa_attention(q, kv, idx, d_v, scale, backend=backend)
        o.backward(do.to(o.dtype))
        return o.float(), q.grad.float()

    probe = q0.bfloat16()
    cands = []
    for name in dsa.backends("sparse_mqa_attention"):
        try:
            if dsa.select_backend("sparse_mqa_attention", probe, name) == name:
                cands.append(name)
        except (RuntimeError, ValueError):
            pass
    return _choose("dsa.sparse_mqa_attention", tuned.dsa_key(probe, idx), run, cands)


def tune_grouped_mm(experts: int, rows_per_expert: int, d: int, f: int) -> OpChoice:
    from moestack.ops import moe

    g = torch.Generator(device="cuda").manual_seed(0)
    # uneven groups around the mean (a real router is never exactly balanced), some experts empty
    counts = torch.poisson(torch.full((experts,), float(rows_per_expert), device="cuda"), generator=g).long()
    counts[:: max(1, experts // 4)] = 0
    offs = counts.cumsum(0).to(torch.int32)
    n = int(offs[-1])
    x0 = torch.randn(n, d, device="cuda", generator=g)
    w0 = torch.randn(experts, d, f, device="cuda", generator=g) / math.sqrt(d)
    dy = torch.randn(n, f, device="cuda", generator=g)

    def run(backend: str, fp32: bool):
        x = (x0 if fp32 else x0.bfloat16()).clone().requires_grad_()
        w = (w0 if fp32 else w0.bfloat16()).clone().requires_grad_()
        y = moe.grouped_mm(x, w, offs, backend=backend)
        y.backward(dy.to(y.dtype))
        return y.float(), x.grad.float()

    cands = [b for b in moe.available_backends() if b not in ("fp8", "crossover")]
    return _choose("moe.grouped_mm", tuned.grouped_mm_key(x0, w0), run, cands)


def tune_ops(spec, tokens: int, tp: int = 1, ep: int = 1) -> list[OpChoice]:
    """Measure and record the backend choice of every hot op this model runs, at this device's shapes."""
    device = torch.device("cuda", torch.cuda.current_device())
    choices = []
    if spec.kda is not None:
        choices.append(tune_kda(max(1, spec.kda.value_heads // tp), spec.kda.head_dim, tokens))
    mla = spec.mla
    if mla is not None and mla.indexer is not None:
        choices.append(tune_sparse_attention(max(1, mla.num_heads // tp), mla.kv_lora_rank + mla.qk_rope_head_dim,
                                             mla.kv_lora_rank, mla.indexer.top_k, tokens))
    if spec.moe is not None:
        moe = spec.moe
        local = max(1, moe.num_experts // ep)
        rows = max(1, tokens * moe.top_k * ep // moe.num_experts)
        width = moe.latent_size or spec.hidden_size
        choices.append(tune_grouped_mm(local, rows, width, 2 * moe.expert_intermediate_size))
    for c in choices:
        tuned.record(c.op, c.key, c.backend, c.ms, c.rel_err, device)
    return choices
