"""Single-device training loop: read top to bottom.

setup (spec, data, model, optimizer, resume) -> for each step: micro-batches (forward, backward) -> non-finite
check -> clip -> optimizer/scheduler step -> MoE bias update -> metrics / eval / checkpoint -> plot at the end.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moestack.config.base import ConfigError, dump_yaml
from moestack.config.model_spec import ModelSpec
from moestack.config.train_spec import TrainSpec
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.transformer import Transformer, build_model
from moestack.train.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from moestack.train.data import build_data, eval_batches
from moestack.train.metrics import MetricsLogger, format_expert_load, plot_loss_curve
from moestack.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from moestack.train.tokenizer import build_tokenizer


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. repeated non-finite losses); the message says why and what to do."""


# Dense bf16 tensor-core peaks (vendor datasheets) used as the MFU denominator, as Megatron/torchtitan do.
_PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "H800": 989.4e12, "A100": 312e12, "B200": 2250e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: '{name}' requested but no CUDA device is available; use --device cpu or auto")
    return dev


def autocast_context(spec: TrainSpec, device: torch.device):
    use_bf16 = spec.precision == "bf16" or (spec.precision == "auto" and device.type == "cuda")
    if use_bf16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    mfu: float | None
    aux: dict[str, float] = field(default_factory=dict)


class Trainer:
    def __init__(self, spec: TrainSpec, model_spec: ModelSpec, log=print):
        self.spec = spec
        self.model_spec = model_spec
        self.log = log
        self.out_dir = Path(spec.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.device = resolve_device(spec.device)
        self.autocast = autocast_context(spec, self.device)
        if spec.seq_len > model_spec.max_seq_len:
            raise ConfigError(
                f"seq_len: {spec.seq_len} exceeds model max_seq_len {model_spec.max_seq_len}; lower --seq-len"
            )

        torch.manual_seed(spec.seed)
        self.tokenizer = build_tokenizer(spec.data)
        if self.tokenizer.vocab_size > model_spec.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {model_spec.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({self.tokenizer.vocab_size}); use a model with a larger vocab or another tokenizer"
            )
        self.sampler, eval_tokens = build_data(
            spec.data, self.tokenizer, spec.seq_len, spec.micro_batch_size, spec.seed, model_spec.vocab_size
        )
        # eval_fraction = 0 means no held-out data: evaluation is skipped
        self.eval_set = (
            eval_batches(eval_tokens, spec.seq_len, spec.micro_batch_size, spec.eval_batches)
            if len(eval_tokens) > spec.seq_len
            else []
        )

        self.model: Transformer = build_model(model_spec, self.device, seed=spec.seed)
        self._configure_dsa()
        self.optimizer = build_optimizer(self.model, spec.optimizer)
        self.scheduler = build_scheduler(self.optimizer, spec.schedule, spec.steps, spec.optimizer.lr)
        self.step = 0
        self.flops_per_token = _train_flops_per_token(model_spec, spec.seq_len)
        self.peak_flops = device_peak_flops(self.device)
        self.metrics = MetricsLogger(self.out_dir, tensorboard=spec.logging.tensorboard)

    # ----------------------------------------------------------------------------------------------- setup
    def _configure_dsa(self) -> None:
        dsa = self.spec.dsa
        for layer in self.model.dsa_layers().values():
            layer.sparse = dsa.mode == "sparse"
            layer.indexer_loss_coef = dsa.indexer_loss_coef
        if dsa.mode == "dense" and dsa.freeze_main_in_dense and self.model.dsa_layers():
            for name, p in self.model.named_parameters():
                p.requires_grad_(".indexer." in name)

    def resume(self, path: Path | None = None) -> bool:
        """Load `path` or the newest complete checkpoint under out_dir; False if there is none."""
        path = path or latest_checkpoint(self.ckpt_dir)
        if path is None:
            return False
        extra = load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.sampler.load_state_dict(extra["sampler"])
        restore_rng_state(extra["rng"])
        self.step = int(extra["step"])
        self.log(f"resumed from {path} at step {self.step}")
        return True

    def save(self) -> Path:
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": capture_rng_state(),
            "model_name": self.model_spec.name,
        }
        return save_checkpoint(self.ckpt_dir, self.step, self.model, self.optimizer, extra, self.spec.checkpoint.keep)

    # ----------------------------------------------------------------------------------------------- steps
    def _forward_backward(self) -> tuple[float, bool]:
        accum = self.spec.grad_accum_steps
        set_aux_loss_scale(1.0 / accum)
        total = 0.0
        for _ in range(accum):
            inputs, targets = self.sampler.next_batch()
            inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            with self.autocast():
                loss = self.model(inputs, targets)
            (loss / accum).backward()
            total += loss.detach().float().item() / accum
        return total, math.isfinite(total)

    def train_step(self) -> StepStats | None:
        """One optimizer step. Returns None when the step was skipped for a non-finite loss or gradient."""
        t0 = time.perf_counter()
        self.model.train()
        loss, finite = self._forward_backward()
        grad_norm = clip_grad_norm([p for p in self.model.parameters() if p.grad is not None],
                                   self.spec.optimizer.grad_clip)
        if not finite or not math.isfinite(float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            for moe in self.model.moe_layers().values():
                moe.router.tokens_per_expert.zero_()
            return None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        counts = {name: moe.router.update_selection_bias() for name, moe in self.model.moe_layers().items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        tokens_per_s = self.spec.tokens_per_step / dt
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None
        self._last_counts = counts
        return StepStats(loss, float(grad_norm), self.scheduler.get_last_lr()[0], tokens_per_s, mfu, self._aux())

    def _aux(self) -> dict[str, float]:
        out = {}
        moe_aux = [m.last_aux_loss for m in self.model.moe_layers().values() if m.last_aux_loss is not None]
        if moe_aux:
            out["moe_aux_loss"] = float(torch.stack([a.float() for a in moe_aux]).mean())
        idx_loss = [
            a.last_indexer_loss for a in self.model.dsa_layers().values() if a.last_indexer_loss is not None
        ]
        if idx_loss:
            out["indexer_kl"] = float(torch.stack([a.float() for a in idx_loss]).mean())
        return out

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for inputs, targets in self.eval_set:
            with self.autocast():
                losses.append(float(self.model(inputs.to(self.device), targets.to(self.device))))
        self.model.train()
        return sum(losses) / len(losses)

    # ----------------------------------------------------------------------------------------------- loop
    def fit(self, progress=None) -> dict:
        spec = self.spec
        self.out_dir.mkdir(parents=True, exist_ok=True)
        dump_yaml(spec, self.out_dir / "train.yaml")
        dump_yaml(self.model_spec, self.out_dir / "model.yaml")
        bad_steps, last_ckpt, history = 0, latest_checkpoint(self.ckpt_dir), []
        while self.step < spec.steps:
            stats = self.train_step()
            if stats is None:
                bad_steps += 1
                self.metrics.log(self.step, {"skipped_nonfinite": 1.0})
                self.log(f"step {self.step + 1}: non-finite loss or gradient, step skipped ({bad_steps} in a row)")
                if bad_steps >= spec.max_bad_steps:
                    where = f"last good checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written"
                    raise TrainingStopped(
                        f"stopped after {bad_steps} consecutive non-finite steps at step {self.step + 1}; {where}. "
                        f"Lower optimizer.lr or check the data, then resume with --resume"
                    )
                continue
            bad_steps = 0
            self.step += 1
            history.append(stats.loss)
            record = {"loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                      "tokens_per_s": stats.tokens_per_s, **stats.aux}
            if stats.mfu is not None:
                record["mfu"] = stats.mfu
            if self.device.type == "cuda":
                record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            if self.step % spec.logging.every == 0 or self.step == spec.steps:
                self.metrics.log(self.step, record)
            if progress is not None:
                progress(self.step, stats)
            due_eval = (spec.eval_every and self.step % spec.eval_every == 0) or self.step == spec.steps
            if due_eval and self.eval_set:
                self.metrics.log(self.step, {"loss": self.evaluate()}, prefix="eval")
            if (spec.checkpoint.every and self.step % spec.checkpoint.every == 0) or self.step == spec.steps:
                last_ckpt = self.save()
        self.metrics.close()
        plot = plot_loss_curve(self.out_dir / "metrics.jsonl", self.out_dir / "loss.png")
        load = format_expert_load(getattr(self, "_last_counts", {}))
        return {"losses": history, "checkpoint": last_ckpt, "plot": plot, "metrics": self.out_dir / "metrics.jsonl",
                "expert_load": load}


def _train_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    from moestack.planner.profile import profile_model

    return profile_model(spec, seq_len).train_flops_per_token


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
