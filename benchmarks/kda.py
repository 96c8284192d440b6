"""KDA: moestack's Triton kernels vs fla-core's chunk_kda, same process, same inputs.

    python3 benchmarks/kda.py                      # the three issue shapes, forward and forward+backward
    python3 benchmarks/kda.py --shapes 1x4096x8x128 --no-fla
    python3 benchmarks/kda.py --backends ours ours-save --shapes 1x32768x32x128 --breakdown --no-layer-ops

Ours: "ours" (recompute in backward, the model's default) and "ours-save" (recompute=False), the default kernels
(moestack/ops/kda/README.md). The variants measured before the refactor (dot precisions, launch configs, backward
forms) were removed; their numbers stay in benchmarks/RESULTS.md.

Inputs (bf16): q, k, v ~ N(0, 1) un-normalised (both sides L2-normalise in kernel), g = logsigmoid(N(0, 1))
(an activated log-decay, as fla's own tests draw it), beta = sigmoid(N(0, 1)). Ours runs `kda_fused(gate="none",
l2norm=True, beta_sigmoid=False)`, fla runs `chunk_kda(use_qk_l2norm_in_kernel=True)`. Times are medians of
`triton.testing.do_bench` after a warm-up that also absorbs autotuning. FLOPs per MODEL.md:
B * H * (6 T K^2 + 3 T C K + T C^2) forward, three times that for forward+backward. `speedup` = fla / ours.
Prints one markdown table (rows start with '|') and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = ["1x32768x32x128", "2x8192x96x128", "8x4096x20x128"]  # B x T x H x D
def kda_flops(B: int, T: int, H: int, K: int, C: int = 64) -> float:
    return B * H * (6 * T * K * K + 3 * T * C * K + T * C * C)


def make_inputs(B, T, H, D, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    return dict(
        q=rnd(B, T, H, D).bfloat16(),
        k=rnd(B, T, H, D).bfloat16(),
        v=rnd(B, T, H, D).bfloat16(),
        g=F.logsigmoid(rnd(B, T, H, D)).bfloat16(),
        beta=torch.sigmoid(rnd(B, T, H)).bfloat16(),
    )


def runner(name: str, x: dict, backward: bool):
    """A closure running one forward (and backward) of backend `name` on inputs x."""
    if name == "fla":
        from fla.ops.kda import chunk_kda

        def fwd(q, k, v, g, beta):
            return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    else:
        from moestack.ops.kda.triton_op import kda_fused

        if name not in ("ours", "ours-save"):
            raise ValueError(f"unknown backend {name!r}: use ours, ours-save or fla")
        recompute = name == "ours"

        def fwd(q, k, v, g, beta):
            return kda_fused(q, k, v, g, beta, gate="none", l2norm=True, beta_sigmoid=False, recompute=recompute)[0]

    ins = [x[n].clone().requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")]
    # the same upstream gradient for every variant (a fresh randn_like per variant made the gradient comparisons
    # of "ours vs fla" and "rel-RMS vs ours" compare unrelated gradients: rel-RMS ~1.4 = sqrt(2))
    gen = torch.Generator(device=x["v"].device).manual_seed(1234)
    do = torch.randn(x["v"].shape, generator=gen, device=x["v"].device, dtype=x["v"].dtype) if backward else None

    def run():
        o = fwd(*ins)
        if backward:
            o.backward(do)
        return o

    return run, ins


def breakdown(x: dict, rep: int, skip_bwd: bool = False) -> dict:
    """Median ms of each of our kernels on inputs x (bf16, gate='none', L2 norm in kernel, as the main table)."""
    from triton.testing import do_bench

    from moestack.ops.kda import triton_bwd as tb
    from moestack.ops.kda import triton_fwd as tf
    from moestack.ops.kda.triton_op import _chunk_layout

    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    q, k, v, g, beta = (x[n].reshape(B * T, *x[n].shape[2:]).contiguous() for n in ("q", "k", "v", "g", "beta"))
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32) * T
    cmap, offs = _chunk_layout(cu, B * T)
    kw = dict(scale=K**-0.5, gate=0, lower_bound=-5.0, l2norm=True)
    steps = {}
    steps["fwd intra (K1)"] = lambda: tf.kda_fwd_intra(q, k, v, g, beta, None, None, cmap, cu, beta_sigmoid=False,
                                                       inter_dtype=q.dtype, **kw)
    intra = steps["fwd intra (K1)"]()
    rec = dict(n_seqs=B, V=V, out_dtype=v.dtype, store_ht=False)
    steps["fwd intra (K1), storing X for B3a"] = lambda: tf.kda_fwd_intra(
        q, k, v, g, beta, None, None, cmap, cu, beta_sigmoid=False, inter_dtype=q.dtype, store_x=True, **kw)
    intra = steps["fwd intra (K1), storing X for B3a"]()
    steps["fwd recurrence + output (K2)"] = lambda: tf.kda_fwd_recurrence(intra, None, offs, cu, store_o=True,
                                                                         store_states=False, **rec)
    steps["fwd recurrence, states only (bwd recompute)"] = lambda: tf.kda_fwd_recurrence(
        intra, None, offs, cu, store_o=False, store_states=True, **rec)
    _, _, h, d = steps["fwd recurrence, states only (bwd recompute)"]()
    do = torch.randn_like(v)
    steps["bwd recurrence (B2)"] = lambda: tb.kda_bwd_recurrence(intra, do, None, offs, cu, n_seqs=B, V=V,
                                                                 need_dh0=False)
    dh, dd, _ = steps["bwd recurrence (B2)"]()
    steps["bwd wy (B3a)"] = lambda: tb.kda_bwd_wy(k, v, beta, intra, cmap, cu, h, dh, d, dd, do, beta_sigmoid=False)
    part = steps["bwd wy (B3a)"]()[2]
    steps["bwd scores (B3b)"] = lambda: tb.kda_bwd_scores(q, k, g, None, None, intra, cmap, cu, dict(part), **kw)
    steps["bwd scores (B3b)"]()
    out = {}
    for name, fn in steps.items():
        if skip_bwd and name.startswith("bwd"):
            continue
        try:
            out[name] = do_bench(fn, warmup=25, rep=rep, return_mode="median")
        except Exception as e:  # one failing variant (a config that does not compile) must not stop the rest
            print(f"| kernel {name} | error: {type(e).__name__}: {str(e)[:160]} | | | | | |", flush=True)
    return out


def kernel_report() -> None:
    """Registers, spills and the chosen config of each of our compiled kernels (from the compiler's metadata)."""
    from moestack.ops.kda import triton_bwd, triton_fwd

    for kern in (triton_fwd.kda_fwd_kernel_intra, triton_fwd.kda_fwd_kernel_recurrence,
                 triton_bwd.kda_bwd_kernel_recurrence, triton_bwd.kda_bwd_kernel_wy, triton_bwd.kda_bwd_kernel_scores):
        fn = getattr(kern, "fn", kern)
        try:
            for cache in fn.device_caches.values():
                for compiled in cache[0].values():
                    md = compiled.metadata
                    print(f"  kernel {fn.__name__}: regs={compiled.n_regs} spills={compiled.n_spills} "
                          f"warps={md.num_warps} stages={md.num_stages} smem={md.shared}")
            print(f"  kernel {fn.__name__}: best={getattr(kern, 'best_config', None)}")
        except Exception as e:  # metadata layout differs across Triton versions: report, don't fail
            print(f"  kernel {fn.__name__}: no metadata ({e!r})")


def layer_op_rows(rep: int) -> None:
    """The layer's short convolution + SiLU: PyTorch (model.kda.ShortConv) vs the fused kernel, bf16, fwd and
    fwd+bwd at the issue's first shape (C = 32 heads x 128), one document per row and packed documents."""
    from triton.testing import do_bench

    from moestack.model.kda import ShortConv, _doc_positions
    from moestack.ops.kda.short_conv import short_conv_silu

    B, T, C, W = 1, 32768, 4096, 4
    conv = ShortConv(C, W).cuda()
    conv.init_weights(0.02)
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    cu = torch.tensor([0, 1000, 9000, 20000, T], device="cuda")
    variants = {"torch": lambda x, pos: F.silu(conv(x, pos)),
                "fused": lambda x, pos: short_conv_silu(x, conv.weight, pos)}
    print("\n| layer op | mode | impl | ms | Mtok/s | | speedup |\n|---|---|---|---|---|---|---|", flush=True)
    docs_list = (("1 doc", None), ("4 docs", _doc_positions(T, cu, x.device)))
    for docs, pos in docs_list:
        for backward in (False, True):
            ms = {}
            for name, fn in variants.items():
                try:
                    xi = x.clone().requires_grad_(backward)

                    def run(fn=fn, xi=xi, pos=pos, backward=backward):
                        y = fn(xi, pos)
                        if backward:
                            y.backward(dy)

                    run()
                    ms[name] = do_bench(run, warmup=10, rep=rep, grad_to_none=[xi, conv.weight], return_mode="median")
                except Exception as e:  # report and go on
                    print(f"| conv+silu {B}x{T}x{C} {docs} | {'fwd+bwd' if backward else 'fwd'} | {name} | "
                          f"error: {type(e).__name__}: {str(e)[:160]} | | | |", flush=True)
            for name, t in ms.items():
                sp = f"{ms['torch'] / t:.2f} vs torch" if "torch" in ms and name != "torch" else ""
                print(f"| conv+silu {B}x{T}x{C} {docs} | {'fwd+bwd' if backward else 'fwd'} | {name} | {t:.3f} | "
                      f"{B * T / t / 1e3:.2f} | | {sp} |", flush=True)


def gated_norm_rows(rep: int) -> None:
    """The layer's output RMSNorm * sigmoid gate: PyTorch (model.kda's form) vs the fused kernel, bf16."""
    from triton.testing import do_bench

    from moestack.model.norm import RMSNorm
    from moestack.ops.kda.gated_norm import gated_rmsnorm

    shape = (1, 32768, 32, 128)
    norm = RMSNorm(128, eps=1e-6).cuda()
    o, z = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dy = torch.randn_like(o)
    variants = {"torch": lambda o, z: norm(o).to(z.dtype) * torch.sigmoid(z),
                "fused": lambda o, z: gated_rmsnorm(o, z, norm.weight, norm.eps)}
    for backward in (False, True):
        ms = {}
        for name, fn in variants.items():
            try:
                ins = [t.clone().requires_grad_(backward) for t in (o, z)]

                def run(fn=fn, ins=ins, backward=backward):
                    y = fn(*ins)
                    if backward:
                        y.backward(dy)

                run()
                ms[name] = do_bench(run, warmup=10, rep=rep, grad_to_none=[*ins, norm.weight], return_mode="median")
            except Exception as e:  # report and go on
                print(f"| gated rmsnorm 1x32768x32x128 | {'fwd+bwd' if backward else 'fwd'} | {name} | "
                      f"error: {type(e).__name__}: {str(e)[:160]} | | | |", flush=True)
        for name, t in ms.items():
            sp = f"{ms['torch'] / t:.2f} vs torch" if "torch" in ms and name != "torch" else ""
            print(f"| gated rmsnorm 1x32768x32x128 | {'fwd+bwd' if backward else 'fwd'} | {name} | {t:.3f} | "
                  f"{32768 / t / 1e3:.2f} | | {sp} |", flush=True)


def _fla_installed() -> bool:
    """fla-core is optional (carried to the GPU as a wheel): without it, one '|' row says so and ours runs alone."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        print("| fla | - | fla | not installed (pip install fla-core==0.6.0): no side-by-side | | | |")
        return False
    return True


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="BxTxHxD, D = dk = dv")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--save-mode", action="store_true", help="(default now) ours with recompute=False too")
    p.add_argument("--backends", nargs="*", default=None, help="subset of: ours ours-save fla")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--budget-s", type=float, default=110.0,
                   help="skip the remaining variants (a '|' row each) once this many seconds have passed")
    p.add_argument("--breakdown", action="store_true", help="also time each of our kernels")
    p.add_argument("--fla-ref", nargs=2, type=float, default=None, metavar=("FWD_MS", "FWDBWD_MS"),
                   help="fla's fwd and fwd+bwd ms at the first shape, measured elsewhere (fla's autotune takes "
                        "~100 s): used for the speedup column and labelled as such")
    p.add_argument("--fla-ref-source", default="H200 2026-11-29: fwd run2 same-process, fwd+bwd previous session",
                   help="where the --fla-ref numbers come from (printed with them)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-layer-ops", action="store_true", help="skip the short conv + SiLU rows")
    p.add_argument("--autotune", action="store_true",
                   help="autotune the two recurrences over their config lists (default: their first config, as "
                        "KernelSpec.autotune=False; the other kernels have one fixed config)")
    args = p.parse_args()
    from moestack.ops.launch import set_autotune

    set_autotune(args.autotune)

    t_start = time.perf_counter()
    names = ["ours", "ours-save"] + ([] if args.no_fla or not _fla_installed() else ["fla"])
    names = args.backends or names
    results = []
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for shape in args.shapes:
        B, T, H, D = (int(s) for s in shape.split("x"))
        x = make_inputs(B, T, H, D)
        flops = kda_flops(B, T, H, D)
        outs = {}
        for backward in (False, True):
            for name in names:
                mode = "fwd+bwd" if backward else "fwd"
                if name.startswith("ours-save") and not backward:
                    continue  # the same forward as "ours" (plus stores)
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"| {shape} | {mode} | {name} | skipped: time budget ({args.budget_s:.0f} s) spent | | | |")
                    continue
                try:
                    run, ins = runner(name, x, backward)
                    for t in ins:  # inputs are shared across variants: start each from empty grads
                        t.grad = None
                    t0 = time.perf_counter()
                    o = run()  # warm-up: compiles and autotunes
                    torch.cuda.synchronize()
                    warm = time.perf_counter() - t0
                    if backward:
                        outs[name] = [o.detach()] + [t.grad.detach().clone() for t in ins]
                    ms = do_bench(run, warmup=25, rep=args.rep, grad_to_none=ins if backward else None,
                                  return_mode="median")
                except Exception as e:  # one failing variant (fla missing, a compile error) must not stop the rest
                    print(f"| {shape} | {mode} | {name} | error: {type(e).__name__}: {str(e)[:160]} | | | |",
                          flush=True)
                    torch.cuda.empty_cache()
                    continue
                r = dict(shape=shape, name=name, mode=mode, ms=ms, warmup_s=warm,
                         tok_s=B * T / ms * 1e3, tflops=flops * (3 if backward else 1) / ms * 1e-9)
                results.append(r)
                print(f"  {shape} {r['mode']:8s} {name:10s} {ms:8.3f} ms  (warm-up {warm:.1f} s)", flush=True)
                del run, ins
                torch.cuda.empty_cache()
        if args.breakdown and "ours" in names:
            for step, ms in breakdown(x, args.rep).items():
                results.append(dict(shape=shape, name="ours kernel", mode=step, ms=ms, tok_s=B * T / ms * 1e3,
                                    tflops=0.0))
                print(f"  {shape} kernel {step:45s} {ms:8.3f} ms", flush=True)
        names_o = ("o", "dq", "dk", "dv", "dg", "dbeta")
        if "fla" in outs and "ours" in outs:
            errs = {n: rel_rms(a, b) for n, a, b in zip(names_o, outs["ours"], outs["fla"])}
            print(f"  {shape} ours vs fla rel-RMS: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()), flush=True)
            for r in results:
                if r["shape"] == shape and r["name"] == "ours":
                    r["vs_fla"] = errs
        del x, outs
        torch.cuda.empty_cache()

    if "ours" in names:
        kernel_report()
    if not args.no_layer_ops:
        layer_op_rows(args.rep)
        gated_norm_rows(args.rep)
    print("\n| shape BxTxHxD | mode | backend | ms | Mtok/s | TFLOP/s | speedup vs fla |")
    print("|---|---|---|---|---|---|---|")
    fla_ms = {(r["shape"], r["mode"]): r["ms"] for r in results if r["name"] == "fla"}
    if args.fla_ref:
        for mode, ms in zip(("fwd", "fwd+bwd"), args.fla_ref):
            fla_ms.setdefault((args.shapes[0], mode), ms)
            print(f"| {args.shapes[0]} | {mode} | fla (reference, not this run: {args.fla_ref_source}) | {ms:.3f} "
                  f"| | | |")
    for r in results:
        ref = fla_ms.get((r["shape"], r["mode"]))
        sp = f"{ref / r['ms']:.2f}" if ref and r["name"] != "fla" else ""
        print(f"| {r['shape']} | {r['mode']} | {r['name']} | {r['ms']:.3f} | {r['tok_s'] / 1e6:.2f} | "
              f"{r['tflops']:.1f} | {sp} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
