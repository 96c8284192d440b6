"""Compile the DSA forward / indexer kernel variants for sm_90 without a GPU; print ptxas's register / spill report,
shared memory and the warp layout of every wgmma (warpsPerCTA) per kernel config.

    python -m moestack.ops.dsa.sm90_report [fwd] [idx_fused]     # DUMP=dir also writes the TTGIR

Used to check, before a GPU run, that a variant compiles, does not spill, fits in shared memory and how Triton lays
the score tile over the warpgroups (warpsPerCTA). (The Gluon kernels set their layouts themselves.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TMP = tempfile.mkdtemp(prefix="dsa_ptx_")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200


def compile_one(label, kern, ptr_types, consts, scalars, num_warps, num_stages) -> None:
    jf = kern.fn if isinstance(kern, triton.runtime.Autotuner) else kern  # under @triton.autotune
    sig = {n: "constexpr" if n in consts else scalars.get(n) or ptr_types.get(n, "*bf16") for n in jf.arg_names}
    src = ASTSource(fn=jf, signature=sig, constexprs={(jf.arg_names.index(k),): v for k, v in consts.items()})
    try:
        ck = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"| {label} | COMPILE ERROR {type(e).__name__}: {str(e)[:800]}")
        return
    ttgir = ck.asm["ttgir"]
    if os.environ.get("DUMP"):
        os.makedirs(os.environ["DUMP"], exist_ok=True)
        with open(os.path.join(os.environ["DUMP"], re.sub(r"\W+", "_", label) + ".ttgir"), "w") as f:
            f.write(ttgir)
    with open(os.path.join(TMP, "k.ptx"), "w") as f:
        f.write(ck.asm["ptx"])
    cmd = [PTXAS, "-v", "--gpu-name=sm_90a", os.path.join(TMP, "k.ptx"), "-o", os.path.join(TMP, "k.cubin")]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    info = " ".join(line.strip() for line in r.stderr.splitlines() if "registers" in line or "spill" in line)
    mma = sorted(
        set(
            re.findall(
                r"#mma\d* = #ttg.nvidia_mma<\{versionMajor = (\d+).*?warpsPerCTA = \[(\d+), (\d+)\].*?instrShape = \[([\d, ]+)\]",
                ttgir,
            )
        )
    )
    wgmma = len(re.findall(r"ttng.warp_group_dot ", ttgir))
    print(f"| {label} w{num_warps} s{num_stages} | {info} | shared {ck.metadata.shared} | mma {mma} | dots {wgmma}")


def fwd() -> None:
    from moestack.ops.dsa import triton_attn_fwd as F

    scal = {"T": "i32", "H": "i32", "K": "i32", "scale_log2": "fp32"}
    for n in ("s_qb", "s_qt", "s_qh", "s_kb", "s_ks", "s_ib", "s_it", "s_ob", "s_ot", "s_oh"):
        scal[n] = "i32"
    ptr = {"IDX": "*i32", "LSE": "*fp32"}
    base = {"V": 512, "R": 64, "VP": 512, "RP": 64}
    for bh, bk, bv, w, s in [(64, 64, 512, 8, 2), (64, 32, 512, 8, 3)]:
        compile_one(f"fwd default H{bh} K{bk} V{bv}", F._sparse_mqa_fwd_kernel, ptr,
                    {**base, "BLOCK_H": bh, "BLOCK_K": bk, "BLOCK_V": bv}, scal, w, s)  # fmt: skip


def main() -> None:
    only = sys.argv[1:] or ["fwd"]
    if "fwd" in only:
        fwd()
    if "idx_fused" in only:
        from moestack.ops.dsa import triton_indexer_fused as X

        X.sm90_report(compile_one)


if __name__ == "__main__":
    main()
