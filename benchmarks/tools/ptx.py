"""Compile a Triton kernel for sm_90 without a GPU: ptxas's registers / spills and the kernel's shared memory.

Used by the per-op reports in this folder (kda_spill_report.py, dsa_spill_report.py, launch_fit_check.py). The PTX
goes to a temporary folder and through the ptxas bundled with Triton.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TMP = tempfile.mkdtemp(prefix="moestack_ptx_")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200


def jit_fn(kern):
    """The JITFunction under @autotune / @heuristics (or the kernel itself)."""
    while not isinstance(kern, triton.runtime.JITFunction):
        kern = kern.fn
    return kern


def compile_sm90(kern, signature: dict, consts: dict, num_warps: int, num_stages: int, maxnreg: int | None = None,
                 divisible: tuple[str, ...] = ()):
    """The compiled kernel (triton.compile) of `kern` (a JITFunction, or an autotuner over one); `signature` maps
    every non-constexpr argument to its Triton type, `divisible` names arguments specialised as multiples of 16."""
    jf = jit_fn(kern)
    sig = {n: "constexpr" if n in consts else signature[n] for n in jf.arg_names}
    attrs = {(jf.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in sig}
    src = ASTSource(fn=jf, signature=sig, constexprs={(jf.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=TARGET, options=options)


def ptxas_info(ck) -> str:
    """ptxas -v's register and spill lines for a compiled kernel."""
    ptx = os.path.join(TMP, "k.ptx")
    with open(ptx, "w") as f:
        f.write(ck.asm["ptx"])
    r = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(TMP, "k.cubin")],
                       capture_output=True, text=True, check=False)
    return " ".join(line.split("info    : ")[-1].strip() for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line)


def report(label: str, kern, signature: dict, consts: dict, num_warps: int, num_stages: int,
           maxnreg: int | None = None, divisible: tuple[str, ...] = ()) -> int | None:
    """Compile, print one '|' row (registers, spills, shared memory, MMA kind); returns the shared bytes."""
    try:
        ck = compile_sm90(kern, signature, consts, num_warps, num_stages, maxnreg, divisible)
    except Exception as e:  # noqa: BLE001 - report, go on with the other configs
        print(f"| {label} | COMPILE ERROR {type(e).__name__}: {str(e)[:300]} | | |", flush=True)
        return None
    mma = "wgmma" if "wgmma" in ck.asm["ptx"] else "mma.sync"
    cap = f" maxnreg {maxnreg}" if maxnreg else ""
    print(f"| {label} w{num_warps} s{num_stages}{cap} | {ptxas_info(ck)} | smem {ck.metadata.shared} | {mma} |",
          flush=True)
    return ck.metadata.shared
