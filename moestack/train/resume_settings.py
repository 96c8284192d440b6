"""--resume honours the run's settings: the optimizer and schedule values of this run's TrainSpec (command line,
--set, YAML) replace the checkpoint's, and each change is said in one line; a change that cannot apply is refused
with one line naming the field.

A checkpoint carries its optimizer hyper-parameters in the optimizer state (param groups: lr, betas, eps,
weight_decay) and its peak learning rate in the scheduler state (LambdaLR.base_lrs); loading them alone would
restore the old values whatever the user asked. The trainer records its settings in every checkpoint
(`settings_record`, extra["train_settings"]); on resume `check_resume_settings` (before the load) refuses what
cannot carry over, and `apply_resume_settings` (after) writes this run's values into the loaded param groups and
scheduler and returns the lines to log.

  applied     optimizer.lr (the scheduler's peak; the current lr follows the schedule at the resumed step),
              optimizer.betas, optimizer.eps, optimizer.weight_decay (decay groups; no-decay groups keep 0),
              optimizer.grad_clip (read every step), schedule.warmup_steps / decay / min_lr_ratio and steps (the
              schedule is this run's function of the step; the lr at the resumed step is recomputed)
  refused     the optimizer kind (plan.optimizer: its state does not carry over; --init-from starts from the
              weights instead), steps not beyond the checkpoint's step
A checkpoint written before the settings were recorded: lr, betas, eps and weight decay are compared with the
loaded optimizer state, the schedule is this run's (one line says so).
"""

from __future__ import annotations

from typing import Any

from moestack.config.train_spec import TrainSpec
from moestack.train.checkpoint import CheckpointError
from moestack.train.optim import lr_factor

KEY = "train_settings"


def optimizer_kind(plan) -> str:
    return plan.optimizer if plan is not None else "adamw"


def settings_record(spec: TrainSpec, plan) -> dict[str, Any]:
    """What a checkpoint records of the run's optimizer and schedule (extra["train_settings"])."""
    return {"optimizer_kind": optimizer_kind(plan), "optimizer": spec.optimizer.model_dump(mode="json"),
            "schedule": spec.schedule.model_dump(mode="json"), "steps": spec.steps}


def saved_extra(path) -> dict:
    """The checkpoint's recorded extra (meta.json, not verified: load_checkpoint verifies); {} if unreadable."""
    import json
    from pathlib import Path

    from moestack.train.checkpoint import META

    try:
        return json.loads((Path(path) / META).read_text()).get("extra", {})
    except (OSError, ValueError):
        return {}


def check_resume_settings(path, extra: dict, spec: TrainSpec, plan) -> None:
    """Before loading: CheckpointError (one line, naming the field) for a change that cannot be applied."""
    saved = extra.get(KEY)
    step = int(extra.get("step", 0))
    if saved is not None and saved.get("optimizer_kind") != optimizer_kind(plan):
        raise CheckpointError(
            f"resume: optimizer: checkpoint {path} holds {saved.get('optimizer_kind')} state, this run builds "
            f"{optimizer_kind(plan)}; the state does not carry over: keep plan.optimizer "
            f"{saved.get('optimizer_kind')}, or start from its weights with --init-from {path}")
    if spec.steps <= step:
        raise CheckpointError(f"resume: steps: {spec.steps} is not beyond the checkpoint's step {step} ({path}); "
                              f"raise --steps to continue")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return str(v)


def _is_no_decay(group: dict) -> bool:
    return "no_decay" in str(group.get("name", ""))


def apply_resume_settings(optimizer, scheduler, extra: dict, spec: TrainSpec) -> list[str]:
    """After loading: this run's optimizer / schedule values into the loaded optimizer and scheduler. Returns one
    line per changed field (old -> new) and, for an old checkpoint without recorded settings, one about the
    schedule."""
    saved = extra.get(KEY)
    lines = []
    opt = spec.optimizer
    groups = optimizer.param_groups
    if saved is not None:
        old_opt, old_sched, old_steps = saved["optimizer"], saved["schedule"], saved["steps"]
    else:  # what the loaded state says
        decay = next((g for g in groups if not _is_no_decay(g)), groups[0])
        base = list(getattr(scheduler, "base_lrs", [decay["lr"]]))
        old_opt = {"lr": base[groups.index(decay)] / decay.get("lr_scale", 1.0), "betas": decay.get("betas"),
                   "eps": decay.get("eps"), "weight_decay": decay.get("weight_decay"), "grad_clip": None}
        old_sched, old_steps = None, None
    for name in ("lr", "betas", "eps", "weight_decay", "grad_clip"):
        new, old = getattr(opt, name), old_opt.get(name)
        if old is None:
            continue
        if tuple(new) != tuple(old) if isinstance(new, tuple) else float(new) != float(old):
            lines.append(f"resume: optimizer.{name} {_fmt(old)} -> {_fmt(new)} (this run's value applies)")
    if old_sched is not None:
        for name, new in spec.schedule.model_dump(mode="json").items():
            if new != old_sched.get(name):
                lines.append(f"resume: schedule.{name} {_fmt(old_sched.get(name))} -> {_fmt(new)} (this run's "
                             "schedule applies)")
        if spec.steps != old_steps:
            lines.append(f"resume: steps {old_steps} -> {spec.steps} (the schedule spans this run's steps)")
    else:
        s = spec.schedule
        lines.append(f"resume: the checkpoint does not record its schedule; this run's applies (warm-up "
                     f"{s.warmup_steps}, {s.decay}, min_lr_ratio {s.min_lr_ratio}, {spec.steps} steps)")
    step = scheduler.last_epoch
    factor = lr_factor(step, spec.schedule, spec.steps)
    base_lrs = []
    for g in groups:
        peak = opt.lr * g.get("lr_scale", 1.0)
        base_lrs.append(peak)
        g["initial_lr"] = peak
        g["lr"] = peak * factor
        if "betas" in g:
            g["betas"] = tuple(opt.betas)
        if "eps" in g:
            g["eps"] = opt.eps
        if "weight_decay" in g:
            g["weight_decay"] = 0.0 if _is_no_decay(g) else opt.weight_decay
    scheduler.base_lrs = base_lrs
    scheduler._last_lr = [g["lr"] for g in groups]
    return lines
