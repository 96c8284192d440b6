"""Compile the KDA kernels for sm_90 without a GPU and print ptxas's register / spill report per kernel.

    python -m moestack.ops.kda.spill_report [k1 k2 b2 b3a b3b]

Env picks the variant: BKS, BKW (K1's W / U block), BV, BKC, NW, GATE, LOWP, XSAVED (K1 STORE_X / B3a LOAD_X),
NARROW (B3b), SEL (K1, B3b: 1 = the launch without the exact path, 2 = the exact-path launch), MAXNREG (a register
cap), JOIN (K1's / B3b's stacked score dots; with SEL=1).

Catches compile errors before a GPU run and shows register pressure (spills cost more than re-reading a tile from
L1/L2 here). K = V = 128, bf16 intermediates. The PTX goes to a temporary folder and through the ptxas bundled
with Triton.
"""
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moestack.ops.kda import triton_bwd as Bw
from moestack.ops.kda import triton_fwd as F

TMP = tempfile.mkdtemp(prefix="kda_ptx_")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200


def _signature(jf, ptr_types: dict, consts: dict, scalars: dict) -> dict:
    """Triton signature: constexprs, scalar types, pointer types (default bf16: the intermediates' dtype)."""
    return {n: "constexpr" if n in consts else scalars.get(n) or ptr_types.get(n, "*bf16") for n in jf.arg_names}


def compile_one(label, kern, ptr_types, consts, scalars, num_warps, num_stages=2) -> None:
    """Compile one kernel variant to PTX, assemble it with ptxas -v, print one '|' row."""
    jf = kern.fn if hasattr(kern, "fn") else kern  # under @triton.autotune
    src = ASTSource(fn=jf, signature=_signature(jf, ptr_types, consts, scalars),
                    constexprs={(jf.arg_names.index(k),): v for k, v in consts.items()})
    try:
        options = {"num_warps": num_warps, "num_stages": num_stages}
        if os.environ.get("MAXNREG"):  # a register cap, as the "size:warps:maxnreg" launch switches set
            options["maxnreg"] = int(os.environ["MAXNREG"])
        ck = triton.compile(src, target=TARGET, options=options)
    except Exception as e:  # report, go on with the other kernels
        print(f"| {label} | COMPILE ERROR {type(e).__name__}: {str(e)[:600]}")
        return
    with open(os.path.join(TMP, "k.ptx"), "w") as f:
        f.write(ck.asm["ptx"])
    cmd = [PTXAS, "-v", "--gpu-name=sm_90a", os.path.join(TMP, "k.ptx"), "-o", os.path.join(TMP, "k.cubin")]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    info = " ".join(line.strip() for line in r.stderr.splitlines() if "registers" in line or "spill" in line)
    print(f"| {label} w={num_warps} | {info} | shared={ck.metadata.shared}")


F32, I32 = "*fp32", "*i32"
COMMON = {"K": 128, "V": 128, "BT": 64, "SUB": 16, "BK": 128}


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def main() -> None:
    only = sys.argv[1:] or ["k1", "k2", "b2", "b3a", "b3b"]
    fused = bool(os.environ.get("GATE"))  # GATE=1: the fused K3 gate, L2 norm and dt_bias variant of K1
    nw, bv = _env("NW", 8), _env("BV", 32)
    if "k1" in only:
        for warps in (nw,) if "NW" in os.environ else (8, 16):
            compile_one(
                "K1 intra", F.kda_fwd_kernel_intra,
                {"g": F32, "beta": F32, "A_log": F32, "dt_bias": F32, "chunk_map": I32, "cu_seqlens": I32,
                 "gl": F32, "gc": F32, "rq": F32, "rk": F32, "flag": I32, "xinv": F32},
                {**COMMON, "BV": 128, "GATE": _env("GATE", 0), "LOWER_BOUND": -5.0, "HAS_DT_BIAS": fused,
                 "L2NORM": fused, "L2_EPS": 1e-6, "BETA_SIGMOID": False, "SPAN_MAX": 80.0, "BKS": _env("BKS", 32),
                 "LOWP": bool(_env("LOWP", 0)), "STORE_X": bool(_env("XSAVED", 0)), "SEL": _env("SEL", 0),
                 "BKW": _env("BKW", 0), "JOIN": bool(_env("JOIN", 0))},
                {"scale": "fp32", "H": "i32"}, warps)
    rec = {"K": 128, "V": 128, "BT": 64, "BK": 128, "BV": bv}
    if "k2" in only:
        compile_one("K2 rec", F.kda_fwd_kernel_recurrence,
                    {"gl": F32, "h0": F32, "chunk_offsets": I32, "cu_seqlens": I32, "ht": F32},
                    {**rec, "HAS_H0": False, "STORE_HT": False, "STORE_H": False, "STORE_D": False, "STORE_O": True},
                    {"H": "i32"}, nw)
    if "b2" in only:
        compile_one("B2 rec", Bw.kda_bwd_kernel_recurrence,
                    {"gl": F32, "dht": F32, "chunk_offsets": I32, "cu_seqlens": I32, "dh0": F32},
                    {**rec, "HAS_DHT": False, "STORE_DH0": False}, {"H": "i32"}, nw)
    if "b3a" in only:
        compile_one("B3a wy", Bw.kda_bwd_kernel_wy,
                    {"beta": F32, "gc": F32, "rk": F32, "flag": I32, "chunk_map": I32, "cu_seqlens": I32,
                     "dbeta": F32, "p_dqp": F32, "p_dkd": F32, "p_dkp": F32, "p_da": F32, "p_dn": F32, "p_dbl": F32,
                     "xinv": F32},
                    {**COMMON, "BV": bv, "BKS": _env("BKS", 32), "BETA_SIGMOID": False,
                     "LOAD_X": bool(_env("XSAVED", 0)), "LOWP": bool(_env("LOWP", 0))}, {"H": "i32"}, nw, 1)
    if "b3b" in only:
        compile_one("B3b scores", Bw.kda_bwd_kernel_scores,
                    {"g": F32, "A_log": F32, "dt_bias": F32, "gc": F32, "rq": F32, "rk": F32, "flag": I32,
                     "chunk_map": I32, "cu_seqlens": I32, "p_dqp": F32, "p_dkd": F32, "p_dkp": F32, "p_da": F32,
                     "p_dn": F32, "p_dbl": F32, "dg": F32, "pd_dt": F32, "pd_alog": F32},
                    {"K": 128, "BT": 64, "SUB": 16, "BKC": _env("BKC", 32), "GATE": 0, "LOWER_BOUND": -5.0,
                     "HAS_DT_BIAS": False, "L2NORM": False, "LOWP": bool(_env("LOWP", 0)),
                     "NARROW": bool(_env("NARROW", 0)), "SEL": _env("SEL", 0), "JOIN": bool(_env("JOIN", 0))},
                    {"scale": "fp32", "H": "i32"}, nw, 1)


if __name__ == "__main__":
    main()
