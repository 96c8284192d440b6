"""FP8 weight-gradient recipes per expert through cuBLAS (torch._scaled_mm): what a coarser scale on x would buy.

    python benchmarks/fp8_wgrad_recipe.py [--rows 2340] [--experts 56]

The FP8 weight gradient (moestack/ops/fp8/scaled_mm.wgrad) runs dw[e]^T = dy_e^T x_e with both operands in 128x1 token tiles
(DeepSeek-V3's recipe: one scale per channel per 128 tokens on each side), which cuBLAS runs at ~700-800 TFLOP/s
against ~1000 for the forward's 1x128 x 128x128. This script times, on K3 EP16's two weight-gradient shapes
(random data, 56 experts x 2340 tokens, one cuBLAS call per expert on one stream, bf16 out):
- "1x128 x 1x128": the current recipe;
- "1x128 x 128x128": x in 128x128 blocks (128 tokens x 128 channels share one scale), dy as now;
- "rowwise": one scale per channel over all of an expert's tokens on each side (no promotion in the K loop);
- "bf16": torch.mm per expert and torch._grouped_mm, the bf16 layer's GEMM;
and each FP8 result's relative error against the fp64 product of the unquantised operands (the recipe's cost).
triton.testing.do_bench medians, TFLOP/s on the GEMM's FLOPs.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = (("gate-up dW", 3584, 6144), ("down dW", 3072, 3584))  # (label, D = x width, F = dy width)
FP8 = torch.float8_e4m3fn


def _q(v: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (v / s).clamp(-448, 448).to(FP8), s


def _token_tiles(v_FT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, T] (T a multiple of 128) -> fp8 [C, T], scales [C, T/128] (one per channel per 128 tokens)."""
    C, T = v_FT.shape
    b = v_FT.float().view(C, T // 128, 128)
    q, s = _q(b, b.abs().amax(2, keepdim=True))
    return q.view(C, T), s.squeeze(2)


def _blocks(v_DT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[D, T] -> fp8 [D, T], scales [D/128, T/128] (one per 128 channels x 128 tokens)."""
    D, T = v_DT.shape
    b = v_DT.float().view(D // 128, 128, T // 128, 128)
    q, s = _q(b, b.abs().amax((1, 3), keepdim=True))
    return q.view(D, T), s.view(D // 128, T // 128)


def _rowwise(v_CT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = v_CT.float()
    q, s = _q(v, v.abs().amax(1, keepdim=True))
    return q, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2340)
    ap.add_argument("--experts", type=int, default=56)
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("| fp8 wgrad recipe | needs a CUDA GPU |")
        return
    from triton.testing import do_bench

    E, T = args.experts, args.rows
    Tp = -(-T // 128) * 128
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {E} experts x {T} tokens (padded {Tp})")
    print("| GEMM | recipe | TFLOP/s | rel. error vs fp64 (expert 0) | note |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, D, F in SHAPES:
        flops = 2.0 * E * T * D * F
        # x: activations with per-token magnitude spread (as after a norm times a gate); dy: gradients, wider spread
        x = [torch.zeros(Tp, D, device="cuda", dtype=torch.bfloat16) for _ in range(E)]
        dy = [torch.zeros(Tp, F, device="cuda", dtype=torch.bfloat16) for _ in range(E)]
        for e in range(E):
            x[e][:T] = (torch.randn(T, D, device="cuda", generator=g) *
                        torch.rand(T, 1, device="cuda", generator=g).add(0.25)).bfloat16()
            dy[e][:T] = (torch.randn(T, F, device="cuda", generator=g) *
                         torch.rand(T, 1, device="cuda", generator=g).pow(3).add(1e-3)).bfloat16()
        ref = x[0].double().t() @ dy[0].double()  # [D, F]
        ref_T = ref.t()
        out = torch.empty(F, D, device="cuda", dtype=torch.bfloat16)

        def err(o: torch.Tensor) -> float:
            return float((o.double() - ref_T).norm() / ref_T.norm())

        def run(name, ops, note=""):
            def fn():
                for a, b, sa, sb in ops:
                    torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, out=out)
            try:
                a, b, sa, sb = ops[0]
                o = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
                e0 = err(o)
                ms = do_bench(fn, warmup=10, rep=args.rep)
                print(f"| {label} | {name} | {flops / ms / 1e9:.0f} | {e0:.2e} | {note} |")
            except Exception as exc:  # noqa: BLE001 - report and go on: the layouts cuBLAS takes are the question
                print(f"| {label} | {name} | - | - | {type(exc).__name__}: {str(exc).splitlines()[0][:160]} |")

        dyT = [d.t().contiguous() for d in dy]  # [F, Tp]
        xT = [v.t().contiguous() for v in x]  # [D, Tp]
        # current: a = dy^T [F, Tp] 1x128 along tokens, b = x [Tp, D] column-major 1x128 along tokens
        cur = []
        for e in range(E):
            qa, sa = _token_tiles(dyT[e])
            qb, sb = _token_tiles(xT[e])
            cur.append((qa, qb.t(), sa.t().contiguous().t(), sb.t().contiguous()))
        run("1x128 x 1x128", cur)
        nt = Tp // 128
        nt4 = -(-nt // 4) * 4
        for pad in (False, True):
            blk = []
            for e in range(E):
                qa, sa = _token_tiles(dyT[e])
                qb, sb = _blocks(xT[e])  # sb [D/128, nt]
                if pad:  # scales [nt, D/128] with stride (1, nt4): K-block-major, leading dim padded to 4
                    buf = torch.zeros(D // 128, nt4, device="cuda")
                    buf[:, :nt] = sb
                    sbk = buf.t()[:nt]
                else:
                    sbk = sb.t()  # [nt, D/128], stride (1, nt)
                blk.append((qa, qb.t(), sa.t().contiguous().t(), sbk))
            run("1x128 x 128x128" + (" (scale ld padded to 4)" if pad else ""), blk)
        rw = []
        for e in range(E):
            qa, sa = _rowwise(dyT[e])
            qb, sb = _rowwise(xT[e])
            rw.append((qa, qb.t(), sa, sb.t()))
        run("rowwise (per channel per expert)", rw)
        ms = do_bench(lambda: [torch.mm(dyT[e], x[e], out=out) for e in range(E)], warmup=10, rep=args.rep)
        print(f"| {label} | bf16 torch.mm per expert | {flops / ms / 1e9:.0f} | - | |")
        xs = torch.cat(x)
        dys = torch.cat(dy)
        offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * Tp
        ms = do_bench(lambda: torch._grouped_mm(dys.t(), xs, offs=offs), warmup=10, rep=args.rep)
        print(f"| {label} | bf16 torch._grouped_mm | {flops / ms / 1e9:.0f} | - | padded tokens |")
        del x, dy, xT, dyT, cur, blk, rw, xs, dys


if __name__ == "__main__":
    main()
