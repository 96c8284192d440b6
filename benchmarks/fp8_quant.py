"""FP8 activation quantiser (fp8_quant.quantize_dual) on one GPU: its Triton and Gluon kernels side by side.

    python benchmarks/fp8_quant.py                 # K3 EP16: 56 experts x 2340 rows, K = 3584 / 3072 / 6144
    python benchmarks/fp8_quant.py --rows 586      # another rows-per-expert count

quantize_dual reads x [N, K] bf16 once and writes its 1x128 row tiles (q, fp8, expert-major scales) and its 128x1
token tiles (qT, fp8): the FP8 expert GEMMs call it on x and a in the forward and on both output gradients in the
backward. Per kernel ($MOESTACK_FP8_QUANT=triton / gluon): ms (median of triton.testing.do_bench on random normal
data), TB/s counting the bf16 read and both fp8 writes, and whether its bytes equal the Triton kernel's.
--glu I: also the expert FFN's fused source at intermediate size I (fp8_expert_ffn.py): the activation inside the
quantiser (quantize_glu_dual, per config with --configs all) against triton_activation's forward + quantize_dual;
ms, and whether the bytes equal the unfused pair's.
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=56)
    p.add_argument("--rows", type=int, default=2340, help="rows per expert")
    p.add_argument("--widths", default="3584,3072,6144", help="K values, comma list")
    p.add_argument("--configs", default="default",
                   help="'default' or 'all' Gluon configs (warps, columns per thread, qT stores)")
    p.add_argument("--glu", type=int, default=0, help="intermediate size I for the fused GLU sources (0 = skip)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("| fp8 quantiser | needs a CUDA GPU |")
        return
    from triton.testing import do_bench

    from moestack.ops.moe import fp8_quant as fq
    from moestack.ops.moe import gluon_quant as gq

    E, m = args.experts, args.rows
    offs = (torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * m)
    N = E * m
    print(f"| quantize_dual, {torch.cuda.get_device_name()}, {E} experts x {m} rows | K | kernel | ms | TB/s | "
          f"bytes equal to triton |")
    print("|---|---|---|---|---|---|")
    for K in (int(k) for k in args.widths.split(",")):
        x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        moved = N * K * (2 + 1 + 1)
        ref = None
        configs = gq.CONFIGS if args.configs == "all" else gq.CONFIGS[:1]
        for kernel, cfg in [("triton", None)] + [("gluon", c) for c in configs]:
            with mock.patch.dict(os.environ, {fq.QUANT_ENV: kernel}), mock.patch.object(gq, "CONFIGS", (cfg,)):
                out = fq.quantize_dual(x, offs, expert_major=True)
                t = do_bench(lambda x=x: fq.quantize_dual(x, offs, expert_major=True), warmup=20, rep=200)
            if ref is None:
                ref, same = out, "-"
            else:
                n_tok = sum(-(-m // fq.GROUP) for _ in range(E)) * fq.GROUP  # the token tiles written
                same = all((torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)),
                            torch.equal(out[1], ref[1]),
                            torch.equal(out[2][:, :n_tok].view(torch.uint8), ref[2][:, :n_tok].view(torch.uint8)),
                            torch.equal(out[3][:n_tok // fq.GROUP], ref[3][:n_tok // fq.GROUP])))
            label = kernel if cfg is None else f"{kernel} {cfg[0]} warps, {cfg[1]} columns, qT {cfg[2]}" + (
                f", at most {cfg[3]} registers" if len(cfg) > 3 else "")
            print(f"| | {K} | {label} | {t:.3f} | {moved / t / 1e9:.2f} | {same} |", flush=True)
        del x, ref, out
        torch.cuda.empty_cache()
    if args.glu:
        glu_sources(offs, N, args.glu, do_bench, args.configs == "all")


def glu_sources(offs: torch.Tensor, N: int, inter: int, do_bench, all_configs: bool) -> None:
    """The fused activation source against the unfused activation kernel + quantize_dual (module doc)."""
    from moestack.ops.moe import fp8_quant as fq
    from moestack.ops.moe import gluon_quant as gq
    from moestack.ops.moe.triton_activation import fused_glu

    gu = torch.randn(N, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    glu = ("situ_glu", 4.0, 25.0)
    print(f"| fused GLU source, I = {inter} | Gluon config | unfused ms | fused ms | fused TB/s (bytes it must move) | "
          f"bytes equal |")
    print("|---|---|---|---|---|---|")
    for cfg in gq.SOURCE_CONFIGS[1] if all_configs else gq.SOURCE_CONFIGS[1][:1]:
        with mock.patch.dict(gq.SOURCE_CONFIGS, {1: (cfg,)}):
            _glu_row(cfg, lambda: fq.quantize_dual(fused_glu(gu, *glu), offs, expert_major=True),
                     lambda: fq.quantize_glu_dual(gu, offs, *glu, expert_major=True), N * inter * (4 + 2), offs,
                     do_bench)


def _glu_row(cfg, unfused, fused, moved, offs, do_bench) -> None:
    from moestack.ops.moe import fp8_quant as fq

    a, b = unfused(), fused()
    n_tok = int(sum(-(-int(c) // fq.GROUP) for c in torch.diff(offs, prepend=offs.new_zeros(1)))) * fq.GROUP
    same = all((torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)), torch.equal(a[1], b[1]),
                torch.equal(a[2][:, :n_tok].view(torch.uint8), b[2][:, :n_tok].view(torch.uint8)),
                torch.equal(a[3][:n_tok // fq.GROUP], b[3][:n_tok // fq.GROUP])))
    t_u = do_bench(unfused, warmup=20, rep=200)
    t_f = do_bench(fused, warmup=20, rep=200)
    print(f"| | {cfg} | {t_u:.3f} | {t_f:.3f} | {moved / t_f / 1e9:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
