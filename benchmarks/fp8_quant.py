"""FP8 activation quantiser (moestack/ops/fp8/quant.quantize_dual) on one GPU: its Triton and Gluon kernels.

    python benchmarks/fp8_quant.py                 # K3 EP16: 56 experts x 2340 rows, K = 3584 / 3072 / 6144
    python benchmarks/fp8_quant.py --rows 586      # another rows-per-expert count

quantize_dual reads x [N, K] bf16 once and writes its 1x128 row tiles (q, fp8, expert-major scales) and its 128x1
token tiles (qT, fp8): the FP8 expert GEMMs call it on x and a in the forward and on both output gradients in the
backward. Per kernel (triton; gluon = the default on sm_90, gluon_quant.py): ms (median of triton.testing.do_bench
on random normal data), TB/s counting the bf16 read and both fp8 writes, and whether its bytes equal the Triton
kernel's. The other Gluon launch configs and the fused GLU source were deleted in the kernel refactor (numbers:
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=56)
    p.add_argument("--rows", type=int, default=2340, help="rows per expert")
    p.add_argument("--widths", default="3584,3072,6144", help="K values, comma list")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("| fp8 quantiser | needs a CUDA GPU |")
        return
    from triton.testing import do_bench

    from moestack.ops.fp8 import quant as fq
    from moestack.ops.fp8.reference import GROUP

    E, m = args.experts, args.rows
    offs = (torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * m)
    N = E * m
    print(f"| quantize_dual, {torch.cuda.get_device_name()}, {E} experts x {m} rows | K | kernel | ms | TB/s | "
          f"bytes equal to triton |")
    print("|---|---|---|---|---|---|")
    gluon = fq.gluon_module("gluon_quant", torch.device("cuda"))
    for K in (int(k) for k in args.widths.split(",")):
        x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        moved = N * K * (2 + 1 + 1)
        ref = None
        for kernel in ("triton", "gluon"):
            if kernel == "gluon" and gluon is None:
                print(f"| | {K} | gluon | not available here (sm_90 only) | - | - |", flush=True)
                continue
            module = gluon if kernel == "gluon" else None
            with mock.patch.object(fq, "gluon_module", lambda name, device, module=module: module):
                out = fq.quantize_dual(x, offs, expert_major=True)
                t = do_bench(lambda x=x: fq.quantize_dual(x, offs, expert_major=True), warmup=20, rep=200)
            if ref is None:
                ref, same = out, "-"
            else:
                n_tok = sum(-(-m // GROUP) for _ in range(E)) * GROUP  # the token tiles written
                same = all((torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)),
                            torch.equal(out[1], ref[1]),
                            torch.equal(out[2][:, :n_tok].view(torch.uint8), ref[2][:, :n_tok].view(torch.uint8)),
                            torch.equal(out[3][:n_tok // GROUP], ref[3][:n_tok // GROUP])))
            print(f"| | {K} | {kernel} | {t:.3f} | {moved / t / 1e9:.2f} | {same} |", flush=True)
        del x, ref, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
