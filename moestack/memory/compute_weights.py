"""bf16 compute copies of the weights, cast once per optimizer step and shared by every micro-batch (TrainSpec
weight_cache, one device).

Under autocast every forward casts each fp32 weight it multiplies by to bf16 again: with gradient accumulation the
same cast runs once per micro-batch (README.md: its cost on the K3 slice). Here each Linear weight and
each routed-expert weight is cast once, when the weights have changed (after an optimizer step, a load), and the
forwards multiply by that copy (moestack.model.weights.compute_weight).

Exactness: the copy is written by `copy.copy_(w)`, the rounding autocast's own cast runs (round to nearest even), so
the forward sees the same bits. The copy is a leaf that requires grad; after each micro-batch's backward has
accumulated its bf16 gradient, a hook adds it into the fp32 parameter's .grad (moestack.ops.accumulate: widen and
add in one pass, the value of autocast's cast-then-accumulate) and clears it. Losses and gradients are bitwise those
of autocast (tests/memory/test_compute_weights.py). Per micro-batch that moves 10 bytes per parameter where the cast
and AccumulateGrad moved 18.

One tensor per weight for the whole run, rewritten in place: compiled blocks with CUDA graphs (TrainSpec.compile
blocks+graphs) record the copy's address as a static input, and a new tensor per step would re-record every graph at
every step. The refresh runs after the step's backwards, when no saved activation still reads the old values.

Left to autocast / their own path: FP8 layers (Fp8Linear and experts on the FP8 GEMM strategy quantise from the fp32
parameter: a bf16 copy would round twice), experts with MXFP4 fake quantisation (QAT) or a wrapped GEMM strategy
(memory policies), the router (fp32 logits), norms, embeddings, KDA's gate vectors. Under FSDP2 (a plan) the
gathered parameters are already bf16 (parallel/fsdp.py); this class is for the single-device trainer.

With StreamingAdamW (KernelSpec.adamw.backend triton) the optimizer's pass writes each copy from the new fp32 value
it holds in registers (the same rounding), and no recast runs: the copies are handed to it at every refresh.

Memory: 2 bytes per cached parameter for the whole step (autocast's copies live from a layer's forward to its
backward), i.e. +2 B/param at the optimizer step, where the activations are already freed.

Legend: none (whole parameters).
"""

from __future__ import annotations

import torch
from torch import nn

from moestack.model.weights import CachedLinear
from moestack.ops.accumulate import accumulate_into


def _expert_cacheable(experts: nn.Module) -> bool:
    """The plain bf16 GEMM strategy only: not the FP8 one, not a memory policy's wrapper (offload), not QAT."""
    from moestack.ops.moe import GroupedGemm

    return type(experts.gemm) is GroupedGemm and experts.fake_quant is None


def _into_param_grad(module: nn.Module, name: str):
    """The copy's post-accumulate hook: its gradient goes to the parameter's .grad and leaves the copy."""

    def hook(copy: torch.Tensor) -> None:
        grad, copy.grad = copy.grad, None
        param = getattr(module, name)
        param.grad = accumulate_into(param.grad, grad, param.dtype)

    return hook


class ComputeWeights:
    """Keeps `module._compute_weights[name] = param.to(dtype)` for the chosen weights of `model` (see module doc).

    refresh_if_stale() before the forwards of a step (and of an evaluation): recasts when an optimizer step ran
    since the last cast (`optimizer` post hook) or a parameter's version counter moved (load_state_dict, copy_).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        from moestack.model.moe import Experts

        self.dtype = dtype
        self.targets: list[tuple[nn.Module, str]] = []
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = CachedLinear  # same object, parameters and hooks; forward reads the copy
                self.targets.append((module, "weight"))
            elif type(module) is CachedLinear:
                self.targets.append((module, "weight"))
            elif isinstance(module, Experts) and _expert_cacheable(module):
                self.targets += [(module, "w_gate_up"), (module, "w_down")]
        self._versions: list[int] | None = None  # parameter versions at the last cast; None = never cast
        self.casts = 0  # refreshes done (one per optimizer step in training without an optimizer that writes them)
        self.optimizer = optimizer
        self._hook = optimizer.register_step_post_hook(self._after_step) if optimizer else None

    def _after_step(self, optimizer, *_) -> None:
        """An optimizer that wrote the copies with the parameters (StreamingAdamW) leaves them fresh."""
        if getattr(optimizer, "copies_written", False) and self._versions is not None:
            self._versions = self._current_versions()
        else:
            self.mark_stale()

    def _attach(self, pairs: list) -> None:
        attach = getattr(self.optimizer, "attach_compute_copies", None)
        if attach is not None:
            attach(pairs)

    @property
    def num_bytes(self) -> int:
        return sum(getattr(m, n).numel() for m, n in self.targets) * torch.finfo(self.dtype).bits // 8

    def params(self) -> set[int]:
        """ids of the parameters whose gradients the copies' hooks write (always into memory of their own)."""
        return {id(getattr(m, n)) for m, n in self.targets}

    def mark_stale(self) -> None:
        self._versions = None

    def _current_versions(self) -> list[int]:
        return [getattr(m, n)._version for m, n in self.targets]

    def refresh_if_stale(self) -> bool:
        """Recast if needed; returns whether it did."""
        if self._versions is not None and self._versions == self._current_versions():
            return False
        self.refresh()
        return True

    def refresh(self) -> None:
        with torch.no_grad():
            for module, name in self.targets:
                cache = module.__dict__.setdefault("_compute_weights", {})
                param, copy = getattr(module, name), cache.get(name)
                if copy is None or copy.shape != param.shape or copy.device != param.device:
                    cache.pop(name, None)  # free a stale copy before the new one is made
                    copy = cache[name] = torch.empty_like(param, dtype=self.dtype, requires_grad=True)
                    copy.register_post_accumulate_grad_hook(_into_param_grad(module, name))
                copy.copy_(param)
                copy.requires_grad_(param.requires_grad)
        self._versions = self._current_versions()
        self.casts += 1
        self._attach([(getattr(m, n), m._compute_weights[n]) for m, n in self.targets])

    def remove(self) -> None:
        """Drop every copy (forwards read the parameters again) and the optimizer hook; the Linear modules keep
        their CachedLinear class, which then behaves as nn.Linear."""
        for module, _ in self.targets:
            module.__dict__.pop("_compute_weights", None)
        self._attach([])
        if self._hook is not None:
            self._hook.remove()
        self.targets = []
