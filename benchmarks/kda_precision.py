"""KDA bf16 precision against the fp64 reference, ours (the default kernels) next to fla-core.

    python3 benchmarks/kda_precision.py [--fla]

Why: with bf16 dot operands the gate gradient dg of some GPU test cases reached 1.1-1.5e-2 relative RMS (bound
1e-2) while o, dq, dk, dv stayed at ~4e-3. This prints, per case, the relative RMS of o and every gradient for
ours and for fla's chunk_kda on the same bf16 inputs (the anchor: what a well-kept bf16 implementation reaches).
Inputs as the GPU tests' cases (tests/ops/test_kda_triton.py GPU_CASES and the correlated-keys case), fed in the
gate="none" form both implementations share: q, k un-normalised (L2 norm in kernel), g = the K3 log-decay
(computed in fp32 from the gate input, then bf16), beta after the sigmoid; one document, initial state zero.
"""

from __future__ import annotations

import argparse
import sys

import torch

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
    label = "fla chunk_kda" if use_fla else "ours default"
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fla", action="store_true", help="fla instead of ours")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kda_precision.py needs a CUDA GPU (the kernels run in bf16)")
    print("| case | implementation | " + " | ".join(NAMES) + " |\n|" + "---|" * (2 + len(NAMES)), flush=True)
    one(args.fla)


if __name__ == "__main__":
    main()
