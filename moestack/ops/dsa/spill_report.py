"""Compile the DSA backward kernels for sm_90 without a GPU; print ptxas's registers / spills and shared memory.

    python -m moestack.ops.dsa.spill_report [dkv dq kmajor fused]    # every config of each, MLA dims (512 + 64)

Catches compile errors before a GPU run and shows register pressure per autotune config. MOESTACK_DSA_TTGIR=dir
also writes each kernel's TTGIR there (to check the MMA layouts: warpsPerCTA of the score tiles). The PTX goes
through the ptxas bundled with Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moestack.ops.dsa import triton_attn_bwd as bwd

TMP = tempfile.mkdtemp(prefix="dsa_ptx_")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
DIMS = {"V": 512, "R": 64, "VP": 512, "RP": 64}
PTRS = {"IDX": "*i32", "LSE": "*fp32", "DELTA": "*fp32", "DKV": "*fp32", "BUF": "*fp32"}
SCALARS = {"scale": "fp32", "scale_log2": "fp32", **dict.fromkeys(("n0", "n", "T", "H", "K", "HP"), "i32")}


def compile_one(label: str, kern, consts: dict, num_warps: int, num_stages: int, maxnreg=None) -> None:
    """Compile one config to PTX, assemble with ptxas -v, print one '|' row."""
    jf = kern.fn if hasattr(kern, "fn") else kern  # under @triton.autotune
    sig = {n: "constexpr" if n in consts else SCALARS.get(n) or PTRS.get(n) or ("i32" if n.startswith("s_") else "*bf16")
           for n in jf.arg_names}  # fmt: skip
    # as the JIT specialises them at MLA sizes: pointers and strides (576, H * 576, 2048, ...) divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jf.arg_names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("s_") or n == "HP")}  # fmt: skip
    src = ASTSource(fn=jf, signature=sig, constexprs={(jf.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)  # fmt: skip
    try:
        opts = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
        ck = triton.compile(src, target=TARGET, options=opts)
    except Exception as e:  # noqa: BLE001 - report, go on with the other configs
        print(f"| {label} | COMPILE ERROR {type(e).__name__}: {str(e)[:400]}")
        return
    ttgir_dir = os.environ.get("MOESTACK_DSA_TTGIR")
    if ttgir_dir:
        os.makedirs(ttgir_dir, exist_ok=True)
        with open(os.path.join(ttgir_dir, label.replace(" ", "_") + ".ttgir"), "w") as f:
            f.write(ck.asm["ttgir"])
    ptx = os.path.join(TMP, "k.ptx")
    with open(ptx, "w") as f:
        f.write(ck.asm["ptx"])
    r = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(TMP, "k.cubin")],
                       capture_output=True, text=True, check=False)  # fmt: skip
    info = " ".join(line.split("info    : ")[-1].strip() for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line)  # fmt: skip
    wgmma = "wgmma" if "wgmma" in ck.asm["ptx"] else "mma.sync"
    cap = f" maxnreg {maxnreg}" if maxnreg else ""
    print(f"| {label} w{num_warps} s{num_stages}{cap} | {info} | smem {ck.metadata.shared / 1024:.0f} KB | {wgmma} |")


def _each(label, kern, configs, extra):
    for c in configs:
        cfg = " ".join(f"{k}={v}" for k, v in c.kwargs.items())
        compile_one(f"{label} {cfg}", kern, {**DIMS, **extra, **c.kwargs}, c.num_warps, c.num_stages, c.maxnreg)


def main() -> None:
    only = sys.argv[1:] or ["dkv", "dq"]
    if "dkv" in only:
        kern, cfgs = bwd._sparse_mqa_bwd_kernel_dkv, bwd._dkv_ds_configs()
        _each("dkv_ds atomic", kern, cfgs, {"DKV_OUT": "atomic", "TOKEN_TILE": 0})
        _each("dkv_ds atomic tile64", kern, cfgs[:1], {"DKV_OUT": "atomic", "TOKEN_TILE": 64})
        _each("dkv_ds rows", kern, cfgs[:1], {"DKV_OUT": "rows", "TOKEN_TILE": 0})
    if "dq" in only:
        _each("dq_ds", bwd._sparse_mqa_bwd_kernel_dq, bwd._bwd_configs(bwd._DQ_DS_SHAPES), {})
    if "kmajor" in only:
        _each("kmajor", bwd._sparse_mqa_dkv_kmajor_kernel, bwd._kmajor_configs(), {})
    if "fused" in only:
        _each("fused atomic", bwd._sparse_mqa_bwd_kernel, bwd._bwd_configs(bwd._BWD_SHAPES), {"ATOMIC": True})


if __name__ == "__main__":
    main()
