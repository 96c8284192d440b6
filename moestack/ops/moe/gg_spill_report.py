"""Compile every autotune config of the TMA grouped GEMM kernels (gg_tma.py) for sm_90a without a GPU.

    python -m moestack.ops.moe.gg_spill_report [fwd wgrad]   # one '|' row per kernel x config: MMA, registers, smem

Same method as moestack.ops.moe.spill_report (Triton's own ptxas, specialised like a launch: unit strides
constant, pointers / strides / widths divisible by 16); descriptors typed with the block shapes the pre-hooks set.
Shared memory above 232448 B (227 KB) means the config cannot launch on an H200 (the autotuner skips it).
"""

import sys

from moestack.ops.moe import gg_tma
from moestack.ops.moe import spill_report as sr
from moestack.ops.moe.spill_report import I32, _cfgs, _scalars, compile_one

sr.DIV16_SCALARS = (*sr.DIV16_SCALARS, "A", "B")  # the wgrad's widths: divisible by 16 at every real shape


def main() -> None:
    only = set(sys.argv[1:]) or {"fwd", "wgrad"}
    scalars = {**_scalars(gg_tma.gg_fwd_kernel_tma), "BT_MAX": "i32"}
    for kw, nw, ns in _cfgs(gg_tma.gg_fwd_kernel_tma) if "fwd" in only else []:
        BT, BF, BK = kw["BT"], kw["BF"], kw["BK"]
        for kmajor in (True, False):  # forward (w^T view of [E, F, D]) and dX (w itself)
            w_block = [BF, BK] if kmajor else [BK, BF]
            ptrs = {"offs": I32, "x_desc": f"tensordesc<bf16[{BT}, {BK}]>", "w_desc": f"tensordesc<bf16{w_block}>"}
            compile_one(f"tma fwd {kw} kmajor={kmajor} s={ns}", gg_tma.gg_fwd_kernel_tma, ptrs,
                        {**kw, "BE": 64, "PRECISION": "tf32", "W_KMAJOR": kmajor, "stride_yf": 1}, scalars, nw, ns)
    scalars = {**_scalars(gg_tma.gg_wgrad_kernel_tma), "A": "i32", "B": "i32"}
    for kw, nw, ns in _cfgs(gg_tma.gg_wgrad_kernel_tma) if "wgrad" in only else []:
        for bt in (16, 32, 64):
            for store in (False, True):
                ptrs = {"offs": I32, "out_desc": f"tensordesc<bf16[1, {kw['BA']}, {kw['BB']}]>"}
                consts = {**kw, "BT": bt, "PRECISION": "tf32", "TMA_STORE": store, "stride_pa": 1, "stride_qb": 1,
                          "stride_ob": 1, **({} if store else {"out_desc": None})}
                compile_one(f"tma wgrad {kw} BT={bt} tma_store={store} s={ns}", gg_tma.gg_wgrad_kernel_tma, ptrs,
                            consts, scalars, nw, ns)


if __name__ == "__main__":
    main()
