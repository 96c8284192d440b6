"""Compile every autotune config of the MoE grouped GEMM kernels for sm_90 without a GPU; print ptxas's report.

    python -m moestack.ops.moe.spill_report            # one '|' row per kernel x config: registers, spills, smem
    python -m moestack.ops.moe.spill_report swap fp8   # only kernels whose group is named (fwd swap wgrad fp8)

Catches compile errors and spills before a GPU run (Triton's own ptxas, target sm_90a, as
moestack.ops.kda.spill_report). Specialised like a real launch: unit strides as constants, pointers, strides and
the GEMM widths K, F, D, P marked divisible by 16 (without those hints loads do not vectorise and the report
shows spills a real launch does not have); N, E and ROWS_BUCKET are not specialised by the kernels.
"""
import os
import subprocess
import sys

import triton
from triton.compiler import ASTSource

from moestack.ops.kda.spill_report import PTXAS, TARGET, TMP
from moestack.ops.moe import fp8_grouped_gemm as f8
from moestack.ops.moe import triton_grouped_gemm as tg

I32, F8 = "*i32", "*fp8e4nv"
SCALARS = {n: "i32" for n in ("N", "K", "F", "E", "D", "P", "ROWS_BUCKET")}


def _jit(kern):
    """The JITFunction under @autotune / @heuristics, with every stride typed i32."""
    while not isinstance(kern, triton.runtime.JITFunction):
        kern = kern.fn
    return kern


def _scalars(kern) -> dict:
    return {**SCALARS, **{n: "i32" for n in _jit(kern).arg_names if n.startswith("stride")}}


DIV16_SCALARS = ("K", "F", "D", "P")


def compile_one(label, kern, ptr_types, consts, scalars, num_warps, num_stages) -> None:
    jf = _jit(kern)
    sig = {n: "constexpr" if n in consts else scalars.get(n) or ptr_types.get(n, "*bf16") for n in jf.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jf.arg_names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("stride") or n in DIV16_SCALARS)}
    src = ASTSource(fn=jf, signature=sig, constexprs=consts, attrs=attrs)
    try:
        ck = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:  # report, go on with the other kernels
        print(f"| {label} | COMPILE ERROR {type(e).__name__}: {str(e)[:300]}")
        return
    ptx = ck.asm["ptx"]
    with open(os.path.join(TMP, "k.ptx"), "w") as f:
        f.write(ptx)
    cmd = [PTXAS, "-v", "--gpu-name=sm_90a", os.path.join(TMP, "k.ptx"), "-o", os.path.join(TMP, "k.cubin")]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    info = " ".join(line.split("info    :")[-1].strip() for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line)
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no-mma"
    print(f"| {label} w={num_warps} | {mma} | {info} | shared={ck.metadata.shared}", flush=True)


def _cfgs(kern):
    return [(c.kwargs, c.num_warps, c.num_stages) for c in kern.configs]


def main() -> None:
    only = set(sys.argv[1:]) or {"fwd", "swap", "wgrad", "fp8"}
    for kw, nw, ns in _cfgs(tg.grouped_mm_fwd_kernel) if "fwd" in only else []:
        for unit in ("stride_wk", "stride_wf"):  # forward (w^T view of [E, F, D]) and dX (w itself)
            kern = tg.grouped_mm_fwd_kernel
            compile_one(f"bf16 fwd {kw} unit {unit} s={ns}", kern, {"offs": I32},
                        {**kw, "BE": 64, "PRECISION": "tf32", "stride_xk": 1, unit: 1, "stride_yf": 1},
                        _scalars(kern), nw, ns)
    for kw, nw, ns in _cfgs(tg.grouped_mm_fwd_swap_kernel) if "swap" in only else []:
        for bt in (16, 32, 64, 128):
            for unit in ("stride_wk", "stride_wf"):
                kern = tg.grouped_mm_fwd_swap_kernel
                compile_one(f"bf16 swap BT={bt} {kw} unit {unit} s={ns}", _jit(kern),
                            {"offs": I32}, {**kw, "BT": bt, "EVEN_K": True, "BE": 64, "PRECISION": "tf32",
                                            "stride_xk": 1, unit: 1, "stride_yf": 1}, _scalars(kern), nw, ns)
    wgrads = ((tg.grouped_mm_wgrad_kernel, (None,)), (tg.grouped_mm_wgrad_small_kernel, (16, 32, 64, 128)))
    for kern, bms in wgrads if "wgrad" in only else []:
        for kw, nw, ns in _cfgs(kern):
            for bm in bms:
                extra = {} if bm is None else {"BM": bm}
                compile_one(f"bf16 wgrad {kw} {extra} s={ns}", kern, {"offs": I32},
                            {**kw, **extra, "PRECISION": "tf32", "stride_xd": 1, "stride_dyf": 1, "stride_wd": 1},
                            _scalars(kern), nw, ns)
    for kw, nw, ns in _cfgs(f8.fp8_grouped_mm_fwd_kernel) if "fp8" in only else []:
        for tile_sw in (False, True):
            kern = f8.fp8_grouped_mm_fwd_kernel
            compile_one(f"fp8 fwd {kw} TILE_SW={tile_sw} s={ns}", kern,
                        {"qx": F8, "qw": F8, "sx": "*fp32", "sw": "*fp32", "offs": I32},
                        {**kw, "BE": 64, "PRECISION": "tf32", "BK": 128, "TILE_SW": tile_sw, "stride_wk": 1},
                        _scalars(kern), nw, ns)

    for kw, nw, ns in _cfgs(f8.fp8_grouped_mm_fwd_swap_kernel) if "fp8" in only else []:
        for bt in (16, 32, 64):
            kern = f8.fp8_grouped_mm_fwd_swap_kernel
            compile_one(f"fp8 swap BT={bt} {kw} s={ns}", kern,
                        {"qx": F8, "qw": F8, "sx": "*fp32", "sw": "*fp32", "offs": I32},
                        {**kw, "BT": bt, "BE": 64, "PRECISION": "tf32", "BK": 128}, _scalars(kern), nw, ns)


if __name__ == "__main__":
    main()
