"""Activation recompute per layer part (Plan.recompute), applied to a built model from outside.

Modes (moestack.config.plan.RecomputePolicy, one per part: kda / attention (mla, gqa) / moe / mlp (dense)):

  none       the part is left alone: autograd keeps everything its ops save.
  full       the part's forward runs under a non-reentrant `torch.utils.checkpoint`: only the part's inputs are
             kept; backward reruns its whole forward (including any communication inside it).
  selective  the same checkpoint with torch's selective policy (SAC, `create_selective_checkpoint_contexts`):
             the outputs of the ops in SAVE_OPS are kept, every other op is recomputed in backward. What is kept
             (per op type, so it holds for every layer kind):
               * GEMM outputs: mm / addmm / bmm / baddbmm, grouped GEMMs (experts), scaled (FP8) GEMMs;
               * attention kernels' outputs (SDPA flash / efficient / cudnn / CPU flash: output + logsumexp);
               * top-k and sort outputs (router / indexer selection, MoE permutation: small, slow to redo);
               * functional collectives (all-to-all, all-gather, reduce-scatter): never re-communicated.
             Recomputed: norms, activation functions (SiTU-GLU / SwiGLU outputs of experts, shared experts and the
             dense MLP), sigmoid / SiLU gates, dtype casts (incl. autocast's bf16 weight copies), KDA short conv +
             SiLU + L2 norm, gathers (the dispatched expert input is re-gathered from the kept down-projection
             output), and, as the planner assumes (moestack/planner/cost/work.py `mla_work`), the MLA up-projections:
             every op inside the submodules named in RECOMPUTE_SUBMODULES (GatedMLA.q_b_proj, GatedMLA.kv_b_proj).
             Ops are seen at the dispatcher level, so a custom autograd.Function that launches its own kernels
             (the KDA Triton op) is invisible to the policy and is rerun as a whole: register such an op as a
             torch.library custom op and add it with `register_save_op` to keep its output.

What is wrapped: Block.attn and Block.ffn by their kind (Block.kind.mixer in kda / mla / gqa, Block.kind.ffn in
dense / moe). When both parts of a block get the same mode (full or selective) the whole Block is wrapped instead,
so the pre-norms are covered too (full: only the block input is kept). Wrapping replaces the module's `forward`
on the instance: parameter names, state dicts and module hooks are unchanged.

Forward state under recompute: MoE routers count routed tokens in forward (`Router.forward_counters`) and
modules record `last_*` values for logging; the recompute context restores both after the rerun, so counts are
exact (not doubled) and logged values are those of the original forward. Aux losses (attach_aux_loss) hold no
saved tensors: their gradients flow through the original graph, exactly as without recompute.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moestack.config.plan import RecomputePolicy
from moestack.model.wrappers import unwrap_forward, wrap_forward

# SAC numbers every op of a region and expects the recompute to issue the same ones. Profiler ranges do not: FSDP's
# hooks open more of them in a forward that gathers parameters than in its recompute, where they are gathered
# already (e.g. bf16 FSDP with the router's own fp32 group inside a selective MoE). They produce nothing to cache,
# so SAC skips them, as it skips detach.
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})

MODES = ("none", "selective", "full")
PART_OF_MIXER = {"kda": "kda", "mamba2": "kda", "mla": "attention", "gqa": "attention"}
PART_OF_FFN = {"moe": "moe", "dense": "mlp"}


def _packets(namespace: str, *names: str) -> set:
    """Op packets that exist in this torch build (optional kernels are skipped)."""
    ns = getattr(torch.ops, namespace)
    out = set()
    for name in names:
        try:
            out.add(getattr(ns, name))
        except (AttributeError, RuntimeError):
            continue
    return out


SAVE_OPS: set = (
    _packets(
        "aten",
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
        "topk", "sort",
    )
    | _packets("_c10d_functional", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_reduce")
)

# module class name -> names of child modules whose ops are always recomputed under "selective"
RECOMPUTE_SUBMODULES: dict[str, tuple[str, ...]] = {"GatedMLA": ("q_b_proj", "kv_b_proj")}


def register_save_op(op) -> None:
    """Keep the outputs of `op` (an OpOverload or OpOverloadPacket, e.g. a torch.library custom op) under
    "selective" recompute."""
    SAVE_OPS.add(getattr(op, "overloadpacket", op))


# ------------------------------------------------------------------------------------------------------------
# the selective policy


class _Scope(threading.local):
    depth = 0  # > 0 while a RECOMPUTE_SUBMODULES child runs (forward only: the policy is never asked in recompute)


_SCOPE = _Scope()


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """SAC policy: keep SAVE_OPS outputs, recompute the rest (and everything inside recompute-scoped modules)."""
    del ctx, args, kwargs
    if _SCOPE.depth == 0 and op.overloadpacket in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _enter_scope(module, args) -> None:
    _SCOPE.depth += 1


def _exit_scope(module, args, output) -> None:
    _SCOPE.depth -= 1


def _scope_recompute_submodules(root: nn.Module) -> None:
    """Register scope hooks on the RECOMPUTE_SUBMODULES children under `root` (once per child)."""
    for module in root.modules():
        for child_name in RECOMPUTE_SUBMODULES.get(type(module).__name__, ()):
            child = getattr(module, child_name, None)
            if child is None or getattr(child, "_moestack_recompute_scope", False):
                continue
            child.register_forward_pre_hook(_enter_scope)
            child.register_forward_hook(_exit_scope, always_call=True)
            child._moestack_recompute_scope = True


# ------------------------------------------------------------------------------------------------------------
# forward state that must not change when a forward is rerun


class _RestoreForwardState:
    """Snapshot routers' token counters and modules' `last_*` attributes; restore them on exit."""

    def __init__(self, root: nn.Module):
        self.root = root
        self.counts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.attrs: list[tuple[nn.Module, str, object]] = []

    def __enter__(self) -> _RestoreForwardState:
        for module in self.root.modules():
            for name in getattr(module, "forward_counters", ("tokens_per_expert",)):
                counter = getattr(module, name, None)
                if isinstance(counter, torch.Tensor):
                    self.counts.append((counter, counter.clone()))
            for name, value in vars(module).items():
                if name.startswith("last_"):
                    self.attrs.append((module, name, value))
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for counter, saved in self.counts:
                counter.copy_(saved)
        for module, name, value in self.attrs:
            setattr(module, name, value)


def _context_fn(root: nn.Module, mode: str) -> Callable[[], tuple]:
    """checkpoint's context_fn: (forward context, recompute context). The state guard is entered outside the SAC
    dispatch mode (its own clone/copy ops must not be cached or looked up)."""

    def make():
        if mode == "full":
            return contextlib.nullcontext(), _RestoreForwardState(root)
        caching, cached = create_selective_checkpoint_contexts(selective_policy)

        @contextlib.contextmanager
        def recompute_ctx():
            with _RestoreForwardState(root), cached:
                yield

        return caching, recompute_ctx()

    return make


# ------------------------------------------------------------------------------------------------------------
# wrapping


def checkpoint_module(module: nn.Module, mode: str) -> nn.Module:
    """Run `module.forward` under activation checkpointing ("full" or "selective"); "none" is a no-op.

    The instance's forward is replaced (names and hooks unchanged); `module._moestack_recompute` records the mode.
    Outside autograd (no_grad / inference) the original forward runs unchanged. Returns the module.
    """
    if mode not in MODES:
        raise ValueError(f"recompute mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return module
    if getattr(module, "_moestack_recompute", None) is not None:
        raise RuntimeError(f"{type(module).__name__} is already wrapped for recompute "
                           f"({module._moestack_recompute}); call remove_recompute first")
    if mode == "selective":
        _scope_recompute_submodules(module)
    context_fn = _context_fn(module, mode)

    def make(inner):
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        return forward

    wrap_forward(module, "recompute", make)
    module._moestack_recompute = mode
    return module


def remove_recompute(model: nn.Module) -> None:
    """Undo checkpoint_module on every submodule of `model` (scope hooks stay: harmless without SAC)."""
    for module in model.modules():
        if getattr(module, "_moestack_recompute", None) is not None:
            unwrap_forward(module, "recompute")  # the wrappers below it (tensor parallelism) stay
            module._moestack_recompute = None


def block_modes(block: nn.Module, policy: RecomputePolicy) -> tuple[str, str]:
    """(mixer mode, ffn mode) of a Block under `policy`."""
    mix = getattr(policy, PART_OF_MIXER[block.kind.mixer]) if block.kind.mixer in PART_OF_MIXER else "none"
    ffn = getattr(policy, PART_OF_FFN[block.kind.ffn]) if block.kind.ffn in PART_OF_FFN else "none"
    return mix, ffn


def apply_recompute(model: nn.Module, policy: RecomputePolicy) -> dict[str, str]:
    """Wrap every Block of `model` (a Transformer, or any module whose `layers` holds Blocks) per `policy`.

    Returns {module name: mode} of what was wrapped (e.g. {"layers.1": "full", "layers.2.ffn": "selective"}).
    """
    wrapped: dict[str, str] = {}
    for name, block in model.layers.items():
        mix, ffn = block_modes(block, policy)
        if mix == ffn and mix != "none":
            checkpoint_module(block, mix)
            wrapped[f"layers.{name}"] = mix
            continue
        for part, mode in (("attn", mix), ("ffn", ffn)):
            if mode != "none":
                checkpoint_module(getattr(block, part), mode)
                wrapped[f"layers.{name}.{part}"] = mode
    return wrapped
