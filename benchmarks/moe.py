"""MoE layer (router through up-projection) vs its expert GEMMs alone and vs a plain PyTorch MoE, on one GPU.

    python benchmarks/moe.py                  # all shapes, bf16, grouped GEMM backend "torch"
    python benchmarks/moe.py --gemm triton    # any name in moestack.ops.moe.available_backends()
    python benchmarks/moe.py --only k3        # shapes whose name contains "k3"
    python benchmarks/moe.py --fp8 --only k3-ep16 --rep 60   # FP8 vs bf16: layer + expert FFN at 128..2341 rows
    python benchmarks/moe.py --fp8 --only k3-ep16 --no-ffn --rounds 3 --fp8-variants bf16,fp8,fp8-proj  # interleaved

--fp8 (issue #7's "FP8 layer >= 1.4x bf16 layer"): per variant (FP8_VARIANTS: bf16 = grouped GEMM backend "torch";
fp8 = the FP8 recipe's expert GEMMs, moestack/ops/fp8/grouped_gemm.py, as `precision: fp8` sets them; fp8-triton /
fp8-cublas = the same with kernels.fp8.cublas_min_rows forcing the Triton / the per-expert cuBLAS path; fp8-nocache
= kernels.fp8.weight_cache off, the weights requantised on every call as under FSDP2; *-proj also runs the
LatentMoE's down / up projections in FP8, ops/fp8/linear.py, reverted after the variant so the bf16 baseline stays
pure bf16) the whole layer forward and forward+backward, then the expert FFN alone (Experts: gate/up GEMM, fused
activation, down GEMM) at K3 EP16 widths (56 experts, 3584 -> 2x3072 -> 3584) with 128 / 256 / 586 / 2341 rows per
expert, and the weight quantisation an optimizer step adds (fp8 weights are cached per parameter version, so every
micro-batch of a step reuses them). The variants deleted in the kernel refactor (v1 / v2, the TMA and Gluon-rows
forms, the fused expert FFN, one-stream weight gradients, other quantiser configs) and their last numbers:
benchmarks/RESULTS.md.

Per-device shapes (one layer, T tokens on this device, experts local to it): Kimi K3 at EP16 / EP64 (896 routed
experts -> 56 / 14 local, top-16, latent 3584, inter 3072), uniform and Zipf-skewed; the single-H200 proxy; and
DeepSeek-V3 at EP16 (7168 -> 2048, 256 experts -> 16 local, top-8, 8 groups / top-4). The router scores all
experts (the full router GEMM and top-k run on every device); a chosen expert id maps to local expert
id % local experts, which gives each device the T*K rows it receives after the all-to-all (the all-to-all itself
is benchmarks/a2a.py). Skew: a selection bias favouring local experts by Zipf rank (max/mean load in the row).

Per shape: the layer (moestack.model.moe pieces: Router, routing dispatcher, Experts, RMSNorm, projections;
no shared experts), forward and forward+backward; the expert GEMMs alone on the same sorted rows and offsets
(gate_up and down, same backend); a plain PyTorch MoE on the same weights (sigmoid + topk, argsort +
index_select + grouped_mm + eager activation + index_add). Reported: ms (median of CUDA-event timings by
triton.testing.do_bench), TFLOP/s on expert FLOPs (6*N*L*I forward, 3x for forward+backward), the share of
layer time that is not expert GEMM (1 - GEMMs alone / layer), the share outside all GEMMs (also subtracting the
router logits, down- and up-projection GEMMs timed alone), speed-up vs the plain MoE, and layer / GEMMs alone.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from moestack.config.model_spec import MoESpec, RouterSpec
from moestack.model.aux_loss import attach_aux_loss
from moestack.model.moe import MoE, Router, sequence_aux_loss
from moestack.ops import moe as moe_ops
from moestack.ops.moe import routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke test of the layer code

SHAPES = [
    # name, hidden, latent (None = plain), inter, local experts, router experts, top-k, tokens, zipf, groups, top groups
    ("k3-ep16", 7168, 3584, 3072, 56, 896, 16, 8192, 0.0, 1, 1),
    ("k3-ep16-zipf", 7168, 3584, 3072, 56, 896, 16, 8192, 1.0, 1, 1),
    ("k3-ep64", 7168, 3584, 3072, 14, 896, 16, 8192, 0.0, 1, 1),
    ("k3-ep64-zipf", 7168, 3584, 3072, 14, 896, 16, 8192, 1.0, 1, 1),
    ("k3-ep16-plain", 7168, None, 3072, 56, 896, 16, 8192, 0.0, 1, 1),
    ("proxy", 1536, 768, 640, 128, 128, 16, 8192, 0.0, 1, 1),
    ("dsv3-ep16", 7168, None, 2048, 16, 256, 8, 8192, 0.0, 8, 4),
]


class BenchLayer:
    """The MoE layer's forward from its real pieces, with the router over all experts and local expert ids."""

    def __init__(self, hidden, latent, inter, e_local, e_router, top_k, zipf, groups, top_groups, gemm, dtype):
        rspec = RouterSpec(num_groups=groups, topk_groups=top_groups, seq_aux_loss_coef=1e-4)
        spec = MoESpec(num_experts=e_local, top_k=min(top_k, e_local), expert_intermediate_size=inter,
                       latent_size=latent, router=rspec)
        self.moe = MoE(hidden, spec, "situ_glu").to(DEV)
        self.moe.init_weights(0.02)
        self.moe.to(dtype)
        self.moe.experts.gemm = moe_ops.GroupedGemm(gemm)
        self.router = Router(hidden, e_router, top_k, rspec).to(DEV)
        self.router.init_weights(hidden**-0.5)
        with torch.no_grad():
            if zipf > 0:  # favour local expert (e % e_local) by Zipf rank; choice only (bias)
                rank = torch.arange(e_router, device=DEV) % e_local
                self.router.selection_bias.copy_(0.3 * (rank + 1.0).pow(-zipf))
        self.e_local, self.top_k = e_local, top_k
        self.params = [p for p in self.moe.parameters() if p.requires_grad] + [self.router.weight]

    def route(self, x_TD):
        idx, w, scores = self.router(x_TD)
        return idx % self.e_local, w, scores, idx

    def forward(self, x_BTD, backend=None):
        m = self.moe
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        self.router.backend = backend
        idx, w, scores, idx_global = self.route(x_TD)
        h = m.down_proj(x_TD) if m.down_proj is not None else x_TD
        d = routing.dispatch(idx, self.e_local, m.row_align, backend=backend)
        m.experts.routing_backend = backend
        y = routing.combine(m.experts(routing.gather(h, d, backend), d.offs_E), d, w, backend)
        if m.latent_norm is not None:
            y = m.latent_norm(y)
        out = m.up_proj(y) if m.up_proj is not None else y
        aux = sequence_aux_loss(scores.view(B, T, -1), idx_global.view(B, T, -1), 1e-4)
        return attach_aux_loss(out.view(B, T, D), aux)

    def gemm_inputs(self, x_BTD):
        """The sorted expert rows, offsets and activation input of one forward, for the GEMMs-alone timing."""
        with torch.no_grad():
            m = self.moe
            x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
            idx, _, _, _ = self.route(x_TD)
            h = m.down_proj(x_TD) if m.down_proj is not None else x_TD
            d = routing.dispatch(idx, self.e_local, m.row_align)
            xs = routing.gather(h, d)
            a = torch.randn(xs.shape[0], m.experts.w_down.shape[-1], device=DEV, dtype=xs.dtype)
            return xs, a, d

    def plain_torch(self, x_BTD):
        """argsort + index_select + grouped_mm + eager activation + index_add, same weights and routing rule."""
        m, r = self.moe, self.router
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        s = torch.sigmoid(routing.router_logits(x_TD, r.weight))  # the same logits GEMM as the layer
        c = s.detach() + r.selection_bias
        G = r.spec.num_groups
        if G > 1:
            cg = c.view(B * T, G, -1)
            keep = cg.topk(2, -1).values.sum(-1).topk(r.spec.topk_groups, -1).indices
            mask = torch.ones_like(cg[..., 0], dtype=torch.bool).scatter_(1, keep, False)
            c = cg.masked_fill(mask.unsqueeze(-1), float("-inf")).view(B * T, -1)
        idx = c.topk(self.top_k, -1).indices
        w = s.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        flat = (idx % self.e_local).flatten()
        order = flat.argsort()
        offs = torch.cumsum(torch.bincount(flat, minlength=self.e_local), 0).to(torch.int32)
        tok = order // self.top_k
        h = m.down_proj(x_TD) if m.down_proj is not None else x_TD
        xs = h.index_select(0, tok)
        gu = moe_ops.grouped_mm(xs, m.experts.w_gate_up.transpose(1, 2), offs, backend="torch")
        g, u = gu.chunk(2, -1)
        a = (4 * torch.tanh(g.float() / 4) * torch.sigmoid(g.float()) * 25 * torch.tanh(u.float() / 25)).to(gu.dtype)
        ys = moe_ops.grouped_mm(a, m.experts.w_down.transpose(1, 2), offs, backend="torch")
        ys = ys * w.flatten()[order].unsqueeze(-1).to(ys.dtype)
        y = torch.zeros_like(h).index_add_(0, tok, ys)
        if m.latent_norm is not None:
            y = m.latent_norm(y)
        out = m.up_proj(y) if m.up_proj is not None else y
        return out.view(B, T, D)


def bench(fn, rep_ms: int, grad_to_none=None) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")


def run_shape(shape, gemm: str, rep_ms: int) -> list[str]:
    name, hidden, latent, inter, e_loc, e_rt, K, T, zipf, G, TG = shape
    dtype = torch.bfloat16
    torch.manual_seed(0)
    layer = BenchLayer(hidden, latent, inter, e_loc, e_rt, K, zipf, G, TG, gemm, dtype)
    x = torch.randn(1, T, hidden, device=DEV, dtype=dtype).requires_grad_()
    gy = torch.randn_like(x)
    L = latent or hidden
    N = T * K
    flops_fwd = 6.0 * N * L * inter
    xs, a, d = layer.gemm_inputs(x)
    load = d.counts_E.float()
    skew = float(load.max() / load.mean())
    W1, W2 = layer.moe.experts.w_gate_up, layer.moe.experts.w_down
    xs.requires_grad_()
    a.requires_grad_()
    g1 = torch.randn(xs.shape[0], 2 * inter, device=DEV, dtype=dtype)
    g2 = torch.randn_like(xs)
    params = layer.params

    def gemm_fwd():
        moe_ops.grouped_mm(xs, W1.transpose(1, 2), d.offs_E, backend=gemm)
        moe_ops.grouped_mm(a, W2.transpose(1, 2), d.offs_E, backend=gemm)

    def gemm_fb():
        y1 = moe_ops.grouped_mm(xs, W1.transpose(1, 2), d.offs_E, backend=gemm)
        y2 = moe_ops.grouped_mm(a, W2.transpose(1, 2), d.offs_E, backend=gemm)
        torch.autograd.backward([y1, y2], [g1, g2])

    def layer_fwd(backend):
        return lambda: layer.forward(x, backend)

    def layer_fb(backend):
        return lambda: layer.forward(x, backend).backward(gy)

    def plain_fb():
        layer.plain_torch(x).backward(gy)

    m = layer.moe
    y_lat = torch.randn(T, L, device=DEV, dtype=dtype, requires_grad=True)
    g_lat = torch.randn(T, L, device=DEV, dtype=dtype)
    g_log = torch.randn(T, e_rt, device=DEV)

    def dense(backward: bool):
        """The layer's other GEMMs alone: router logits, down- and up-projection (LatentMoE)."""
        outs = [(routing.router_logits(x.view(T, -1), layer.router.weight), g_log)]
        if m.down_proj is not None:
            outs += [(m.down_proj(x.view(T, -1)), g_lat), (m.up_proj(y_lat), gy.view(T, -1))]
        if backward:
            torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])

    with torch.no_grad():
        t_gf = bench(gemm_fwd, rep_ms)
        t_lf = bench(layer_fwd("triton"), rep_ms)
        t_pf = bench(lambda: layer.plain_torch(x), rep_ms)
        t_rf = bench(lambda: routing.router_logits(x.view(T, -1), layer.router.weight), rep_ms)
        t_rf32 = bench(lambda: F.linear(x.view(T, -1).float(), layer.router.weight), rep_ms)
    t_gb = bench(gemm_fb, rep_ms, [xs, a, W1, W2])
    t_lb = bench(layer_fb("triton"), rep_ms, [x, *params])
    t_pb = bench(plain_fb, rep_ms, [x, *params])
    with torch.no_grad():
        t_ref_f = bench(layer_fwd("reference"), rep_ms)
        t_df = bench(lambda: dense(False), rep_ms)
    t_db = bench(lambda: dense(True), rep_ms, [x, y_lat, *params])

    tag = f"{name} (E{e_loc}/{e_rt} K{K} T{T} L{L} I{inter}, max/mean load {skew:.2f}, gemm {gemm})"
    fwd_row = (
        f"| {tag} | fwd | {t_lf:.2f} | {flops_fwd / t_lf / 1e9:.0f} | {100 * (1 - t_gf / t_lf):.1f}% | "
        f"{100 * (1 - (t_gf + t_df) / t_lf):.1f}% | "
        f"{t_pf / t_lf:.2f}x | {t_lf / t_gf:.2f} | {t_gf:.2f} | {t_ref_f:.2f} | {t_rf:.2f} / {t_rf32:.2f} |"
    )
    fb_row = (
        f"| {tag} | fwd+bwd | {t_lb:.2f} | {3 * flops_fwd / t_lb / 1e9:.0f} | {100 * (1 - t_gb / t_lb):.1f}% | "
        f"{100 * (1 - (t_gb + t_db) / t_lb):.1f}% | "
        f"{t_pb / t_lb:.2f}x | {t_lb / t_gb:.2f} | {t_gb:.2f} | - | - |"
    )
    return [fwd_row, fb_row]


def _fp8(**kw):
    def make():
        from moestack.ops.fp8.grouped_gemm import Fp8GroupedGemm

        return Fp8GroupedGemm(**kw)

    return make


FP8_VARIANTS = {  # name: (the experts' GEMM strategy, made per variant; also the latent projections in FP8)
    "bf16": (lambda: moe_ops.GroupedGemm("torch"), False),
    "fp8": (_fp8(), False),
    "fp8-triton": (_fp8(cublas_min_rows=10**9), False),
    "fp8-cublas": (_fp8(cublas_min_rows=0), False),
    "fp8-nocache": (_fp8(cache_mode="off"), False),
    "fp8-proj": (_fp8(), True),
    "fp8-nocache-proj": (_fp8(cache_mode="off"), True),
}
FFN_ROWS = (128, 256, 586, 2341)


def _err(e: Exception, n: int = 200) -> str:
    """An exception as one table cell: its type and the first n characters of its first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:n] if str(e) else ''}"


def _emit(rows: list[str], row: str) -> None:
    """Print a result row at once (a run cut by a timeout keeps what it measured) and keep it."""
    print(row, flush=True)
    rows.append(row)


def _time_fwd_fb(fwd, rep_ms, params, gy):
    """(forward ms without grad, forward+backward ms) after one warm-up step (compile, autotune, fp8 caches)."""
    fwd().backward(gy)
    with torch.no_grad():
        t_f = bench(fwd, rep_ms)
    t_b = bench(lambda: fwd().backward(gy), rep_ms, params)
    return t_f, t_b


def fp8_layer(shape, variants: list[str], rep_ms: int, rounds: int = 1) -> list[str]:
    """The whole layer per variant; with rounds > 1 the variants are timed in turn that many times and the rows give
    medians (range in brackets): the bf16 layer's time moves by several percent between rounds of one process."""
    import statistics

    from moestack.ops.fp8 import linear as fp8_linear
    from moestack.ops.fp8 import weight_cache as wc

    name, hidden, latent, inter, e_loc, e_rt, K, T, zipf, G, TG = shape
    torch.manual_seed(0)
    layer = BenchLayer(hidden, latent, inter, e_loc, e_rt, K, zipf, G, TG, "torch", torch.bfloat16)
    x = torch.randn(1, T, hidden, device=DEV, dtype=torch.bfloat16).requires_grad_()
    gy = torch.randn_like(x)
    flops = 6.0 * T * K * (latent or hidden) * inter
    rows: list[str] = []
    times: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in variants}
    failed: set[str] = set()
    for _ in range(rounds):
        for v in variants:
            if v in failed:
                continue
            make, proj = FP8_VARIANTS[v]
            try:
                layer.moe.experts.gemm = make()
                if proj:
                    if layer.moe.down_proj is None:
                        raise ValueError("no latent projections in this shape")
                    fp8_linear.convert_to_fp8_linear(layer.moe, ["down_proj", "up_proj"], cache_mode=getattr(
                        layer.moe.experts.gemm, "cache_mode", "on"))
                wc.clear()
                t_f, t_b = _time_fwd_fb(lambda: layer.forward(x, "triton"), rep_ms, [x, *layer.params], gy)
                times[v][0].append(t_f)
                times[v][1].append(t_b)
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the others
                failed.add(v)
                _emit(rows, f"| layer {name} | {v} | error: {_err(e, 160)} |")
            finally:
                fp8_linear.revert_fp8_linear(layer.moe)  # the next variant (and the baseline) in bf16 again
    layer.moe.experts.gemm = moe_ops.GroupedGemm()
    base = None
    for v in variants:
        if v in failed:
            continue
        t_f, t_b = (statistics.median(t) for t in times[v])
        spread = (f" ({min(times[v][1]):.2f}-{max(times[v][1]):.2f})" if rounds > 1 else "")
        base = base or (t_f, t_b)
        _emit(rows, f"| layer {name} (E{e_loc} L{latent or hidden} I{inter}, {T * K // e_loc} rows/expert) | {v} | "
                    f"{t_f:.2f} | {t_b:.2f}{spread} | {base[0] / t_f:.2f}x | {base[1] / t_b:.2f}x | "
                    f"{flops / t_f / 1e9:.0f} / {3 * flops / t_b / 1e9:.0f} |")
    return rows


def fp8_ffn(variants: list[str], rep_ms: int, rows_per_expert=FFN_ROWS, E=56, L=3584, inter=3072) -> list[str]:
    """The expert FFN alone (Experts module: gate/up GEMM, fused activation, down GEMM) on sorted rows."""
    from moestack.model.moe import Experts
    from moestack.ops.fp8 import weight_cache as wc

    ex = Experts(E, L, inter).to(DEV)
    ex.init_weights(0.02)
    ex.to(torch.bfloat16)
    ex.routing_backend = "triton"
    out = []
    for m in rows_per_expert:
        torch.manual_seed(m)
        N = E * m
        xs = torch.randn(N, L, device=DEV, dtype=torch.bfloat16).requires_grad_()
        gy = torch.randn_like(xs)
        offs = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * m
        flops = 6.0 * N * L * inter
        base = None
        for v in variants:
            make, proj = FP8_VARIANTS[v]
            if proj:
                continue  # the expert FFN has no projections: the same as its base variant
            try:
                ex.gemm = make()
                wc.clear()
                t_f, t_b = _time_fwd_fb(lambda xs=xs, offs=offs: ex(xs, offs), rep_ms,
                                        [xs, ex.w_gate_up, ex.w_down], gy)
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the others
                _emit(out, f"| expert FFN {m} rows/expert | {v} | error: {_err(e, 160)} |")
                continue
            base = base or (t_f, t_b)
            _emit(out, f"| expert FFN E{E} L{L} I{inter}, {m} rows/expert | {v} | {t_f:.2f} | {t_b:.2f} | "
                       f"{base[0] / t_f:.2f}x | {base[1] / t_b:.2f}x | "
                       f"{flops / t_f / 1e9:.0f} / {3 * flops / t_b / 1e9:.0f} |")
        torch.cuda.empty_cache()
    # what an optimizer step adds: both layouts of both weights requantised once (one read per weight)
    from moestack.ops.fp8 import quant as fq

    w1, w2 = ex.w_gate_up.transpose(1, 2), ex.w_down.transpose(1, 2)
    with torch.no_grad():
        t3 = bench(lambda: [fq.quantize_blocks_pair(w) for w in (w1, w2)], rep_ms)
    _emit(out, f"| weight requantisation per optimizer step (E{E}, both weights, both layouts, bf16 params) | "
               f"{t3:.2f} ms | - | - | - | - |")
    return out


def fp8_main(args) -> None:
    variants = args.fp8_variants.split(",")
    print(f"| FP8 benchmark | variant | fwd ms | fwd+bwd ms | fwd vs {variants[0]} | fwd+bwd vs {variants[0]} | "
          f"expert TFLOP/s fwd / fwd+bwd |  ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print("|---|---|---|---|---|---|---|")
    exact = any(shape[0] == args.only for shape in SHAPES)  # an exact shape name selects that shape only
    for shape in SHAPES:
        if args.only and (shape[0] != args.only if exact else args.only not in shape[0]):
            continue
        try:
            fp8_layer(shape, variants, args.rep, args.rounds)  # prints errors at once, the timing rows after the rounds
        except Exception as e:  # noqa: BLE001 - one failing shape must not end the run
            print(f"| layer {shape[0]} | error: {_err(e)} |",
                  flush=True)
        torch.cuda.empty_cache()
    if not args.no_ffn:
        rows = tuple(int(r) for r in args.ffn_rows.split(","))
        try:
            fp8_ffn((args.ffn_variants or args.fp8_variants).split(","), args.rep, rows)
        except Exception as e:  # noqa: BLE001
            print(f"| expert FFN | error: {_err(e)} |",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemm", default="torch", help=f"grouped GEMM backend (registered: {moe_ops.available_backends()})")
    p.add_argument("--only", default=None, help="run shapes whose name contains this")
    p.add_argument("--rep", type=int, default=150, help="do_bench repetition time per measurement, ms")
    p.add_argument("--fp8", action="store_true", help="FP8 variants vs bf16: layer and expert FFN (module doc)")
    p.add_argument("--fp8-variants", default="bf16,fp8,fp8-proj", help=f"from {list(FP8_VARIANTS)}; first = baseline")
    p.add_argument("--ffn-rows", default=",".join(map(str, FFN_ROWS)), help="--fp8: rows per expert of the FFN rows")
    p.add_argument("--no-ffn", action="store_true", help="--fp8: layer rows only")
    p.add_argument("--rounds", type=int, default=1, help="--fp8: time the layer variants in turn this many times "
                   "(medians, fwd+bwd range in brackets)")
    p.add_argument("--ffn-variants", default=None, help="--fp8: variants of the expert FFN rows (default: as layer)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("| moe benchmark | needs a CUDA GPU |")
        return
    if args.fp8:
        fp8_main(args)
        return
    print(f"| shape | pass | layer ms | expert TFLOP/s | non-expert-GEMM share | share outside all GEMMs | vs plain torch MoE | layer / GEMMs | "
          f"GEMMs ms | ref-routing fwd ms | router logits ms: split-bf16 / fp32 |  ({torch.cuda.get_device_name()}, "
          f"torch {torch.__version__})")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    if args.gemm not in moe_ops.available_backends():
        print(f"| gemm {args.gemm} | not registered here; available: {moe_ops.available_backends()} |")
        return
    for shape in SHAPES:
        if args.only and args.only not in shape[0]:
            continue
        try:
            for row in run_shape(shape, args.gemm, args.rep):
                print(row, flush=True)
        except torch.OutOfMemoryError:
            print(f"| {shape[0]} | skipped: out of memory |", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing shape must not end the run
            print(f"| {shape[0]} | error: {_err(e)} |",
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
