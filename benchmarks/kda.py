"""KDA: moestack's Triton kernels vs fla-core's chunk_kda, same process, same inputs.

    python3 benchmarks/kda.py                      # the three issue shapes, forward and forward+backward
    python3 benchmarks/kda.py --shapes 1x4096x8x128 --no-fla
    python3 benchmarks/kda.py --quick --fla-ref 4.083 21.1    # < 90 s: headline shape, old vs new variants
    python3 benchmarks/kda.py --bwd-quick --fla-ref 4.083 21.1    # < 110 s: the phase-C backward variants,
                                                                  # end to end and per kernel, headline shape

Variants of ours (same process, same inputs): "ours" (recompute in backward), "ours-save" (recompute=False), and
suffixes "+bf16" (MOESTACK_KDA_INTRA_DOTS=bf16: K1's score and WY dots with bf16 operands), "+k1=BKS:warps"
(MOESTACK_KDA_K1: a fixed intra-kernel config) and "+k2=BV:warps" (MOESTACK_KDA_K2: a fixed forward-recurrence
config), "+b3a=BV:BKS:warps[:maxnreg]" / "+b3b=BKC:warps[:maxnreg]" (MOESTACK_KDA_B3A / _B3B: fixed backward
per-chunk kernel configs), "+xs" (MOESTACK_KDA_BWD_X=saved: K1 writes X and Akk, B3a reads them and W instead of
recomputing), "+bbf16"
(MOESTACK_KDA_BWD_DOTS=bf16: B3a's WY dots and B3b's score-gradient dots with bf16 operands), "+split" /
"+narrow" / "+joined" (MOESTACK_KDA_B3B_FORM: B3b without the inline exact path / also with stripe-sized
operands / also with two stacked dots per stripe instead of four),
"+k1split" (MOESTACK_KDA_K1_EXACT=split: K1 likewise in two launches), "+k1join" (MOESTACK_KDA_K1_JOIN=1: K1's
Akk and Aqk dots stacked into one per stripe), e.g.
"ours-save+bf16+k1=16:4+k2=16:4+b3b=16:4+xs+bbf16".

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
import os
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = ["1x32768x32x128", "2x8192x96x128", "8x4096x20x128"]  # B x T x H x D
# --quick: the measured defaults next to the new variants (old first, so a budget cut drops new ones)
QUICK_BACKENDS = ["ours", "ours-save", "ours+bf16", "ours+k1=16:4", "ours+bf16+k1=16:4", "ours-save+bf16+k1=16:4",
                  "ours+bf16+k1=16:4+k2=16:4", "ours-save+b3b=16:4", "ours-save+bf16+k1=16:4+b3b=16:4"]
# --bwd-quick: the current default, the best measured opt-in stack (run 4: 21.56 ms), then the phase-C variants on
# top of it, the likely best first (a budget cut drops the attribution rows at the end)
_BEST = "ours-save+bf16+k1=16:4+b3b=16:4"
BWD_QUICK_BACKENDS = [
    "ours", _BEST, _BEST + "+xs+bbf16", _BEST + "+xs+bbf16+split+k1split", _BEST + "+xs+bbf16+joined+k1join",
    _BEST + "+xs+bbf16+split+k1join", "ours-save+bf16+k1=16:4+b3b=16:4:168+xs+bbf16+split+k1split",
    _BEST + "+xs", _BEST + "+bbf16", _BEST + "+xs+bbf16+split", _BEST + "+xs+bbf16+narrow+k1split",
    "ours-save+bf16+k1=32:4+b3b=16:4+xs+bbf16+split+k1split", "ours+bf16+k1=16:4+b3b=16:4+xs+bbf16+split+k1split"]


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


def _variant_env(name: str) -> dict:
    """Environment switches of an "ours..." variant name (module docstring)."""
    env = {}
    for part in name.split("+")[1:]:
        if part == "bf16":
            env["MOESTACK_KDA_INTRA_DOTS"] = "bf16"
        elif part.startswith("k1="):
            env["MOESTACK_KDA_K1"] = part[3:]
        elif part.startswith("k2="):
            env["MOESTACK_KDA_K2"] = part[3:]
        elif part.startswith("b3a="):
            env["MOESTACK_KDA_B3A"] = part[4:]
        elif part.startswith("b3b="):
            env["MOESTACK_KDA_B3B"] = part[4:]
        elif part == "xs":
            env["MOESTACK_KDA_BWD_X"] = "saved"
        elif part == "bbf16":
            env["MOESTACK_KDA_BWD_DOTS"] = "bf16"
        elif part in ("split", "narrow", "joined"):
            env["MOESTACK_KDA_B3B_FORM"] = part
        elif part == "k1split":
            env["MOESTACK_KDA_K1_EXACT"] = "split"
        elif part == "k1join":
            env["MOESTACK_KDA_K1_JOIN"] = "1"
        else:
            raise ValueError(f"unknown variant suffix '+{part}' in backend '{name}' (use +bf16, +k1=BKS:warps, "
                             "+k2=BV:warps, +b3a=BV:BKS:warps, +b3b=BKC:warps, +xs, +bbf16, +split, +narrow, "
                             "+joined, +k1split or +k1join)")
    return env


class _env_set:
    """Set environment variables for the duration of a with-block (the switches are read per call)."""

    def __init__(self, env: dict):
        self.env, self.old = env, {}

    def __enter__(self):
        for n, val in self.env.items():
            self.old[n] = os.environ.get(n)
            os.environ[n] = val

    def __exit__(self, *exc):
        for n, val in self.old.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val


def runner(name: str, x: dict, backward: bool):
    """A closure running one forward (and backward) of backend `name` on inputs x."""
    env = {}
    if name == "fla":
        from fla.ops.kda import chunk_kda

        def fwd(q, k, v, g, beta):
            return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    else:
        from moestack.ops.kda.triton_op import kda_fused

        env = _variant_env(name)
        recompute = not name.startswith("ours-save")

        def fwd(q, k, v, g, beta):
            return kda_fused(q, k, v, g, beta, gate="none", l2norm=True, beta_sigmoid=False, recompute=recompute)[0]

    ins = [x[n].clone().requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")]
    # the same upstream gradient for every variant (a fresh randn_like per variant made the gradient comparisons
    # of "ours vs fla" and "rel-RMS vs ours" compare unrelated gradients: rel-RMS ~1.4 = sqrt(2))
    gen = torch.Generator(device=x["v"].device).manual_seed(1234)
    do = torch.randn(x["v"].shape, generator=gen, device=x["v"].device, dtype=x["v"].dtype) if backward else None

    def run():
        with _env_set(env):
            o = fwd(*ins)
            if backward:
                o.backward(do)
        return o

    return run, ins


K2_CONFIGS = ("16:4", "32:4", "64:8")  # K2 (BV, warps) variants the breakdown times next to the default
K1_VARIANTS = (("bf16", None), ("tf32", "16:4"), ("bf16", "16:4"), ("bf16", "32:4"), ("bf16", "16:8:128"))  # (dots, BKS:warps) likewise


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
    for dots, cfg in K1_VARIANTS:
        steps[f"fwd intra (K1) dots={dots} BKS:warps={cfg}"] = lambda dots=dots, cfg=cfg: tf.kda_fwd_intra(
            q, k, v, g, beta, None, None, cmap, cu, beta_sigmoid=False, inter_dtype=q.dtype, intra_dots=dots,
            k1_config=cfg, **kw)
    steps["fwd recurrence + output (K2)"] = lambda: tf.kda_fwd_recurrence(intra, None, offs, cu, store_o=True,
                                                                         store_states=False, **rec)
    for cfg in K2_CONFIGS:
        steps[f"fwd recurrence + output (K2) BV:warps={cfg}"] = lambda cfg=cfg: tf.kda_fwd_recurrence(
            intra, None, offs, cu, store_o=True, store_states=False, k2_config=cfg, **rec)
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


def bwd_variant_breakdown(x: dict, rep: int, deadline: float) -> dict:
    """Median ms of K1 and the backward kernels in each phase-C variant next to the current ones, on inputs x (as
    breakdown). Variants past `deadline` (perf_counter seconds) are skipped with a '|' row each."""
    from triton.testing import do_bench

    from moestack.ops.kda import triton_bwd as tb
    from moestack.ops.kda import triton_fwd as tf
    from moestack.ops.kda.triton_op import _chunk_layout

    B, T, _, K = x["q"].shape
    V = x["v"].shape[-1]
    q, k, v, g, beta = (x[n].reshape(B * T, *x[n].shape[2:]).contiguous() for n in ("q", "k", "v", "g", "beta"))
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32) * T
    cmap, offs = _chunk_layout(cu, B * T)
    kw = dict(scale=K**-0.5, gate=0, lower_bound=-5.0, l2norm=True)
    fkw = dict(beta_sigmoid=False, inter_dtype=q.dtype, **kw)

    def k1(dots, cfg, store_x, exact="inline", wy=None, join=False):
        def run():
            with _env_set({"MOESTACK_KDA_K1_JOIN": "1"} if join else {}):
                return tf.kda_fwd_intra(q, k, v, g, beta, None, None, cmap, cu, intra_dots=dots, k1_config=cfg,
                                        store_x=store_x, k1_exact=exact, k1_wy=wy, **fkw)
        return run

    steps = {
        "K1 tf32 16:4 (default)": k1("tf32", "16:4", False),
        "K1 bf16 16:4 +store X, joined": k1("bf16", "16:4", True, "split", join=True),
        "K1 bf16 16:4 +store X, split": k1("bf16", "16:4", True, "split"),
        "K1 bf16 32:8 +store X, joined": k1("bf16", "32:8", True, "split", join=True),
        "K1 bf16 32:4 +store X, split": k1("bf16", "32:4", True, "split"),
        "K1 bf16 16:4 +store X, split, W/U by 64": k1("bf16", "16:4", True, "split", 64),
        "K1 bf16 16:4 +store X, split, W/U by 32": k1("bf16", "16:4", True, "split", 32),
        "K1 bf16 16:4 +store X": k1("bf16", "16:4", True),
        "K1 tf32 16:4 split": k1("tf32", "16:4", False, "split"),
        "K1 bf16 16:4 +store X, split, maxnreg 168": k1("bf16", "16:4:168", True, "split"),
        "K1 bf16 16:4": k1("bf16", "16:4", False),
    }
    intra = k1("bf16", "16:4", True)()  # with xinv / akk; the recompute-X kernels do not read them
    intra_plain = {n: t for n, t in intra.items() if n not in ("xinv", "akk")}
    _, _, h, d = tf.kda_fwd_recurrence(intra, None, offs, cu, n_seqs=B, V=V, out_dtype=v.dtype, store_o=False,
                                       store_ht=False, store_states=True)
    do = torch.randn_like(v)
    steps["B2 bwd recurrence"] = lambda: tb.kda_bwd_recurrence(intra, do, None, offs, cu, n_seqs=B, V=V,
                                                               need_dh0=False)
    dh, dd, _ = steps["B2 bwd recurrence"]()

    def b3a(saved, lowp, env):
        src = intra if saved else intra_plain

        def run():
            with _env_set(env):
                return tb.kda_bwd_wy(k, v, beta, src, cmap, cu, h, dh, d, dd, do, beta_sigmoid=False, lowp=lowp)
        return run

    for label, saved, lowp, env in (
            ("B3a (default, 32:32:8)", False, False, {}), ("B3a saved X + bf16", True, True, {}),
            ("B3a saved X", True, False, {}),
            ("B3a saved X + bf16, 64:64:8", True, True, {"MOESTACK_KDA_B3A": "64:64:8"}),
            ("B3a saved X + bf16, 32:16:4", True, True, {"MOESTACK_KDA_B3A": "32:16:4"}),
            ("B3a bf16", False, True, {})):
        steps[label] = b3a(saved, lowp, env)
    part = steps["B3a (default, 32:32:8)"]()[2]

    def b3b(lowp, form, cfg):
        env = {"MOESTACK_KDA_B3B": cfg} if cfg else {}

        def run():
            with _env_set(env):
                return tb.kda_bwd_scores(q, k, g, None, None, intra, cmap, cu, dict(part), lowp=lowp, form=form,
                                         **kw)
        return run

    for lowp, form, cfg in ((False, "masked", "16:4"), (True, "split", "16:4"), (True, "joined", "16:4"),
                            (True, "joined", None), (False, "joined", "16:4"), (True, "split", "32:4"),
                            (True, "split", "16:4:168"),
                            (False, "split", "16:4:168"), (True, "split", None),
                            (True, "narrow", None), (False, "split", "16:4"), (True, "masked", "16:4"),
                            (True, "narrow", "16:4"), (False, "masked", None)):
        steps[f"B3b {'bf16' if lowp else 'tf32'} {form} {cfg or '32:8'}"] = b3b(lowp, form, cfg)
    first = ("K1 tf32 16:4 (default)", "K1 bf16 16:4 +store X, joined", "K1 bf16 16:4 +store X, split",
             "B3a (default, 32:32:8)", "B3a saved X + bf16", "B3a saved X + bf16, 64:64:8", "B3b tf32 masked 16:4",
             "B3b bf16 split 16:4",
             "B3b bf16 joined 16:4", "B3b bf16 joined 32:8", "B3b bf16 split 32:8", "B2 bwd recurrence")
    out = {}
    for name in [n for n in first if n in steps] + [n for n in steps if n not in first]:  # budget: these first
        fn = steps[name]
        if time.perf_counter() > deadline:
            print(f"| kernel {name} | skipped: time budget | | | | | |", flush=True)
            continue
        try:
            fn()
            out[name] = do_bench(fn, warmup=25, rep=rep, return_mode="median")
            print(f"  kernel {name:45s} {out[name]:8.3f} ms", flush=True)
        except Exception as e:  # one failing variant must not stop the rest
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


def layer_op_rows(rep: int, quick: bool = False) -> None:
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
                "fused": lambda x, pos: short_conv_silu(x, conv.weight, pos, bwd="fused"),
                "fused, two-pass bwd": lambda x, pos: short_conv_silu(x, conv.weight, pos, bwd="two_pass")}
    print("\n| layer op | mode | impl | ms | Mtok/s | | speedup |\n|---|---|---|---|---|---|---|", flush=True)
    docs_list = (("1 doc", None),) if quick else (("1 doc", None), ("4 docs", _doc_positions(T, cu, x.device)))
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
    p.add_argument("--quick", action="store_true",
                   help="< 90 s on an H200: the first shape only, no fla, ours old vs new variants, kernel breakdown, "
                        "short conv rows")
    p.add_argument("--bwd-quick", action="store_true",
                   help="< 110 s on an H200: the first shape only, no fla, the phase-C variants (K1 storing X, "
                        "B3a reading it, bf16 backward dots, split / narrow B3b, split K1) end to end next to the "
                        "default and the best opt-in stack, then per kernel")
    p.add_argument("--fla-ref", nargs=2, type=float, default=None, metavar=("FWD_MS", "FWDBWD_MS"),
                   help="fla's fwd and fwd+bwd ms at the first shape, measured elsewhere (fla's autotune takes "
                        "~100 s): used for the speedup column and labelled as such")
    p.add_argument("--fla-ref-source", default="H200 2026-11-29: fwd run2 same-process, fwd+bwd previous session",
                   help="where the --fla-ref numbers come from (printed with them)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-layer-ops", action="store_true", help="skip the short conv + SiLU rows")
    p.add_argument("--autotune", action="store_true",
                   help="autotune our kernels over their full config lists (default: the first config of each, "
                        "MOESTACK_KDA_AUTOTUNE=0, chosen from ptxas register/spill reports; saves ~1 min of compiles)")
    args = p.parse_args()
    if not args.autotune:
        os.environ.setdefault("MOESTACK_KDA_AUTOTUNE", "0")  # read when the kernels are decorated (first import)

    t_start = time.perf_counter()
    if args.quick:
        args.shapes, args.no_fla, args.breakdown, args.rep = args.shapes[:1], True, True, 200
        args.budget_s = min(args.budget_s, 60.0)
        args.backends = args.backends or QUICK_BACKENDS
    if args.bwd_quick:
        args.shapes, args.no_fla, args.rep, args.no_layer_ops = args.shapes[:1], True, 100, True
        args.budget_s = min(args.budget_s, 60.0)  # end-to-end rows; the per-kernel rows stop at 100 s
        args.backends = args.backends or BWD_QUICK_BACKENDS
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
        if args.bwd_quick:
            for step, ms in bwd_variant_breakdown(x, args.rep, t_start + 100.0).items():
                results.append(dict(shape=shape, name="ours kernel", mode=step, ms=ms, tok_s=B * T / ms * 1e3,
                                    tflops=0.0))
        if args.breakdown and "ours" in names:
            for step, ms in breakdown(x, args.rep, skip_bwd=args.quick).items():
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
        for name in outs:  # variants against the default (the GPU tests check each against the fp64 reference)
            if name.startswith("ours") and name != "ours" and "ours" in outs:
                errs = {n: rel_rms(a, b) for n, a, b in zip(names_o, outs[name], outs["ours"])}
                print(f"| {shape} | rel-RMS vs ours | {name} | " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())
                      + " | | | |", flush=True)
        del x, outs
        torch.cuda.empty_cache()

    if "ours" in names:
        kernel_report()
    if not args.no_layer_ops:
        layer_op_rows(args.rep, quick=args.quick)
        if not args.quick:
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
