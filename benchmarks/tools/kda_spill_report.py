"""Compile the KDA kernels for sm_90 without a GPU and print registers, spills and shared memory per kernel.

    python benchmarks/tools/kda_spill_report.py [k1 k2 b2 b3a b3b] [--gate] [--k 128]

K1 and B3b are reported for both launches (SEL 1: the factorised chunks, exact path compiled out; SEL 2: the
exact-path chunks); K2 / B2 for every autotune config. K = V = 128 unless --k; bf16 intermediates.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from ptx import jit_fn, report  # noqa: E402

from moestack.ops.kda import triton_bwd as Bw  # noqa: E402
from moestack.ops.kda import triton_fwd as F  # noqa: E402

F32, I32 = "*fp32", "*i32"


def _sig(kern, ptrs: dict, scalars: dict) -> dict:
    """Every argument: a scalar type, a pointer type from ptrs, else a bf16 pointer (the intermediates)."""
    jf = jit_fn(kern)
    return {n: scalars.get(n) or ptrs.get(n, "*bf16") for n in jf.arg_names}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("only", nargs="*", default=["k1", "k2", "b2", "b3a", "b3b"])
    p.add_argument("--gate", action="store_true", help="K1 / B3b with the fused K3 gate, L2 norm and dt_bias")
    p.add_argument("--k", type=int, default=128, help="head dim (K = V)")
    a = p.parse_args()
    K = a.k
    BK = max(16, 1 << (K - 1).bit_length())
    common = {"K": K, "V": K, "BT": F.BT, "BK": BK}
    if "k1" in a.only:
        ptrs = {"g": F32, "beta": F32, "A_log": F32, "dt_bias": F32, "chunk_map": I32, "cu_seqlens": I32,
                "gl": F32, "gc": F32, "rq": F32, "rk": F32, "flag": I32, "xinv": F32}
        for sel in (1, 2):
            for store_x in (False, True):
                consts = {**common, "SUB": F.SUB, "BV": BK, "GATE": int(a.gate), "LOWER_BOUND": -5.0,
                          "HAS_DT_BIAS": a.gate, "L2NORM": a.gate, "L2_EPS": 1e-6, "BETA_SIGMOID": False,
                          "SPAN_MAX": F.SPAN_MAX, "BKS": F.K1_CONFIG["BKS"], "LOWP": sel != 2, "STORE_X": store_x,
                          "SEL": sel}
                report(f"K1 intra sel {sel} store_x {store_x}", F.kda_fwd_kernel_intra,
                       _sig(F.kda_fwd_kernel_intra, ptrs, {"scale": "fp32", "H": "i32"}), consts,
                       F.K1_CONFIG["num_warps"], 2)
    if "k2" in a.only:
        ptrs = {"gl": F32, "h0": F32, "chunk_offsets": I32, "cu_seqlens": I32, "ht": F32}
        for c in F.kda_fwd_kernel_recurrence.configs:
            report(f"K2 rec BV {c.kwargs['BV']}", F.kda_fwd_kernel_recurrence,
                   _sig(F.kda_fwd_kernel_recurrence, ptrs, {"H": "i32"}),
                   {**common, **c.kwargs, "HAS_H0": False, "STORE_HT": False, "STORE_H": False, "STORE_D": False,
                    "STORE_O": True}, c.num_warps, c.num_stages)
    if "b2" in a.only:
        ptrs = {"gl": F32, "dht": F32, "chunk_offsets": I32, "cu_seqlens": I32, "dh0": F32}
        for c in Bw.kda_bwd_kernel_recurrence.configs:
            report(f"B2 rec BV {c.kwargs['BV']}", Bw.kda_bwd_kernel_recurrence,
                   _sig(Bw.kda_bwd_kernel_recurrence, ptrs, {"H": "i32"}),
                   {**common, **c.kwargs, "HAS_DHT": False, "STORE_DH0": False}, c.num_warps, c.num_stages)
    if "b3a" in a.only:
        ptrs = {"beta": F32, "gc": F32, "rk": F32, "chunk_map": I32, "cu_seqlens": I32, "dbeta": F32, "p_dqp": F32,
                "p_dkd": F32, "p_dkp": F32, "p_da": F32, "p_dn": F32, "p_dbl": F32, "xinv": F32}
        cfg = dict(Bw.B3A_CONFIG)
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        report("B3a wy", Bw.kda_bwd_kernel_wy, _sig(Bw.kda_bwd_kernel_wy, ptrs, {"H": "i32"}),
               {**common, **cfg, "BETA_SIGMOID": False}, nw, ns)
    if "b3b" in a.only:
        ptrs = {"g": F32, "A_log": F32, "dt_bias": F32, "gc": F32, "rq": F32, "rk": F32, "flag": I32,
                "chunk_map": I32, "cu_seqlens": I32, "p_dqp": F32, "p_dkd": F32, "p_dkp": F32, "p_da": F32,
                "p_dn": F32, "p_dbl": F32, "dg": F32, "pd_dt": F32, "pd_alog": F32}
        cfg = dict(Bw.B3B_CONFIG)
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        for sel in (1, 2):
            report(f"B3b scores sel {sel}", Bw.kda_bwd_kernel_scores,
                   _sig(Bw.kda_bwd_kernel_scores, ptrs, {"scale": "fp32", "H": "i32"}),
                   {"K": K, "BT": F.BT, "SUB": F.SUB, **cfg, "GATE": int(a.gate), "LOWER_BOUND": -5.0,
                    "HAS_DT_BIAS": a.gate, "L2NORM": a.gate, "SEL": sel}, nw, ns)


if __name__ == "__main__":
    main()
