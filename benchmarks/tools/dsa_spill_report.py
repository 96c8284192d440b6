"""Compile the DSA Triton kernels for sm_90 without a GPU: registers, spills, shared memory, MMA kind per config.

    python benchmarks/tools/dsa_spill_report.py [fwd dkv dq idx] [--v 512 --r 64 --dtype bf16]

Every autotune config of the sparse attention forward, the backward's two passes (pass 1 in both dKV forms) and the
indexer's scoring kernel (both modes), at MLA's latent (512 + 64) unless --v / --r. Used to check, before a GPU
run, that a config compiles, does not spill and fits in shared memory. (The Gluon kernels set their own layouts.)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from ptx import jit_fn, report  # noqa: E402

from moestack.ops.dsa import triton_attn_bwd as B  # noqa: E402
from moestack.ops.dsa import triton_attn_fwd as F  # noqa: E402
from moestack.ops.dsa import triton_indexer_fused as X  # noqa: E402


def _sig(kern, dt: str, ptrs: dict, scalars: tuple[str, ...]) -> dict:
    """Scalars by name (strides, sizes: i32; scales: fp32), listed pointers, the rest `dt` pointers."""
    sig = {}
    for n in jit_fn(kern).arg_names:
        if n in ptrs:
            sig[n] = ptrs[n]
        elif n.startswith("s_") or n in scalars:
            sig[n] = "fp32" if "scale" in n else "i32"
        else:
            sig[n] = dt
    return sig


def _strides(kern) -> tuple[str, ...]:
    return tuple(n for n in jit_fn(kern).arg_names if n.startswith("s_"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("only", nargs="*", default=["fwd", "dkv", "dq", "idx"])
    p.add_argument("--v", type=int, default=512)
    p.add_argument("--r", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    a = p.parse_args()
    dt = "*" + a.dtype
    VP, RP = F.padded_dims(a.v, a.r)
    dims = {"V": a.v, "R": a.r, "VP": VP, "RP": RP}
    sizes = ("T", "H", "K", "n0", "n", "HP", "t0", "t1", "Hi", "n_cols", "scale", "scale_log2")
    if "fwd" in a.only:
        k = F._sparse_mqa_fwd_kernel
        for c in F.fwd_configs():
            report(f"fwd {c.kwargs}", k, _sig(k, dt, {"IDX": "*i32", "LSE": "*fp32"}, sizes),
                   {**dims, **c.kwargs}, c.num_warps, c.num_stages, divisible=_strides(k))
    if "dkv" in a.only:
        k = B._sparse_mqa_bwd_kernel_dkv
        ptrs = {"IDX": "*i32", "LSE": "*fp32", "DELTA": "*fp32", "DKV": "*fp32"}
        for out in ("atomic", "rows"):
            for c in B._dkv_ds_configs():
                report(f"dkv_ds {out} {c.kwargs}", k, _sig(k, dt, ptrs, sizes),
                       {**dims, **c.kwargs, "DKV_OUT": out, "TOKEN_TILE": B.TOKEN_TILE}, c.num_warps, c.num_stages,
                       c.maxnreg, divisible=(*_strides(k), "HP"))
    if "dq" in a.only:
        k = B._sparse_mqa_bwd_kernel_dq
        for c in B._bwd_configs(B._DQ_DS_SHAPES):
            report(f"dq_ds {c.kwargs}", k, _sig(k, dt, {"IDX": "*i32"}, sizes), {**dims, **c.kwargs},
                   c.num_warps, c.num_stages, divisible=(*_strides(k), "HP"))
    if "idx" in a.only:
        k = X.indexer_select_kernel
        ptrs = {"W": "*fp32", "DSTART": "*i32", "THR": "*fp32", "CNT": "*i32", "OUT_S": "*fp32", "OUT_I": "*i32"}
        for mode in (X.MODE_SELECT, X.MODE_DENSE):
            for c in X._configs():
                report(f"indexer mode {mode} {c.kwargs}", k, _sig(k, dt, ptrs, sizes),
                       {"Di": 128, "DP": 128, "KEY_STRIDE": 1 if mode else 16, "MODE": mode, "CAP": 4096,
                        "HAS_DOC": False, **c.kwargs}, c.num_warps, c.num_stages, divisible=_strides(k))


if __name__ == "__main__":
    main()
