"""KDA bf16 precision against the fp64 reference, ours (one switch set per process) next to fla-core.

    python3 benchmarks/kda_precision.py --all [--with-fla]  # every set in SETS (+ fla), one process each
    MOESTACK_KDA_BWD_DOTS=tf32 python3 benchmarks/kda_precision.py [--fla]

Why: with bf16 dot operands the gate gradient dg of some GPU test cases reached 1.1-1.5e-2 relative RMS (bound
1e-2) while o, dq, dk, dv stayed at ~4e-3. This prints, per case, the relative RMS of o and every gradient for
ours and for fla's chunk_kda on the same bf16 inputs (the anchor: what a well-kept bf16 implementation reaches).
Inputs as the GPU tests' cases (tests/ops/test_kda_triton.py GPU_CASES and the correlated-keys case), fed in the
gate="none" form both implementations share: q, k un-normalised (L2 norm in kernel), g = the K3 log-decay
(computed in fp32 from the gate input, then bf16), beta after the sigmoid; one document, initial state zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "ops"))

SETS = ["", "MOESTACK_KDA_BWD_DOTS=wy", "MOESTACK_KDA_BWD_DOTS=bf16", "MOESTACK_KDA_INTRA_DOTS=tf32",
        ("MOESTACK_KDA_INTRA_DOTS=tf32 MOESTACK_KDA_BWD_DOTS=tf32 MOESTACK_KDA_BWD_X=recompute "
         "MOESTACK_KDA_B3B_FORM=masked MOESTACK_KDA_K1_EXACT=inline")]  # the last: the defaults before session 4
CASES = [  # name, B, T, H, K, seed, correlated
    ("2x500x3 k3", 2, 500, 3, 128, 503, False),
    ("1x1000x2 k3", 1, 1000, 2, 128, 1002, False),
    ("1x1000x2 k3 correlated", 1, 1000, 2, 128, 23, True),
]
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def make_case(B, T, H, K, seed, correlated):
    from moestack.ops.kda.reference import kda_gate_k3

    gen = torch.Generator().manual_seed(seed)
    q, k, v, gin = (torch.randn(B, T, H, K, generator=gen) for _ in range(4))
    beta = torch.randn(B, T, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen) * 0.5
    if correlated:  # as _correlated_keys_case: a shared direction, half the channels saturated, beta near 1
        shared = torch.randn(1, 1, 1, K, generator=torch.Generator().manual_seed(6)) * 2
        q, k = q + shared, k + shared
        gin = torch.cat([gin[..., : K // 2] - 8.0, gin[..., K // 2:] + 8.0], -1)
        A_log, beta = torch.zeros(H), beta + 3.0
    g = kda_gate_k3(gin, A_log, dt_bias, -5.0)
    x = dict(q=q, k=k, v=v, g=g, beta=torch.sigmoid(beta))
    return {n: t.to(torch.bfloat16).cuda() for n, t in x.items()}


def errors(fwd, x, do) -> dict:
    from moestack.ops.kda.reference import kda_chunked_reference

    ins = {n: t.clone().requires_grad_() for n, t in x.items()}
    o = fwd(ins)
    o.float().backward(do)
    ref = {n: t.double().clone().requires_grad_() for n, t in x.items()}

    def l2(t):
        return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)

    ro, _ = kda_chunked_reference(l2(ref["q"]), l2(ref["k"]), ref["v"], ref["g"], ref["beta"])
    ro.backward(do.double())
    got = [o] + [ins[n].grad for n in ("q", "k", "v", "g", "beta")]
    want = [ro] + [ref[n].grad for n in ("q", "k", "v", "g", "beta")]
    return {n: ((a.double() - b).norm() / b.norm()).item() for n, a, b in zip(NAMES, got, want)}


def one(use_fla: bool) -> None:
    """Error rows of one implementation (fla: the first two cases only, its autotuning takes ~1 min per shape)."""
    label = "fla chunk_kda" if use_fla else (" ".join(f"{k[13:]}={v}" for k, v in sorted(os.environ.items())
                                                      if k.startswith("MOESTACK_KDA_")) or "ours default")
    if use_fla:
        from fla.ops.kda import chunk_kda

        def fwd(t):
            return chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True)[0]
    else:
        from moestack.ops.kda.triton_op import kda_fused

        def fwd(t):
            return kda_fused(t["q"], t["k"], t["v"], t["g"], t["beta"], gate="none", l2norm=True,
                             beta_sigmoid=False, recompute=False)[0]
    for name, B, T, H, K, seed, corr in CASES[:2] if use_fla else CASES:
        x = make_case(B, T, H, K, seed, corr)
        do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(seed + 1)).cuda()
        try:
            e = errors(fwd, x, do)
            print(f"| {name} | {label} | " + " | ".join(f"{e[n]:.1e}" for n in NAMES) + " |", flush=True)
        except Exception as ex:  # one faulting variant: its row says so
            print(f"| {name} | {label} | error {type(ex).__name__}: {str(ex)[:100]} |", flush=True)
            return


def run_all(budget_s: float = 260.0, with_fla: bool = False) -> None:
    from kda_switch_check import run_isolated

    t0 = time.perf_counter()
    print("| case | implementation | " + " | ".join(NAMES) + " |\n|" + "---|" * (2 + len(NAMES)), flush=True)
    jobs = [(s, []) for s in SETS] + ([("", ["--fla"])] if with_fla else [])  # fla last: it autotunes for minutes
    for sets, extra in jobs:
        left = budget_s - (time.perf_counter() - t0)
        if left < 10:
            print(f"| | {sets or 'default'} {' '.join(extra)} | skipped: time budget |", flush=True)
            continue
        rows, note = run_isolated(__file__, sets, extra, min(left, 150.0 if extra else 40.0))
        print("\n".join(rows) if rows else f"| | {sets or 'default'} {' '.join(extra)} | {note} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true")
    p.add_argument("--fla", action="store_true", help="this process: fla instead of ours")
    p.add_argument("--with-fla", action="store_true", help="--all: fla too (its autotuning takes minutes)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda_precision.py needs a CUDA GPU (the kernels run in bf16)")
    if args.all:
        run_all(with_fla=args.with_fla)
    else:
        one(args.fla)


if __name__ == "__main__":
    main()
