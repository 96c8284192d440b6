"""FP8 weights quantised once per optimizer step and parameter version (the FP8 expert GEMMs' and Linears' cache).

Every micro-batch of one optimizer step multiplies by the same weights, so their 128x128 fp8 blocks and scales in
both layouts (quant.quantize_blocks_pair) are computed on the first call and reused until the weight changes. A
weight counts as changed (1) after every optimizer step: importing this module registers a global optimizer step
post-hook (torch.optim.optimizer.register_optimizer_step_post_hook, run by every torch.optim.Optimizer subclass)
that empties the cache, and (2) when its version counter moves (in-place ops on the parameter or a view of it
outside an optimizer: load_state_dict's copy_, p.add_ under no_grad). (1) is required: the fused AdamW the trainer
uses on CUDA (torch._fused_adamw_) does NOT bump the version counter (nor do p.data writes or FSDP's all-gather into
the unsharded parameter), so a version-keyed cache alone would keep the step-0 weights for the whole run. Entries
are keyed by the owning tensor (the parameter behind a view such as w.transpose(1, 2)), the view's pointer, shape,
strides and dtypes, so the forward layout and the transposed dX layout are two entries of one parameter.

Not seen: writes outside an optimizer step that bypass the version counter (`p.data.copy_(...)` or `p.data = ...`
by hand, a sharded parameter's update reaching its FSDP2 gather). Call clear() after such writes.
Mode (KernelSpec.fp8.weight_cache, passed per call by the FP8 strategies): "off" quantises on every call instead (a
check that the cache changes nothing).

Memory under FSDP2: an entry whose weight FSDP has freed (resharded: its storage resized to 0) is dropped at the next
miss, so the cache holds fp8 copies of only the weights gathered now (ZeRO-3: about one layer), not of every layer:
ZeRO-3's memory bound holds, at the price of quantising a weight again when it is gathered again (its backward, the
next micro-batch). Mode "step" keeps them until the optimizer step instead (one quantisation per weight
and step; the fp8 copies of every gathered layer stay, i.e. the size of the unsharded bf16 weights).
`stats["peak_bytes"]` is the most the cache held at once.
Tensors that do not outlive the call (fp32 parameters cast to bf16 under autocast make a new tensor each call)
miss every time: still correct, no gain. Inference tensors have no version counter and are never cached.

Memory: one fp8 copy per layout, i.e. the size of the bf16 weights for both layouts together. `pair` fills both
layouts from one read of the weight.

Under FSDP2 the unsharded parameter a forward sees is one tensor object for the whole run, refilled by every
all-gather into new storage without a version bump: the key is that object and the view's offset, shape and strides
(not its data pointer, which changes with every gather), so all micro-batches of a step and their backward use one
quantisation (tests/parallel/test_fp8_cache_fsdp.py: ZeRO-3, bitwise the same run with the cache on and off, one
quantisation per weight and step; with a pointer in the key it had hit 1-2 of 16 lookups: the K3 EP16 layer 49.5 vs
41.5 ms, benchmarks/RESULTS.md). Writes that reach the unsharded
parameter only through its shards (a checkpoint load, an HF import) must clear(): load_checkpoint and
load_hf_weights do.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from moestack.ops.fp8 import quant as fq
from moestack.ops.fp8.reference import FP8

_entries: dict[tuple, tuple[weakref.ref, int, torch.Tensor, torch.Tensor]] = {}
stats = {"hits": 0, "misses": 0, "peak_bytes": 0}
MODES = ("on", "step", "off")


def _owner(w: torch.Tensor) -> torch.Tensor:
    return w._base if w._base is not None else w


def _version(w: torch.Tensor, mode: str) -> int | None:
    """The key's version, None = do not cache (inference tensors; mode "off")."""
    if w.is_inference() or mode == "off":
        return None
    return w._version


def clear() -> None:
    """Drop every cached weight (after writes the version counter does not see)."""
    _entries.clear()


def _after_optimizer_step(*_) -> None:
    clear()


# every optimizer step may change the weights without bumping their version counter (fused AdamW): forget them
_step_hook = register_optimizer_step_post_hook(_after_optimizer_step)


def _stale(owner: torch.Tensor | None, keep_freed: bool) -> bool:
    # gone, or (unless kept) freed by FSDP2's reshard (its storage resized to 0; a new gather refills it)
    return owner is None or (not keep_freed and owner.numel() > 0 and owner.untyped_storage().size() == 0)


def _purge(mode: str) -> None:
    """Drop the entries of dead weights and (mode "on") of weights FSDP freed. O(entries), run on misses only."""
    keep_freed = mode == "step"
    for key in [k for k, v in _entries.items() if _stale(v[0](), keep_freed)]:
        del _entries[key]


def _note_peak() -> None:
    """stats["peak_bytes"] after a miss added its entries (misses only: O(entries), like _purge)."""
    held = sum(e[2].nbytes + e[3].nbytes for e in _entries.values())
    stats["peak_bytes"] = max(stats["peak_bytes"], held)


def _key(w: torch.Tensor, q_dtype: torch.dtype) -> tuple:
    # the owner and the view's place in it, not its data pointer: FSDP2 gathers the same unsharded parameter into new
    # storage for every forward and (ZeRO-3) backward, so a pointer in the key missed on nearly every call
    return (id(_owner(w)), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype, q_dtype, w.device)


def _lookup(w: torch.Tensor, q_dtype: torch.dtype, version: int):
    hit = _entries.get(_key(w, q_dtype))
    if hit is not None and hit[0]() is _owner(w) and hit[1] == version:
        return hit[2], hit[3]
    return None


def pair(w_EKF: torch.Tensor, q_dtype: torch.dtype = FP8, mode: str = "on"):
    """quant.quantize_blocks_pair(w) (both layouts from one read of w, both cached: the backward's lookup of w^T
    hits), from the cache while w's version is unchanged. mode: one of MODES (module doc)."""
    if mode not in MODES:
        raise ValueError(f"fp8 weight cache mode {mode!r}: use one of {MODES} (kernels.fp8.weight_cache)")
    version = _version(w_EKF, mode)
    if version is None:
        return fq.quantize_blocks_pair(w_EKF, q_dtype)
    wT = w_EKF.transpose(1, 2)
    fwd, bwd = _lookup(w_EKF, q_dtype, version), _lookup(wT, q_dtype, version)
    if fwd is not None and bwd is not None:
        stats["hits"] += 1
        return fwd, bwd
    stats["misses"] += 1
    _purge(mode)
    with torch.no_grad():
        fwd, bwd = fq.quantize_blocks_pair(w_EKF, q_dtype)
    ref = weakref.ref(_owner(w_EKF))
    _entries[_key(w_EKF, q_dtype)] = (ref, version, *fwd)
    _entries[_key(wT, q_dtype)] = (ref, version, *bwd)
    _note_peak()
    return fwd, bwd
