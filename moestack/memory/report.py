"""Memory report (`moestack train --memory-report`): where one training step's memory goes, next to the planner.

`measure_memory` runs one extra forward + backward on a batch and leaves the model as it found it (gradients,
router counters and `last_*` logging values are restored). Categories (bytes, on the compute device):

  weights       parameters on the device (host-resident parameters are listed under host)
  gradients     gradients on the device after backward
  optimizer     optimizer state tensors on the device (0 when offloaded; host bytes listed separately)
  activations   what forward leaves for backward, by layer type (kda / mla / gqa / moe / dense / other: embedding,
                final norm, head and loss, plus anything outside a Block)
  buffers       transient memory at the peak: peak allocated minus the four above (GEMM workspaces, logits
                chunks, dispatch buffers, recompute, gradient staging)
  reserved      allocator slack (peak reserved - peak allocated) + CUDA context and other processes' use

On CUDA the numbers come from the caching allocator (torch.cuda.memory_allocated / max_memory_allocated /
max_memory_reserved / mem_get_info); activations by layer type are the allocator deltas across each Block part's
forward. On CPU there is no allocator to ask ("allocator stats need CUDA"): activations are the bytes of the
tensors autograd saves in one forward (distinct storages, weights and their autocast copies apart; nothing inside
recomputed or offloaded regions is visible), and peak / buffers / reserved are not measured. In both cases the
planner's prediction for the same plan (moestack/planner/cost/step.py CostModel) is printed alongside.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from moestack.config.cluster import GIB
from moestack.config.plan import Plan, make_plan
from moestack.memory.offload import is_weight_like
from moestack.memory.recompute import _RestoreForwardState

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "buffers", "reserved")


@dataclass
class MemoryReport:
    device: str
    measured: dict[str, float]  # category -> bytes on the device (CATEGORIES; None-valued entries not measured)
    activations_by_kind: dict[str, float]
    host: dict[str, float]  # host-resident weights / gradients / optimizer bytes
    peak: float | None  # peak allocated (CUDA)
    device_total: float | None  # peak reserved + context (CUDA): what the device had to hold
    predicted: dict[str, float] | None = None  # the planner's breakdown for the same plan (bytes)
    predicted_forward_activations: float | None = None  # the planner's activations at the end of forward (bytes)
    notes: list[str] = field(default_factory=list)

    @property
    def measured_total(self) -> float:
        return self.device_total if self.device_total is not None else sum(v for v in self.measured.values() if v)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def state_breakdown(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> tuple[
        dict[str, float], dict[str, float]]:
    """({weights, gradients, optimizer} on `device`, the same on the host) from tensor sizes."""
    params = list(model.parameters())

    def split(tensors):
        on = [t for t in tensors if t is not None and _dev(t).type == device.type]
        off = [t for t in tensors if t is not None and _dev(t).type != device.type]
        return _storage_bytes(on), _storage_bytes(off)

    states = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    w_dev, w_host = split(params)
    g_dev, g_host = split([p.grad for p in params])
    o_dev, o_host = split(states)
    return ({"weights": w_dev, "gradients": g_dev, "optimizer": o_dev},
            {"weights": w_host, "gradients": g_host, "optimizer": o_host})


def _dev(t: torch.Tensor) -> torch.device:
    return t.to_local().device if hasattr(t, "to_local") else t.device


def _part_labels(model: nn.Module):
    """(module, label) for every Block part: mixer kind on attn (its norm included), ffn kind on ffn."""
    for block in model.layers.values():
        yield block.attn, block.kind.mixer
        yield block.ffn, block.kind.ffn


class _Labels:
    """A label stack driven by forward hooks (which layer type is running)."""

    def __init__(self):
        self.stack = ["other"]

    def hooks(self, model: nn.Module, on_enter=None, on_exit=None) -> list:
        handles = []
        for module, label in _part_labels(model):
            def pre(mod, args, label=label):
                self.stack.append(label)
                if on_enter is not None:
                    on_enter(label)

            def post(mod, args, out, label=label):
                if on_exit is not None:
                    on_exit(label)
                self.stack.pop()

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
        return handles


@contextlib.contextmanager
def _restored(model: nn.Module):
    """Run a measuring step without changing training state: grads and forward counters come back."""
    old = {p: p.grad for p in model.parameters()}
    for p in old:
        p.grad = None
    with _RestoreForwardState(model):
        try:
            yield
        finally:
            for p, g in old.items():
                p.grad = g


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: torch.Tensor,
                   targets: torch.Tensor, autocast=contextlib.nullcontext, plan: Plan | None = None,
                   cal=None) -> MemoryReport:
    """One forward + backward of `model(inputs, targets)` measured (module docstring). `autocast`: a callable
    returning the trainer's autocast context. With `plan`, the planner's prediction is attached (under
    calibration `cal`, a moestack.planner.calibration.Calibration; default the built-in one)."""
    device = inputs.device
    if device.type == "cuda":
        report = _measure_cuda(model, optimizer, inputs, targets, autocast)
    else:
        report = _measure_saved(model, optimizer, inputs, targets, autocast)
    if plan is not None:
        _attach_prediction(report, model.spec, plan, cal)
    return report


def _measure_cuda(model, optimizer, inputs, targets, autocast) -> MemoryReport:
    device = inputs.device
    torch.cuda.synchronize(device)
    by_kind: dict[str, float] = {}
    marks: list[int] = []
    labels = _Labels()
    in_forward = [False]  # recompute reruns parts inside backward: only the first forward is attributed

    def enter(label):
        if in_forward[0]:
            marks.append(torch.cuda.memory_allocated(device))

    def leave(label):
        if in_forward[0]:
            by_kind[label] = by_kind.get(label, 0.0) + torch.cuda.memory_allocated(device) - marks.pop()

    with _restored(model):
        handles = labels.hooks(model, enter, leave)
        try:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            in_forward[0] = True
            with autocast():
                loss = model(inputs, targets)
            in_forward[0] = False
            acts = torch.cuda.memory_allocated(device) - base
            loss.backward()
            torch.cuda.synchronize(device)
        finally:
            for h in handles:
                h.remove()
        on_dev, host = state_breakdown(model, optimizer, device)
        peak = torch.cuda.max_memory_allocated(device)
        peak_reserved = torch.cuda.max_memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        context = max(0, (total - free) - torch.cuda.memory_reserved(device))
    by_kind["other"] = acts - sum(v for k, v in by_kind.items() if k != "other")
    measured = dict(on_dev, activations=float(acts))
    measured["buffers"] = max(0.0, peak - sum(measured.values()))
    measured["reserved"] = float(peak_reserved - peak + context)
    return MemoryReport(str(device), measured, by_kind, host, float(peak), float(peak_reserved + context))


def _measure_saved(model, optimizer, inputs, targets, autocast) -> MemoryReport:
    by_kind: dict[str, float] = {}
    seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights and their views
    weight_copies = [0]
    labels = _Labels()

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            if is_weight_like(t):  # a dtype copy of a weight (autocast)
                weight_copies[0] += t.untyped_storage().nbytes()
            else:
                label = labels.stack[-1]
                by_kind[label] = by_kind.get(label, 0.0) + t.untyped_storage().nbytes()
        return t

    with _restored(model):
        handles = labels.hooks(model)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
                loss = model(inputs, targets)
            loss.backward()
        finally:
            for h in handles:
                h.remove()
        on_dev, host = state_breakdown(model, optimizer, inputs.device)
    measured = dict(on_dev, activations=float(sum(by_kind.values())), buffers=None, reserved=None)
    notes = ["allocator stats need CUDA: activations are the bytes autograd saves in one forward (recomputed or "
             "offloaded regions not visible); peak, buffers and reserved are not measured"]
    if weight_copies[0]:
        notes.append(f"autocast weight copies saved for backward: {weight_copies[0] / GIB:.3f} GiB (not counted)")
    return MemoryReport(str(inputs.device), measured, by_kind, host, None, None, notes=notes)


def cost_model(spec, plan: Plan, cal=None):
    """The planner's CostModel (moestack/planner/cost/step.py) for `plan`'s cluster and sequence length under
    calibration `cal` (default: built-in)."""
    from moestack.config.cluster import load_cluster_spec
    from moestack.planner.calibration import load_calibration
    from moestack.planner.cost.step import CostModel
    from moestack.planner.profile import profile_model

    cluster = load_cluster_spec(plan.cluster).with_devices(plan.devices)
    prof = profile_model(spec, plan.seq_len)
    flops = prof.train_flops_per_token + prof.mtp_train_flops_per_token
    cal = cal if cal is not None else load_calibration()
    return CostModel(spec, cluster, cal, plan.seq_len, flops)


def planner_cost(spec, plan: Plan, cal=None):
    """The planner's PlanCost for `plan` under calibration `cal` (default: built-in)."""
    return cost_model(spec, plan, cal).evaluate(plan)


def _attach_prediction(report: MemoryReport, spec, plan: Plan, cal=None) -> None:
    cost = planner_cost(spec, plan, cal)
    report.predicted = dict(cost.memory)
    # the report measures no fp8 weight-cache category: the planner's fp8 weight copies (precision fp8) count as weights
    report.predicted["weights"] += report.predicted.pop("fp8_weights", 0.0)
    report.predicted_forward_activations = cost.forward_activations


def predicted_memory(spec, plan: Plan, cal=None) -> dict[str, float]:
    """The planner's per-device memory breakdown (bytes) for `plan` under calibration `cal` (default: built-in)."""
    return dict(planner_cost(spec, plan, cal).memory)


def single_device_plan(model: str, seq_len: int, micro_batch_size: int, grad_accum_steps: int = 1,
                       cluster: str | None = None, **fields) -> Plan:
    """The trivial one-device plan `train` uses without a plan file (cluster: h200-1gpu on CUDA, else cpu)."""
    cluster = cluster or ("h200-1gpu" if torch.cuda.is_available() else "cpu")
    return make_plan(model=model, cluster=cluster, devices=1, seq_len=seq_len, micro_batch_size=micro_batch_size,
                     global_batch_size=micro_batch_size * grad_accum_steps, **fields)


def trainer_memory_report(trainer) -> list[str]:
    """`moestack train --memory-report`: measure one forward + backward of the trainer's model on its next batch
    (training state untouched: measure_memory) and format it next to the planner's prediction for the trainer's
    plan (its --plan, else the one-device plan `single_device_plan` describes). Lines to print; a pipeline-parallel
    trainer gets one line saying it is not supported (a stage is not a whole model)."""
    if trainer.pipeline is not None:
        return ["memory report: not supported under pipeline parallelism (each rank holds a stage)"]
    spec = trainer.spec
    plan = trainer.plan
    if plan is None:
        plan = single_device_plan(trainer.model_spec.name, spec.seq_len, spec.micro_batch_size, spec.grad_accum_steps,
                                  cluster="h200-1gpu" if trainer.device.type == "cuda" else "cpu")
    inputs, targets = trainer.sampler.next_batch()
    inputs, targets = inputs.to(trainer.device), targets.to(trainer.device)
    report = measure_memory(trainer.model, trainer.optimizer, inputs, targets, trainer.autocast)
    try:
        _attach_prediction(report, trainer.model_spec, plan)
    except Exception as err:  # noqa: BLE001 - the measurement is still worth printing
        report.notes.append(f"planner prediction unavailable: {type(err).__name__}: {err}")
    lines = format_report(report)
    if trainer.plan is None:
        lines.append(f"  planner plan: one device ({plan.cluster}), seq {plan.seq_len} x micro-batch "
                     f"{plan.micro_batch_size}, no recompute / offload (the trainer without --plan applies none)")
    return lines


def format_report(report: MemoryReport) -> list[str]:
    """Lines of a table: category, measured GiB, planner GiB (and the relative difference of the totals)."""
    pred = report.predicted or {}
    source = "allocator" if report.peak is not None else "tensor sizes + saved tensors"
    lines = [f"memory report ({report.device}, {source})", f"  {'':24}{'measured GiB':>14}{'planner GiB':>14}"]

    def row(name: str, value, predicted) -> str:
        m = f"{value / GIB:14.3f}" if value is not None else f"{'-':>14}"
        p = f"{predicted / GIB:14.3f}" if predicted is not None else f"{'-':>14}"
        return f"  {name:24}{m}{p}"

    for cat in CATEGORIES:
        lines.append(row(cat, report.measured.get(cat), pred.get(cat)))
        if cat == "activations":
            if report.predicted_forward_activations is not None:
                # measured: what forward leaves for backward; the planner's peak row may hold fewer (one-device
                # peaks at one end of backward, while gradients build up as activations are freed)
                lines.append(row("  at end of forward", report.measured.get(cat),
                                 report.predicted_forward_activations))
            for kind, nbytes in sorted(report.activations_by_kind.items()):
                lines.append(row(f"  {kind}", nbytes, None))
    total_pred = sum(pred.values()) if pred else None
    lines.append(row("total (device)", report.measured_total if report.peak is not None else None, total_pred))
    if report.peak is not None and total_pred:
        lines.append(f"  planner vs measured total: {100 * (total_pred / report.measured_total - 1):+.1f}%")
    host = {k: v for k, v in report.host.items() if v}
    if host:
        lines.append("  host: " + ", ".join(f"{k} {v / GIB:.3f} GiB" for k, v in host.items()))
    lines += [f"  note: {n}" for n in report.notes]
    return lines
