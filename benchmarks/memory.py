"""Memory policies on one GPU: peak memory saved and step time added per technique, and what they make fit.

    python3 benchmarks/memory.py --phase techniques --seq-len 4096    # each technique alone vs the baseline
    python3 benchmarks/memory.py --phase long --seq-len 16384         # a length the baseline cannot train
    python3 benchmarks/memory.py --phase largest --seq-len 4096       # the most experts / longest seq that train,
                                                                      # all combined
    python3 benchmarks/memory.py --model tiny --device cpu --seq-len 64 --steps 1   # smoke test of the script
    bash scripts/gpu_memory.sh                                        # long + largest on two GPUs, < 7 min

Each row builds the model on the meta device, applies the technique (moestack.memory.apply_memory_policies and
the optimizer from moestack.train.optimizers), materialises it (host-offloaded experts straight into host memory),
and trains `--warmup` + `--steps` steps on random tokens under bf16 autocast (fp32 weights, AdamW lr 1e-4, grad
clip 1.0, router bias update), exactly the trainer's step. Peak = torch.cuda.max_memory_allocated over the timed
steps (optimizer state already allocated); step time = median of the timed steps. After the timed steps
moestack.memory.report.measure_memory gives the breakdown (activations per layer type: the measured factors for
the planner) next to the planner's breakdown for the same plan.

Rows run one per subprocess (default; --no-isolate runs them in this process): an out-of-memory, a CUDA error or
a crash ends only its own row, and a row's allocator state cannot leak into the next one. `--deadline-s` bounds
the whole phase: each row gets what is left, rows that cannot start in time are listed as skipped. Rows are
printed as they finish (markdown, lines starting with '|'), the whole table again at the end.

Columns: peak GiB (allocator peak), saved GiB and time added vs the reference row (the baseline when it trains,
else `--reference`, e.g. "recompute full" in the long phase), planner GiB (the cost model's peak for the same plan,
moestack/planner/cost/, minus its "reserved" term: the allocator does not count the CUDA context / slack), its
error, and `fit x` = measured / planner: the factor the planner's memory total needs for this row (the per-category
report under the table says which term). --json writes every number.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from moestack.config.kernel_spec import KernelSpec, merge
from moestack.config.model_spec import load_model_spec
from moestack.config.plan import Plan
from moestack.config.train_spec import OptimizerSpec
from moestack.memory.apply import apply_memory_policies
from moestack.train.optimizers import build_host_aware_optimizer
from moestack.memory.phase_peaks import PhasePeaks
from moestack.memory.report import (
    GIB,
    cost_model,
    format_report,
    measure_memory,
    planner_cost,
    single_device_plan,
)
from moestack.model.kernels import apply_kernels
from moestack.model.transformer import Transformer
from moestack.train.optim import clip_grad_norm

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
    apply_kernels(model, merge(KERNELS, plan.kernels), device)  # --kda-backend over the plan's choices
    apply_memory_policies(model, plan, device=device)
    materialise(model, device)
    torch.manual_seed(0)
    model.init_weights()
    # the optimizer Plan.optimizer names; host-resident parameters step with the fused CPU kernels
    # (moestack.memory.host_adamw: torch's single-tensor / randint-rounding CPU paths took minutes per step)
    opt = build_host_aware_optimizer(model, plan.optimizer, OptimizerSpec(lr=1e-4), offload=plan.offload.optimizer)
    return model, opt


def autocast_for(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, tokens, targets, autocast, split: list | None = None,
               peaks: PhasePeaks | None = None) -> float:
    """One trainer step; with `split`, appends (forward + backward s, clip + optimizer s) (synchronises between);
    with `peaks`, marks the phases (PhasePeaks)."""
    t0 = time.perf_counter()
    if peaks is not None:
        peaks.mark("forward")
        peaks.in_forward = True
    with autocast():
        loss = model(tokens, targets)
    if peaks is not None:
        peaks.in_forward = False
        peaks.mark("loss + head backward")
    loss.backward()
    if split is not None:
        _sync(loss.device)
        t1 = time.perf_counter()
    if peaks is not None:
        peaks.mark("clip + optimizer")
    clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for moe in model.moe_layers().values():
        moe.router.update_selection_bias()
    out = float(loss.detach())
    if split is not None:
        split.append((t1 - t0, time.perf_counter() - t1))
    return out


def host_gib() -> dict:
    """This process's peak resident host memory (pinned buffers included) and the host's available memory."""
    import resource

    return {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "host_available_gib": mem_available() / GIB}


def run(name: str, spec, plan: Plan, device: torch.device, steps: int, warmup: int, report: bool,
        cal=None, snapshot: str | None = None, phase_peaks: bool = False) -> dict:
    """Build, train, measure one configuration in this process; {"oom": True} when it does not fit. With
    `snapshot` (a folder; CUDA only) the allocator's history is recorded and the live blocks at the timed steps'
    peak are written there (`peak_snapshot`). With `phase_peaks` (CUDA) one more step reports the peak per phase
    (PhasePeaks)."""
    out: dict = {"technique": name, "plan": plan.model_dump(exclude={"predicted"}), "experts": spec.moe.num_experts,
                 "seq": plan.seq_len, "status": "ok"}
    model = opt = None
    recording = snapshot is not None and device.type == "cuda" and torch.cuda.is_available()
    if snapshot is not None and not recording:
        print(f"[{name}] --snapshot needs a CUDA device: not recorded", flush=True)
    if recording:  # from before the build: every block alive at the peak has its allocation in the trace
        # python frames only ("all" also walks C++ stacks; with it the loss chunk's recompute under checkpoint
        # failed on the H200: SystemError from cross_entropy_loss); $MOESTACK_SNAPSHOT_STACKS overrides
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES,
                                                 stacks=os.environ.get("MOESTACK_SNAPSHOT_STACKS", "python"))
    trace_start = 0
    try:
        t_build = time.perf_counter()
        model, opt = build(spec, plan, device)
        out["build_s"] = time.perf_counter() - t_build
        g = torch.Generator(device="cpu").manual_seed(1)
        shape = (plan.micro_batch_size, plan.seq_len)
        tokens = torch.randint(0, spec.vocab_size, shape, generator=g).to(device)
        targets = torch.randint(0, spec.vocab_size, shape, generator=g).to(device)
        autocast = autocast_for(device)
        offloader = model.memory_policies.activation_offload
        times, losses, split = [], [], []
        out["build_host"] = host_gib()
        print(f"[{name}] built in {out['build_s']:.1f} s; host {out['build_host']}", flush=True)
        for i in range(warmup + steps):
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                if recording:  # the peak is searched from here on (the timed steps)
                    trace_start = len(_device_trace(torch.cuda.memory._snapshot(), device))
                if offloader is not None:  # time the copies of the timed steps (the transfer to hide)
                    offloader.timing = True
            _sync(device)
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, tokens, targets, autocast, split))
            _sync(device)
            times.append(time.perf_counter() - t0)
            print(f"[{name}] step {i} ({'warm-up' if i < warmup else 'timed'}): {times[-1]:.2f} s (fwd+bwd "
                  f"{split[-1][0]:.2f}, clip+opt {split[-1][1]:.2f}), loss {losses[-1]:.4f}", flush=True)
        timed = times[warmup:] or times
        out.update(step_s=statistics.median(timed), losses=losses, oom=False, all_step_s=times,
                   fwd_bwd_s=[a for a, _ in split], clip_opt_s=[b for _, b in split])
        out.update(host_gib())
        if device.type == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
            if phase_peaks:  # one more step, after the timed steps' peak is read
                pp = PhasePeaks(model, device)
                train_step(model, opt, tokens, targets, autocast, peaks=pp)
                out["phase_peaks"] = pp.close()
                top = sorted(out["phase_peaks"], key=lambda m: -m["peak_gib"])[:6]
                print(f"[{name}] phase peaks (GiB, largest first): "
                      + "; ".join(f"{m['phase']} {m['peak_gib']:.2f} (end {m['end_gib']:.2f})" for m in top), flush=True)
        if recording:
            try:
                peak = peak_blocks(torch.cuda.memory._snapshot(), device, trace_start)
                peak["max_memory_allocated_gib"] = out["peak_gib"]
                os.makedirs(snapshot, exist_ok=True)
                path = os.path.join(snapshot, f"memsnap-{name.replace(' ', '_')}-{spec.moe.num_experts}e-"
                                              f"{plan.seq_len}.json")
                with open(path, "w") as f:
                    json.dump(peak, f, indent=1)
                out["peak_snapshot"] = path
                print(f"[{name}] peak snapshot: {path} (replayed peak {peak['peak_gib']:.2f} GiB)", flush=True)
            except Exception as err:  # a measurement aid: never lose the row to it
                out["peak_snapshot_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
                recording = False
        pol = model.memory_policies
        if pol.activation_offload is not None:
            if pol.activation_offload.timing:
                try:
                    d2h_s, h2d_s = pol.activation_offload.copy_times()
                    out["offload_copy_s"] = (d2h_s + h2d_s) / steps  # per timed step
                except RuntimeError as err:  # timing is a measurement aid: never lose the row to it
                    out["offload_copy_error"] = str(err)[:200]
                pol.activation_offload.timing = False
            out["activation_offload"] = vars(pol.activation_offload.stats).copy()
        if pol.expert_offload is not None:
            out["expert_offload"] = vars(pol.expert_offload.stats).copy()
        if report:
            try:
                rep = measure_memory(model, opt, tokens, targets, autocast, plan, cal=cal)
            except torch.OutOfMemoryError:  # the steps fitted: the row stands, only the breakdown is missing
                out["report_lines"] = ["memory report: out of memory in its extra forward + backward"]
                return out
            out["report"] = {"measured_gib": {k: (v / GIB if v is not None else None) for k, v in rep.measured.items()},
                             "activations_by_kind_gib": {k: v / GIB for k, v in rep.activations_by_kind.items()},
                             "host_gib": {k: v / GIB for k, v in rep.host.items()},
                             "predicted_gib": {k: v / GIB for k, v in (rep.predicted or {}).items()},
                             "device_total_gib": rep.device_total / GIB if rep.device_total else None}
            out["report_lines"] = format_report(rep)
            out["act_bytes_per_token_layer"] = _act_factors(spec, rep, plan)
    except torch.OutOfMemoryError as err:
        out.update(oom=True, status="oom", error=str(err).splitlines()[0][:200])
    finally:
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


KERNELS = KernelSpec()  # --kda-backend / --no-autotune (main)
SNAPSHOT_MAX_ENTRIES = 5_000_000  # allocator trace ring buffer (alloc / free events) of a --snapshot row
SNAPSHOT_BLOCKS = 30  # largest live blocks written
SNAPSHOT_FRAMES = 8  # stack frames per block (innermost first, torch / Python internals left out)


def _device_trace(snap: dict, device: torch.device) -> list[dict]:
    traces = snap.get("device_traces", [])
    index = device.index if device.index is not None else torch.cuda.current_device()
    return traces[index] if index < len(traces) else []


def _frames(entry: dict, n: int = SNAPSHOT_FRAMES) -> list[str]:
    """The innermost `n` frames of an allocation that are not torch's own (the code that asked for it)."""
    out = []
    for fr in entry.get("frames", []):
        name = fr.get("filename", "")
        if "/torch/" in name or name.startswith("??") or not name:
            continue
        out.append(f"{os.path.basename(name)}:{fr.get('line')}:{fr.get('name')}")
        if len(out) >= n:
            break
    return out


def peak_blocks(snap: dict, device: torch.device, start: int = 0, top: int = SNAPSHOT_BLOCKS) -> dict:
    """The allocator's live blocks at the peak of allocated bytes over trace entries `start`.. of a
    torch.cuda.memory._snapshot() recorded with _record_memory_history (replays alloc / free_completed, the events
    that move torch.cuda.memory_allocated); the largest `top` with their allocation frames, and totals per frame."""
    trace = _device_trace(snap, device)
    live: dict[int, dict] = {}
    total = peak = 0
    peak_at, peak_live = -1, {}
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif action == "free_completed":
            hit = live.pop(e["addr"], None)
            total -= hit["size"] if hit is not None else e["size"]
        else:
            continue
        if i >= start and total > peak:
            peak, peak_at, peak_live = total, i, dict(live)
    blocks = sorted(peak_live.values(), key=lambda e: -e["size"])
    by_site: dict[str, int] = {}
    for e in blocks:
        site = (_frames(e, 1) or ["?"])[0]
        by_site[site] = by_site.get(site, 0) + e["size"]
    return {"peak_gib": peak / GIB, "trace_index": peak_at, "trace_entries": len(trace), "start": start,
            "live_blocks": len(blocks), "note": "sizes in bytes; frames innermost first, torch internals left out; "
            "blocks allocated before recording started are missing (recording starts before the build)",
            "blocks": [{"bytes": e["size"], "gib": round(e["size"] / GIB, 4), "stream": e.get("stream"),
                        "frames": _frames(e)} for e in blocks[:top]],
            "by_site_gib": {k: round(v / GIB, 4) for k, v in sorted(by_site.items(), key=lambda kv: -kv[1])[:top]}}


def _act_factors(spec, rep, plan: Plan) -> dict[str, float]:
    """Measured saved-activation bytes per token per layer of each kind (what the planner's act terms model)."""
    tokens = plan.micro_batch_size * plan.seq_len
    layers: dict[str, int] = {}
    for kind in spec.layer_kinds():
        layers[kind.mixer] = layers.get(kind.mixer, 0) + 1
        layers[kind.ffn] = layers.get(kind.ffn, 0) + 1
    return {k: v / tokens / layers[k] for k, v in rep.activations_by_kind.items() if k in layers}


# ------------------------------------------------------------------------------------------------------------
# rows: what to run, in this process or in a child


def variant_spec(base, seq: int, experts: int | None):
    """The model spec of one row: max_seq_len raised to `seq`, num_experts replaced when given."""
    data = base.model_dump()
    data["max_seq_len"] = max(base.max_seq_len, seq)
    if experts is not None:
        data["moe"]["num_experts"] = experts
    return type(base).model_validate(data)


def phase_rows(args) -> list[dict]:
    """[{name, fields, seq, experts}] in run order."""
    if args.phase in ("techniques", "long"):
        names = [n.strip() for n in args.only.split(",")] if args.only else list(TECHNIQUES)
        bad = [n for n in names if n not in TECHNIQUES]
        if bad:
            raise SystemExit(f"error: --only: unknown technique(s) {bad}; known: {', '.join(TECHNIQUES)}")
        return [{"name": n, "fields": TECHNIQUES[n], "seq": args.seq_len, "experts": None} for n in names]
    by_experts = [{"name": "all combined", "fields": ALL, "seq": args.seq_len, "experts": int(e), "axis": "experts"}
                  for e in args.experts.split(",") if e]
    by_seq = [{"name": "all combined", "fields": ALL, "seq": int(s), "experts": None, "axis": "seq"}
              for s in (args.seq_lens or "").split(",") if s]
    # alternate the two axes, so that a deadline cuts both short rather than one entirely
    return [r for pair in itertools.zip_longest(by_experts, by_seq) for r in pair if r is not None]


def predict(spec, plan: Plan, cal) -> dict:
    """The planner's peak for `plan`: allocated (total minus "reserved"), the breakdown and the activations at the
    end of forward (what the memory report measures), in GiB."""
    cost = planner_cost(spec, plan, cal)
    # this benchmark applies plan.precision fp8 through apply_memory_policies only: FP8 storage of the expert inputs
    # with bf16 GEMMs, as its rows were measured; the trainer's FP8 recipe (moestack/ops/fp8/convert.py) adds the fp8
    # weight copies the planner prices as "fp8_weights", which these runs do not hold
    mem = {k: v for k, v in cost.memory.items() if k != "fp8_weights"}
    return {"alloc_gib": (sum(mem.values()) - mem.get("reserved", 0.0)) / GIB,
            "breakdown_gib": {k: v / GIB for k, v in mem.items()},
            "forward_activations_gib": cost.forward_activations / GIB}


# technique row -> the Calibration.act_factors key its measured activations calibrate
ACT_FACTOR_KEY = {"recompute selective": "selective", "recompute full": "full",
                  "activation offload": "activation_offload", "fp8 saved expert inputs": "fp8"}


def act_ratio(r: dict) -> float | None:
    """Measured activations at the end of forward (memory report, CUDA) / the planner's."""
    measured = r.get("report", {}).get("measured_gib", {}).get("activations")
    predicted = r.get("predicted", {}).get("forward_activations_gib")
    if measured is None or not predicted or r.get("report", {}).get("device_total_gib") is None:
        return None
    return measured / predicted


def suggested_act_factors(rows: list[dict], cal) -> dict[str, float]:
    """Calibration.act_factors that would make each technique's activation term match its measurement."""
    out = {}
    for r in rows:
        key, ratio = ACT_FACTOR_KEY.get(r.get("technique")), act_ratio(r)
        if key is not None and ratio is not None:
            out[key] = round(cal.act_factors.get(key, 1.0) * ratio, 4)
    return out


def run_row(row: dict, args, base, cal) -> dict:
    spec = variant_spec(base, row["seq"], row["experts"])
    plan = make_plan(args.model, row["seq"], args.micro_batch, row["fields"], args.cluster)
    return run(row["name"], spec, plan, torch.device(args.device), args.steps, args.warmup, not args.no_report, cal,
               snapshot=getattr(args, "snapshot", None), phase_peaks=getattr(args, "phase_peaks", False))


def _child_argv(args, row: dict, out_path: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--device", args.device,
            "--cluster", args.cluster, "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--child-row", json.dumps(row), "--child-out", out_path]
    if args.no_report:
        argv.append("--no-report")
    if getattr(args, "kda_backend", None):
        argv += ["--kda-backend", args.kda_backend]
    if getattr(args, "no_autotune", False):
        argv.append("--no-autotune")
    if args.calibration:
        argv += ["--calibration", args.calibration]
    if getattr(args, "snapshot", None):
        argv += ["--snapshot", args.snapshot]
    if getattr(args, "phase_peaks", False):
        argv.append("--phase-peaks")
    return argv


def run_isolated(row: dict, args, timeout_s: float) -> dict:
    """One row in a child process; a crash, CUDA error or timeout becomes the row's status."""
    blank = {"technique": row["name"], "experts": row["experts"], "seq": row["seq"], "oom": False}
    fd, path = tempfile.mkstemp(prefix="memory_row_", suffix=".json")
    os.close(fd)
    try:
        try:
            proc = subprocess.run(_child_argv(args, row, path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=max(1.0, timeout_s), check=False)
        except subprocess.TimeoutExpired as err:
            tail = (err.stdout or b"")
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return dict(blank, status="timeout", error=f"timed out after {timeout_s:.0f} s",
                        log_tail=tail[-2000:])
        with open(path) as f:
            text = f.read()
        if proc.returncode == 0 and text:
            out = json.loads(text)
            out["log_tail"] = proc.stdout[-2000:]
            return out
        lines = [x for x in proc.stdout.strip().splitlines() if x.strip()]
        oom = any("OutOfMemoryError" in x or "out of memory" in x.lower() or "ALLOC_FAILED" in x for x in lines)
        last = next((x for x in reversed(lines) if "Error" in x or "error" in x), lines[-1] if lines else "")
        return dict(blank, oom=oom, status="oom" if oom else "failed",
                    error=f"exit {proc.returncode}: {last.strip()[:200]}", log_tail=proc.stdout[-2000:])
    finally:
        os.unlink(path)


# ------------------------------------------------------------------------------------------------------------
# tables


HEADER = [("| technique | experts | seq | peak GiB | saved GiB | step s | time added | planner GiB | planner error "
           "| fit x |"), "|---|---|---|---|---|---|---|---|---|---|"]


def reference_row(rows: list[dict], reference: str | None) -> dict | None:
    """The baseline if it trained, else the first trained row named `reference` ("first": the first trained
    row), else None."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("step_s") is not None]
    if reference == "first":
        return ok[0] if ok else None
    for name in ("baseline", reference):
        hit = next((r for r in ok if r["technique"] == name), None)
        if hit is not None:
            return hit
    return None


def row_line(r: dict, ref: dict | None, hbm_gib: float | None) -> str:
    pred = r.get("predicted", {}).get("alloc_gib")
    pred_s = "-" if pred is None else f"{pred:.1f}" if pred >= 1 else f"{pred:.3f}"
    head = f"| {r['technique']} | {r['experts']} | {r['seq']} |"
    status = r.get("status", "ok")
    if status != "ok":
        what = {"oom": "out of memory" + (f" ({hbm_gib:.0f} GiB)" if hbm_gib else ""),
                "timeout": "timed out", "skipped": "skipped (" + r.get("error", "") + ")"}.get(
            status, "failed: " + r.get("error", "")[:80].replace("|", "/"))
        return f"{head} {what} | - | - | - | {pred_s} | - | - |"
    peak = r.get("peak_gib")
    saved = (f"{ref['peak_gib'] - peak:+.1f}".replace("+", "")
             if ref is not None and ref is not r and peak is not None and ref.get("peak_gib") is not None else "-")
    added = f"{100 * (r['step_s'] / ref['step_s'] - 1):+.0f}%" if ref is not None and ref is not r else "-"
    err = f"{100 * (pred / peak - 1):+.1f}%" if pred and peak else "-"
    fit = f"{peak / pred:.3f}" if pred and peak else "-"
    peak_s = "-" if peak is None else f"{peak:.1f}"
    return f"{head} {peak_s} | {saved} | {r['step_s']:.2f} | {added} | {pred_s} | {err} | {fit} |"


def table(rows: list[dict], reference: str | None = "recompute full", hbm_gib: float | None = None) -> list[str]:
    ref = reference_row(rows, reference)
    return HEADER + [row_line(r, ref, hbm_gib) for r in rows]


# ------------------------------------------------------------------------------------------------------------
# host memory guard (largest phase: experts in host memory)


def _pinned(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned tensor: the size rounded up to a power of two."""
    return 1 << max(0, (int(nbytes) - 1).bit_length())


def host_bytes_needed(spec, fields: dict) -> float:
    """Host memory of an all-offloaded run: per routed-expert tensor (w_gate_up, w_down of each MoE layer) the fp32
    weight, the fp32 persistent gradient buffer and the bf16 transfer shadow, each pinned and so rounded up to a
    power of two, and bf16 m, v (plain memory: HostOffloadAdamW pins only what it copies) = 14 B / param before
    rounding; with optimizer offload the rest too (fp32 master + bf16 m, v + fp32 grad staging = 12 B / param)."""
    from moestack.planner.profile import profile_model

    prof = profile_model(spec, 2)
    E, I = spec.moe.num_experts, spec.moe.expert_intermediate_size
    L = spec.moe.latent_size or spec.hidden_size
    n_moe = sum(1 for k in spec.layer_kinds() if k.ffn == "moe")
    host = 0
    for n in (E * 2 * I * L, E * L * I):
        host += n_moe * (sum(_pinned(n * b) for b in (4, 4, 2)) + n * 4)
    dense = prof.total_params - n_moe * E * 3 * I * L
    return host + (dense * 12 if "optimizer" in fields.get("offload", []) else 0)


def mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float("inf")


# ------------------------------------------------------------------------------------------------------------


def bwd_ws_line(r: dict, cal) -> str | None:
    """From --phase-peaks: per layer kind the largest backward transient (peak of a layer's backward minus the
    allocation at the end of the phase before) and its ratio to the planner's no-recompute activations of the kind
    (Calibration.bwd_ws_factors; MoE kinds under expert offload include its working set)."""
    if not r.get("phase_peaks") or not r.get("plan"):
        return None
    from moestack.config.plan import RecomputePolicy

    plan = Plan.model_validate(r["plan"])
    spec = variant_spec(load_model_spec(plan.model), r["seq"], r["experts"])
    kinds, seen = spec.layer_kinds(), {}
    for before, m in zip(r["phase_peaks"], r["phase_peaks"][1:]):
        i = m["phase"].removeprefix("layer ").removesuffix(" backward")
        if i.isdigit() and int(i) < len(kinds):
            key = f"{kinds[int(i)].mixer}/{kinds[int(i)].ffn}"
            seen[key] = max(seen.get(key, 0.0), m["peak_gib"] - before["end_gib"])
    costs, layers, _ = cost_model(spec, plan, cal).kind_costs(plan.model_copy(update={"recompute": RecomputePolicy()}))
    act = {f"{x.kind.mixer}/{x.kind.ffn}": c.act / GIB for c, x in zip(costs, layers)}
    return "  bwd ws x (measured backward transient / planner no-recompute act, GiB): " + ", ".join(
        f"{k} {v:.2f} / {act[k]:.2f} = {v / act[k]:.4f}" for k, v in seen.items() if act.get(k))


def _details(rows: list[dict], ref: dict | None = None, cal=None) -> list[str]:
    """Per-row memory reports, offload statistics and measured factors (`ref`: the reference row; `cal`: the
    calibration the backward working-set factors of --phase-peaks rows are computed under)."""
    out = []
    for r in rows:
        label = f"{r['technique']} ({r['experts']} experts, seq {r['seq']})"
        pred = r.get("predicted", {}).get("breakdown_gib")
        if r.get("report_lines"):
            out += ["", label + ":"] + r["report_lines"]
        elif pred:
            out += ["", label + ": planner GiB " + ", ".join(f"{k} {v:.2f}" for k, v in pred.items())]
        if r.get("offload_copy_s") is not None:
            line = f"  activation offload: copies {r['offload_copy_s']:.2f} s per step (D2H + H2D, copy streams)"
            same = (ref is not None and ref is not r and ref.get("seq") == r.get("seq")
                    and ref["plan"]["recompute"] == r["plan"]["recompute"]
                    and not ref["plan"]["offload"]["activations"])
            if same and r["offload_copy_s"] > 0:  # the reference is the same step without the copies
                exposed = r["step_s"] - ref["step_s"]
                line += (f"; exposed {exposed:.2f} s vs {ref['technique']}: overlap "
                         f"{100 * (1 - exposed / r['offload_copy_s']):.0f}%")
            out.append(line)
        ratio = act_ratio(r)
        if ratio is not None:
            out.append(f"  act x {ratio:.3f} (measured / planner activations at the end of forward: "
                       f"{r['report']['measured_gib']['activations']:.2f} / "
                       f"{r['predicted']['forward_activations_gib']:.2f} GiB)")
        ws_line = bwd_ws_line(r, cal) if cal is not None else None
        if ws_line:
            out.append(ws_line)
        if r.get("all_step_s"):
            fmt = lambda xs: "/".join(f"{x:.2f}" for x in xs)
            out.append(f"  timing: {label}: build {r.get('build_s', 0):.1f} s, steps {fmt(r['all_step_s'])} s "
                       f"(fwd+bwd {fmt(r['fwd_bwd_s'])}, clip+opt {fmt(r['clip_opt_s'])}; first = warm-up), host "
                       f"peak RSS {r.get('host_peak_rss_gib', 0):.1f} GiB, available {r.get('host_available_gib', 0):.0f}")
        for key in ("activation_offload", "expert_offload", "act_bytes_per_token_layer"):
            if key in r:
                out.append(f"  {key}: {r[key]}")
        if r.get("status") not in (None, "ok", "oom", "skipped") and r.get("log_tail"):
            out += ["  log tail:"] + ["    " + x for x in r["log_tail"].strip().splitlines()[-8:]]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=["techniques", "long", "largest"], default="techniques")
    ap.add_argument("--model", default="proxy")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cluster", default=None, help="planner cluster preset (default h200-1gpu on CUDA, else cpu)")
    ap.add_argument("--calibration", default=None, help="planner calibration JSON (moestack tune; default built-in)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated technique names (techniques / long phases)")
    ap.add_argument("--reference", default=None,
                    help="reference row for saved / time added when the baseline does not train (default: "
                         "'recompute full'; largest phase: 'first', the first row that trains)")
    ap.add_argument("--experts", default="256,384,512", help="num_experts to try, all combined (largest phase)")
    ap.add_argument("--seq-lens", default="", help="sequence lengths to try at the preset's experts, all combined "
                                                   "(largest phase, alternating with --experts)")
    ap.add_argument("--search", choices=["grow", "down"], default="grow",
                    help="largest phase: grow (rows in order until one fails, per axis) or down (rows in order, e.g. "
                         "most experts first; host-infeasible ones skipped; stop at the first that trains)")
    ap.add_argument("--host-fraction", type=float, default=0.85,
                    help="largest phase: skip a row whose host memory estimate exceeds this share of MemAvailable")
    ap.add_argument("--deadline-s", type=float, default=None, help="wall-clock budget of the whole phase")
    ap.add_argument("--row-timeout-s", type=float, default=None,
                    help="wall-clock limit of one row (its process is killed; the phase goes on with the next)")
    ap.add_argument("--no-isolate", action="store_true", help="run rows in this process (no subprocess per row)")
    ap.add_argument("--no-report", action="store_true", help="skip the memory report pass")
    ap.add_argument("--kda-backend", default=None, help="kernels.kda.backend (e.g. reference, triton; a child row "
                    "gets it too)")
    ap.add_argument("--no-autotune", action="store_true",
                    help="kernels.autotune false: one launch config per Triton kernel (a child row gets it too)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--snapshot", nargs="?", const=".", default=None, metavar="DIR",
                    help="CUDA: record the allocator history of each row (torch.cuda.memory._record_memory_history) "
                         "and write the live blocks at the timed steps' peak (largest 30, with their allocation "
                         "frames) to DIR/memsnap-<technique>-<experts>e-<seq>.json (default DIR: .); slows the row")
    ap.add_argument("--phase-peaks", action="store_true",
                    help="CUDA: one more step after the timed ones, printing the peak allocated memory per phase "
                         "(forward, loss + head backward, each layer's backward, clip + optimizer)")
    ap.add_argument("--child-row", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.reference is None:
        args.reference = "first" if args.phase == "largest" else "recompute full"
    t_start = time.monotonic()
    global KERNELS
    KERNELS = KernelSpec(**({"kda": {"backend": args.kda_backend}} if args.kda_backend else {}),
                         autotune=not args.no_autotune)
    device = torch.device(args.device)
    args.cluster = args.cluster or ("h200-1gpu" if device.type == "cuda" else "cpu")
    from moestack.planner.calibration import load_calibration

    cal = load_calibration(args.calibration)
    base = load_model_spec(args.model)

    if args.child_row is not None:  # one row, result as JSON in --child-out
        out = run_row(json.loads(args.child_row), args, base, cal)
        with open(args.child_out, "w") as f:
            json.dump(out, f, default=str)
        return

    # an outer `timeout` sends SIGTERM: exit through Python so that subprocess.run kills the running row's process
    # (an orphaned row would keep its GPU memory while the next phase starts)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from moestack.config.cluster import load_cluster_spec

    # the device's memory from the cluster preset: the parent never creates a CUDA context (it would take memory
    # from the rows' device)
    hbm_gib = load_cluster_spec(args.cluster).device.hbm_bytes / GIB if device.type == "cuda" else None
    todo = phase_rows(args)
    rows: list[dict] = []
    print(f"{args.model}, micro-batch {args.micro_batch}, {device}, phase {args.phase}, {args.warmup} warmup + "
          f"{args.steps} timed steps, rows {'in this process' if args.no_isolate else 'one subprocess each'}; "
          f"planner: {args.calibration or 'built-in calibration'}", flush=True)
    print("\n".join(HEADER), flush=True)
    stop_axis: set[str] = set()
    for row in todo:
        spec = variant_spec(base, row["seq"], row["experts"])
        row = dict(row, experts=spec.moe.num_experts)
        plan = make_plan(args.model, row["seq"], args.micro_batch, row["fields"], args.cluster)
        predicted = predict(spec, plan, cal)
        left = None if args.deadline_s is None else args.deadline_s - (time.monotonic() - t_start)
        skip = None
        if row.get("axis") in stop_axis:
            skip = "a smaller one failed" if args.search == "grow" else "a larger one trained"
        elif left is not None and left < 20:
            skip = "no time left"
        elif args.phase == "largest" and row["fields"].get("offload"):
            need, have = host_bytes_needed(spec, row["fields"]), mem_available()
            if need > args.host_fraction * have:
                skip = f"host memory: ~{need / GIB:.0f} GiB needed, {have / GIB:.0f} available"
        if skip is not None:
            r = {"technique": row["name"], "experts": row["experts"], "seq": row["seq"], "oom": False,
                 "status": "skipped", "error": skip}
        elif args.no_isolate:
            r = run(row["name"], spec, plan, device, args.steps, args.warmup, not args.no_report, cal,
                    snapshot=args.snapshot, phase_peaks=args.phase_peaks)
        else:
            limit = min(x for x in (left, args.row_timeout_s, 24 * 3600.0) if x is not None)
            r = run_isolated(row, args, limit)
        r["predicted"] = predicted
        rows.append(r)
        if args.phase == "largest" and args.search == "grow" and r.get("status") != "ok":
            stop_axis.add(row.get("axis"))
        if args.phase == "largest" and args.search == "down" and r.get("status") == "ok":
            stop_axis.update({"experts", "seq"})  # the largest that trains is found: the rest are smaller
        print(row_line(r, reference_row(rows, args.reference), hbm_gib), flush=True)
        if args.json:  # after every row: a cut run still leaves its numbers
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1, default=str)
    ref = reference_row(rows, args.reference)
    print(f"\n{args.model}, micro-batch {args.micro_batch}, {device}, phase {args.phase}; saved / time added vs "
          f"{ref['technique'] + ' (' + str(ref['experts']) + ' experts, seq ' + str(ref['seq']) + ')' if ref else '-'}; "
          f"planner GiB = cost model peak minus its reserved term; fit x = measured / planner")
    print("\n".join(table(rows, args.reference, hbm_gib)))
    print("\n".join(_details(rows, ref, cal)), flush=True)
    factors = suggested_act_factors(rows, cal)
    if factors:
        target = args.calibration or "the calibration JSON"
        print(f"\nfeed back: \"act_factors\": {json.dumps(factors)}  (merge into {target}; fit x above is the "
              "planner total's factor per row)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
