"""FP8 expert weights quantised once per parameter version (the "fp8" backend's v2, MOESTACK_FP8_V2=1).

Every micro-batch of one optimizer step multiplies by the same weights, so their 128x128 fp8 blocks and scales
(fp8_quant.quantize_blocks) are computed on the first call and reused until the weight changes. A weight counts
as changed when its version counter moves: every in-place op on the parameter or a view of it bumps that counter
(optimizer.step, load_state_dict's copy_, p.add_ under no_grad). Entries are keyed by the owning tensor (the
parameter behind a view such as w.transpose(1, 2)), the view's pointer, shape, strides and dtypes, so the forward
layout and the transposed dX layout are two entries of one parameter.

Not seen: writes that bypass the version counter (`p.data.copy_(...)`, collectives writing into a buffer the
parameter views, e.g. an FSDP all-gather into the same storage). Call clear() after such writes, or
clear_after_steps(optimizer) once: the cache is then also emptied after every optimizer step, which is safe
whatever writes the parameters (unverified with FSDP2 on a GPU: use clear_after_steps there).
`MOESTACK_FP8_CACHE=0` quantises on every call instead (a check that the cache changes nothing).
Tensors that do not outlive the call (fp32 parameters cast to bf16 under autocast make a new tensor each call)
miss every time: still correct, no gain. Inference tensors have no version counter and are never cached.

Memory: one fp8 copy per layout, i.e. the size of the bf16 weights for both layouts together. `pair` (v3) fills
both layouts from one read of the weight.
"""

from __future__ import annotations

import os
import weakref

import torch

from moestack.ops.moe import fp8_quant as fq

_entries: dict[tuple, tuple[weakref.ref, int, torch.Tensor, torch.Tensor]] = {}
stats = {"hits": 0, "misses": 0}


def _owner(w: torch.Tensor) -> torch.Tensor:
    return w._base if w._base is not None else w


def _version(w: torch.Tensor) -> int | None:
    """The key's version, None = do not cache (inference tensors; MOESTACK_FP8_CACHE=0 turns the cache off)."""
    if w.is_inference() or os.environ.get("MOESTACK_FP8_CACHE", "1") == "0":
        return None
    return w._version


def clear() -> None:
    """Drop every cached weight (after writes the version counter does not see)."""
    _entries.clear()


def clear_after_steps(optimizer: torch.optim.Optimizer):
    """Empty the cache after every optimizer.step() (the weights change only there); returns the hook handle."""
    return optimizer.register_step_post_hook(lambda *_: clear())


def _purge_dead() -> None:
    for key in [k for k, v in _entries.items() if v[0]() is None]:
        del _entries[key]


def _key(w: torch.Tensor, q_dtype: torch.dtype) -> tuple:
    return (id(_owner(w)), w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, q_dtype, w.device)


def _lookup(w: torch.Tensor, q_dtype: torch.dtype, version: int):
    hit = _entries.get(_key(w, q_dtype))
    if hit is not None and hit[0]() is _owner(w) and hit[1] == version:
        return hit[2], hit[3]
    return None


def blocks(w_EKF: torch.Tensor, q_dtype: torch.dtype = fq.FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """fq.quantize_blocks(w_EKF, q_dtype), from the cache while w's version is unchanged."""
    version = _version(w_EKF)
    if version is None:
        return fq.quantize_blocks(w_EKF, q_dtype)
    hit = _lookup(w_EKF, q_dtype, version)
    if hit is not None:
        stats["hits"] += 1
        return hit
    stats["misses"] += 1
    _purge_dead()
    with torch.no_grad():
        q, s = fq.quantize_blocks(w_EKF, q_dtype)
    _entries[_key(w_EKF, q_dtype)] = (weakref.ref(_owner(w_EKF)), version, q, s)
    return q, s


def pair(w_EKF: torch.Tensor, q_dtype: torch.dtype = fq.FP8):
    """(blocks(w), blocks(w^T)) as fq.quantize_blocks_pair: on a miss both layouts come from one read of w and
    both are cached (the backward's blocks(w.transpose(1, 2)) then hits)."""
    version = _version(w_EKF)
    if version is None:
        return fq.quantize_blocks_pair(w_EKF, q_dtype)
    wT = w_EKF.transpose(1, 2)
    fwd, bwd = _lookup(w_EKF, q_dtype, version), _lookup(wT, q_dtype, version)
    if fwd is not None and bwd is not None:
        stats["hits"] += 1
        return fwd, bwd
    stats["misses"] += 1
    _purge_dead()
    with torch.no_grad():
        fwd, bwd = fq.quantize_blocks_pair(w_EKF, q_dtype)
    ref = weakref.ref(_owner(w_EKF))
    _entries[_key(w_EKF, q_dtype)] = (ref, version, *fwd)
    _entries[_key(wT, q_dtype)] = (ref, version, *bwd)
    return fwd, bwd
