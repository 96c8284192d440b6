"""Memory policies on one GPU: peak memory saved and step time added per technique, and what they make fit.

    python3 benchmarks/memory.py --phase techniques --seq-len 4096    # each technique alone vs the baseline
    python3 benchmarks/memory.py --phase long --seq-len 8192          # a length the baseline cannot train
    python3 benchmarks/memory.py --phase largest --seq-len 4096       # the most experts that train, all combined
    python3 benchmarks/memory.py --model tiny --device cpu --seq-len 64 --steps 1   # smoke test of the script

Each run builds the model on the meta device, applies the technique (moestack.memory.apply_memory_policies and
the optimizer from moestack.train.optimizers), materialises it (host-offloaded experts straight into host memory),
and trains `--warmup` + `--steps` steps on random tokens under bf16 autocast (fp32 weights, AdamW lr 1e-4, grad
clip 1.0, router bias update), exactly the trainer's step. Peak = torch.cuda.max_memory_allocated over the timed
steps (optimizer state already allocated); step time = median of the timed steps. After the timed steps
moestack.memory.report.measure_memory gives the breakdown (activations per layer type: the measured factors for
the planner) and the planner's prediction for the same plan. Out-of-memory is caught and reported as such.
Prints markdown tables (rows start with '|'); --json writes every number.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
from torch import nn

from moestack.config.model_spec import load_model_spec
from moestack.config.plan import Plan
from moestack.config.train_spec import OptimizerSpec
from moestack.memory.apply import apply_memory_policies
from moestack.memory.report import GIB, format_report, measure_memory, single_device_plan
from moestack.model.transformer import Transformer
from moestack.train.optim import clip_grad_norm
from moestack.train.optimizers import build_optimizer_from_name

ALL = {"recompute": "full", "offload": ["activations", "experts", "optimizer"], "optimizer": "adamw_bf16",
       "precision": "fp8"}
TECHNIQUES = {  # name -> plan fields (recompute: uniform mode; offload: list of what; optimizer; precision)
    "baseline": {},
    "recompute selective": {"recompute": "selective"},
    "recompute full": {"recompute": "full"},
    "activation offload": {"offload": ["activations"]},
    "expert offload": {"offload": ["experts"]},
    "optimizer offload": {"offload": ["optimizer"]},
    "adamw bf16 states": {"optimizer": "adamw_bf16"},
    "muon": {"optimizer": "muon"},
    "fp8 saved expert inputs": {"precision": "fp8"},
    "all combined": ALL,
}


def make_plan(model: str, seq_len: int, mbs: int, fields: dict, cluster: str) -> Plan:
    kw = {}
    if "recompute" in fields:
        m = fields["recompute"]
        kw["recompute"] = {"kda": m, "attention": m, "moe": m, "mlp": m}
    if "offload" in fields:
        kw["offload"] = {k: True for k in fields["offload"]}
    for key in ("optimizer", "precision"):
        if key in fields:
            kw[key] = fields[key]
    return single_device_plan(model, seq_len, mbs, cluster=cluster, **kw)


def materialise(model: nn.Module, device: torch.device) -> None:
    """Meta parameters / buffers -> uninitialised tensors on `device`; host-resident ones (offloaded experts)
    stay where they are (model.to_empty would move them to the device)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)


def build(spec, plan: Plan, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = Transformer(spec)
    apply_memory_policies(model, plan, device=device)
    materialise(model, device)
    torch.manual_seed(0)
    model.init_weights()
    opt = build_optimizer_from_name(model, plan.optimizer, OptimizerSpec(lr=1e-4), offload=plan.offload.optimizer)
    return model, opt


def autocast_for(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, tokens, targets, autocast) -> float:
    with autocast():
        loss = model(tokens, targets)
    loss.backward()
    clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for moe in model.moe_layers().values():
        moe.router.update_selection_bias()
    return float(loss)


def run(name: str, spec, plan: Plan, device: torch.device, steps: int, warmup: int, report: bool) -> dict:
    """Build, train, measure one configuration; {"oom": True} when it does not fit."""
    out: dict = {"technique": name, "plan": plan.model_dump(exclude={"predicted"}), "experts": spec.moe.num_experts}
    model = opt = None
    try:
        t_build = time.perf_counter()
        model, opt = build(spec, plan, device)
        out["build_s"] = time.perf_counter() - t_build
        g = torch.Generator(device="cpu").manual_seed(1)
        shape = (plan.micro_batch_size, plan.seq_len)
        tokens = torch.randint(0, spec.vocab_size, shape, generator=g).to(device)
        targets = torch.randint(0, spec.vocab_size, shape, generator=g).to(device)
        autocast = autocast_for(device)
        times, losses = [], []
        for i in range(warmup + steps):
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, tokens, targets, autocast))
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out.update(step_s=statistics.median(times), losses=losses, oom=False)
        if device.type == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        pol = model.memory_policies
        if pol.activation_offload is not None:
            out["activation_offload"] = vars(pol.activation_offload.stats).copy()
        if pol.expert_offload is not None:
            out["expert_offload"] = vars(pol.expert_offload.stats).copy()
        if report:
            rep = measure_memory(model, opt, tokens, targets, autocast, plan)
            out["report"] = {"measured_gib": {k: (v / GIB if v is not None else None) for k, v in rep.measured.items()},
                             "activations_by_kind_gib": {k: v / GIB for k, v in rep.activations_by_kind.items()},
                             "host_gib": {k: v / GIB for k, v in rep.host.items()},
                             "predicted_gib": {k: v / GIB for k, v in (rep.predicted or {}).items()},
                             "device_total_gib": rep.device_total / GIB if rep.device_total else None}
            out["report_lines"] = format_report(rep)
            out["act_bytes_per_token_layer"] = _act_factors(spec, rep, plan)
    except torch.OutOfMemoryError as err:
        out.update(oom=True, error=str(err).splitlines()[0][:200])
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _act_factors(spec, rep, plan: Plan) -> dict[str, float]:
    """Measured saved-activation bytes per token per layer of each kind (what the planner's act terms model)."""
    tokens = plan.micro_batch_size * plan.seq_len
    layers: dict[str, int] = {}
    for kind in spec.layer_kinds():
        layers[kind.mixer] = layers.get(kind.mixer, 0) + 1
        layers[kind.ffn] = layers.get(kind.ffn, 0) + 1
    return {k: v / tokens / layers[k] for k, v in rep.activations_by_kind.items() if k in layers}


def table(rows: list[dict]) -> list[str]:
    base = next((r for r in rows if r["technique"] == "baseline" and not r["oom"]), None)
    lines = ["| technique | experts | peak GiB | saved GiB | step s | time added | planner GiB | planner error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["oom"]:
            lines.append(f"| {r['technique']} | {r['experts']} | out of memory | - | - | - | - | - |")
            continue
        peak = r.get("peak_gib")
        saved = f"{base['peak_gib'] - peak:.1f}" if base and peak is not None and "peak_gib" in base else "-"
        added = f"{100 * (r['step_s'] / base['step_s'] - 1):+.0f}%" if base else "-"
        rep = r.get("report", {})
        pred = sum(rep.get("predicted_gib", {}).values()) or None
        total = rep.get("device_total_gib")
        err = f"{100 * (pred / total - 1):+.1f}%" if pred and total else "-"
        peak_s = "-" if peak is None else f"{peak:.1f}"
        pred_s = "-" if pred is None else f"{pred:.1f}"
        lines.append(f"| {r['technique']} | {r['experts']} | {peak_s} | {saved} | {r['step_s']:.2f} | {added} | "
                     f"{pred_s} | {err} |")
    return lines


def host_bytes_needed(spec, fields: dict) -> float:
    """Rough host memory of an all-offloaded run: experts (param + grad + bf16 m, v + bf16 shadow = 14 B), the rest
    (master + bf16 m, v + grad staging = 12 B)."""
    from moestack.planner.profile import profile_model

    prof = profile_model(spec, 2)
    expert = spec.moe.num_experts * 3 * spec.moe.expert_intermediate_size * (spec.moe.latent_size or spec.hidden_size)
    expert *= sum(1 for k in spec.layer_kinds() if k.ffn == "moe")
    dense = prof.total_params - expert
    return expert * 14 + (dense * 12 if "optimizer" in fields.get("offload", []) else 0)


def mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=["techniques", "long", "largest"], default="techniques")
    ap.add_argument("--model", default="proxy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cluster", default=None, help="planner cluster preset (default h200-1gpu on CUDA, else cpu)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated technique names (techniques / long phases)")
    ap.add_argument("--experts", default="128,256,384,512", help="num_experts to try (largest phase)")
    ap.add_argument("--no-report", action="store_true", help="skip the memory report pass")
    ap.add_argument("--kda-backend", default=None, help="sets MOESTACK_KDA_BACKEND (e.g. reference, triton)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.kda_backend:
        os.environ["MOESTACK_KDA_BACKEND"] = args.kda_backend
    device = torch.device(args.device)
    base_spec = load_model_spec(args.model)
    spec = base_spec.model_copy(update={"max_seq_len": max(base_spec.max_seq_len, args.seq_len)})
    cluster = args.cluster or ("h200-1gpu" if device.type == "cuda" else "cpu")
    rows = []
    if args.phase in ("techniques", "long"):
        names = args.only.split(",") if args.only else list(TECHNIQUES)
        for name in names:
            plan = make_plan(args.model, args.seq_len, args.micro_batch, TECHNIQUES[name], cluster)
            rows.append(run(name, spec, plan, device, args.steps, args.warmup, not args.no_report))
            print(table(rows)[-1], flush=True)
    else:
        for E in (int(x) for x in args.experts.split(",")):
            data = spec.model_dump()
            data["moe"]["num_experts"] = E
            variant = type(spec).model_validate(data)
            need, have = host_bytes_needed(variant, ALL), mem_available()
            if need > 0.85 * have:
                print(f"{E} experts: needs ~{need / GIB:.0f} GiB of host memory, {have / GIB:.0f} GiB available: stop")
                rows.append({"technique": "all combined", "experts": E, "oom": True, "error": "host memory"})
                break
            plan = make_plan(args.model, args.seq_len, args.micro_batch, ALL, cluster)
            row = run("all combined", variant, plan, device, args.steps, args.warmup, not args.no_report)
            rows.append(row)
            print(table(rows)[-1], flush=True)
            if row["oom"]:
                break
    print(f"\n{args.model}, seq {args.seq_len} x micro-batch {args.micro_batch}, {device}, phase {args.phase}")
    print("\n".join(table(rows)))
    for r in rows:
        if r.get("report_lines"):
            print(f"\n{r['technique']} ({r['experts']} experts):")
            print("\n".join(r["report_lines"]))
        for key in ("activation_offload", "expert_offload"):
            if key in r:
                print(f"  {key}: {r[key]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
