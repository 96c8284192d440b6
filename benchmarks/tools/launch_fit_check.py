"""Check moestack/ops/launch.py's shared-memory estimates against the compiler, for sm_90, without a GPU.

    python benchmarks/tools/launch_fit_check.py [GROUP or FAMILY ...] [--limit 232448] [--hints] [--ptxas]

Every autotune config of every pruned kernel family (launch.SMEM) and the fixed-config kernels, at the widths of
every preset (moestack/config/presets) and tests/data/hf_configs (through moestack/config/hf.py) plus the largest
widths the ops accept, compiled with Triton's own compiler for sm_90a (benchmarks/tools/ptx.py). One '|' row each:
the compiled kernel's shared memory, the estimate, and a flag:
    UNDER   the estimate is below the compiled size (a config could be kept that does not fit: fix the estimate)
    DROP    the estimate is over --limit but the compiled kernel fits (a config that runs would be pruned)
    BIG     the compiled kernel does not fit --limit (the H200's 232448 B by default): the pruner must drop it
and a summary line with the largest over-estimate ratio. Integer arguments carry no divisibility hints unless
--hints (a launch with unaligned widths compiles without them, and that is the larger kernel). ~3 s per compile on
a CPU core: the whole run takes ~10 minutes; name families to run fewer.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ptx import compile_sm90, jit_fn, ptxas_info  # noqa: E402

from moestack.ops import launch  # noqa: E402

H200_SMEM = 232448
BF16, FP32, FP8 = (torch.empty(0, dtype=d) for d in (torch.bfloat16, torch.float32, torch.float8_e4m3fn))


def model_widths() -> dict[str, set]:
    """The widths the sweep covers: every preset and every tests/data/hf_configs config (as hf.py adapts it)."""
    from moestack.config import load_model_spec
    from moestack.config.hf import load_hf_config

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    specs = [load_model_spec(n) for n in ("tiny", "proxy", "kimi-k3", "kimi-k3.1-pro")]
    specs += [load_hf_config(p).spec for p in sorted(glob.glob(os.path.join(root, "tests/data/hf_configs/*.json")))]
    out = {"kda_k": set(), "mla": set(), "indexer_d": set(), "moe": set()}
    for s in specs:
        if s.linear_attention == "kda" and s.kda is not None:
            out["kda_k"].add(s.kda.head_dim)
        if s.attention == "mla" and s.mla is not None:
            m = s.mla
            out["mla"].add((m.kv_lora_rank, m.qk_rope_head_dim))
            if m.indexer is not None:
                out["indexer_d"].add(m.indexer.head_dim)
        if s.moe is not None:
            out["moe"].add((s.moe.latent_size or s.hidden_size, s.moe.expert_intermediate_size))
    out["kda_k"].add(256)  # the largest head dim the Triton KDA takes
    return out


def _sig(kern, ptrs: dict, ints: set, floats: set = frozenset(), default: str = "*bf16") -> dict:
    sig = {}
    for n in jit_fn(kern).arg_names:
        if n in ptrs:
            sig[n] = ptrs[n]
        elif n in ints or n.startswith(("s_", "stride")):
            sig[n] = "i32"
        elif n in floats:
            sig[n] = "fp32"
        else:
            sig[n] = default
    return sig


def _configs(kern):
    return list(getattr(kern, "configs", None) or [])


# ---- cases per family: (label, kernel, signature, constexprs, warps, stages, estimate args) ----------------------


def dsa_cases(w):
    from moestack.ops.dsa import triton_attn_bwd as B
    from moestack.ops.dsa import triton_attn_fwd as F
    from moestack.ops.dsa import triton_indexer as I
    from moestack.ops.dsa import triton_indexer_fused as X

    sizes = {"T", "H", "K", "n0", "n", "HP", "t0", "t1", "Hi", "n_cols"}
    floats = {"scale", "scale_log2"}
    for (V, R), dt in ((vr, dt) for vr in sorted(w["mla"]) for dt in w["dsa_dtypes"]):
        VP, RP = F.padded_dims(V, R)
        dims = {"V": V, "R": R, "VP": VP, "RP": RP}
        t = {"bf16": BF16, "fp32": FP32}[dt]
        est = {"Q": t, "KV": t, **dims}
        ptr = "*" + dt
        k = F._sparse_mqa_fwd_kernel
        for c in F.fwd_configs():
            kw = {**c.kwargs, "BLOCK_V": min(c.kwargs["BLOCK_V"], VP)}  # as prune_head_blocks clamps it
            yield ("dsa", f"fwd {dt} V{V} R{R} {kw}", k,
                   _sig(k, {"IDX": "*i32", "LSE": "*fp32"}, sizes, floats, ptr), {**dims, **kw}, c.num_warps,
                   c.num_stages, est)
        k = B._sparse_mqa_bwd_kernel_dkv
        ptrs = {"IDX": "*i32", "LSE": "*fp32", "DELTA": "*fp32", "DKV": "*fp32"}
        for out in ("atomic", "rows"):
            for c in B._dkv_ds_configs():
                yield ("dsa_dkv", f"dkv {dt} {out} V{V} {c.kwargs}", k, _sig(k, ptrs, sizes, floats, ptr),
                       {**dims, **c.kwargs, "DKV_OUT": out, "TOKEN_TILE": B.TOKEN_TILE}, c.num_warps, c.num_stages,
                       est)
        k = B._sparse_mqa_bwd_kernel_dq
        for c in B._bwd_configs(B._DQ_DS_SHAPES):
            yield ("dsa_dq", f"dq {dt} V{V} {c.kwargs}", k, _sig(k, {"IDX": "*i32"}, sizes, floats, ptr),
                   {**dims, **c.kwargs}, c.num_warps, c.num_stages, est)
        k = I._probs_target_kernel
        for c in I._target_configs():
            yield ("dsa_target", f"kl target {dt} V{V} {c.kwargs}", k, _sig(k, {"IDX": "*i32", "LSE": "*fp32",
                   "P": "*fp32"}, sizes, floats, ptr), {**dims, **c.kwargs}, c.num_warps, c.num_stages, est)
    for Di in sorted(w["indexer_d"]):
        DP = max(16, 1 << (Di - 1).bit_length())
        est = {"Q": BF16, "KI": BF16, "DP": DP}
        k = X.indexer_select_kernel
        ptrs = {"W": "*fp32", "DSTART": "*i32", "THR": "*fp32", "CNT": "*i32", "OUT_S": "*fp32", "OUT_I": "*i32"}
        for mode in (X.MODE_SELECT, X.MODE_DENSE):
            for c in X._configs():
                yield ("indexer", f"indexer select mode {mode} Di{Di} {c.kwargs}", k, _sig(k, ptrs, sizes),
                       {"Di": Di, "DP": DP, "KEY_STRIDE": 1 if mode else 16, "MODE": mode, "CAP": 4096,
                        "HAS_DOC": False, **c.kwargs}, c.num_warps, c.num_stages, est)
        k = I._indexer_scores_kernel
        for c in I._configs():
            yield ("indexer", f"indexer chunked Di{Di} {c.kwargs}", k,
                   _sig(k, {"W": "*fp32", "DOC": "*i32", "OUT": "*fp32"}, sizes),
                   {"Di": Di, "DP": DP, "HAS_DOC": False, **c.kwargs}, c.num_warps, c.num_stages, est)


def kda_cases(w):
    from moestack.ops.kda import triton_bwd as Bw
    from moestack.ops.kda import triton_fwd as F

    F32, I32 = "*fp32", "*i32"
    for K in sorted(w["kda_k"]):
        BK = max(16, 1 << (K - 1).bit_length())
        common = {"K": K, "V": K, "BT": F.BT, "BK": BK}
        est = {"w": BF16, **common}
        k = F.kda_fwd_kernel_recurrence
        for c in _configs(k) + launch._recurrence_fallback():
            yield ("kda_recurrence", f"K2 K{K} {c.kwargs} w{c.num_warps} s{c.num_stages}", k,
                   _sig(k, {"gl": F32, "h0": F32, "chunk_offsets": I32, "cu_seqlens": I32, "ht": F32}, {"H"}),
                   {**common, **c.kwargs, "HAS_H0": False, "STORE_HT": False, "STORE_H": True, "STORE_D": True,
                    "STORE_O": True}, c.num_warps, c.num_stages, est)
        k = Bw.kda_bwd_kernel_recurrence
        for c in _configs(k) + launch._recurrence_fallback():
            yield ("kda_recurrence", f"B2 K{K} {c.kwargs} w{c.num_warps} s{c.num_stages}", k,
                   _sig(k, {"gl": F32, "dht": F32, "chunk_offsets": I32, "cu_seqlens": I32, "dh0": F32}, {"H"}),
                   {**common, **c.kwargs, "HAS_DHT": False, "STORE_DH0": False}, c.num_warps, c.num_stages, est)
        # the fixed-config kernels (their fit is checked at launch by launch.fits with these numbers)
        ptrs = {"g": F32, "beta": F32, "A_log": F32, "dt_bias": F32, "chunk_map": I32, "cu_seqlens": I32,
                "gl": F32, "gc": F32, "rq": F32, "rk": F32, "flag": I32, "xinv": F32}
        for sel in (1, 2):
            yield ("fixed", f"K1 K{K} sel {sel}", F.kda_fwd_kernel_intra,
                   _sig(F.kda_fwd_kernel_intra, ptrs, {"H"}, {"scale"}),
                   {**common, "SUB": F.SUB, "BV": BK, "GATE": 1, "LOWER_BOUND": -5.0, "HAS_DT_BIAS": True,
                    "L2NORM": True, "L2_EPS": 1e-6, "BETA_SIGMOID": False, "SPAN_MAX": F.SPAN_MAX,
                    "BKS": F.K1_CONFIG["BKS"], "LOWP": sel != 2, "STORE_X": True, "SEL": sel},
                   F.K1_CONFIG["num_warps"], 2, None)
        cfg = dict(Bw.B3A_CONFIG)
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        ptrs = {"beta": F32, "gc": F32, "rk": F32, "chunk_map": I32, "cu_seqlens": I32, "dbeta": F32, "p_dqp": F32,
                "p_dkd": F32, "p_dkp": F32, "p_da": F32, "p_dn": F32, "p_dbl": F32, "xinv": F32}
        yield ("fixed", f"B3a K{K}", Bw.kda_bwd_kernel_wy, _sig(Bw.kda_bwd_kernel_wy, ptrs, {"H"}),
               {**common, **cfg, "BETA_SIGMOID": False}, nw, ns, None)
        cfg = dict(Bw.B3B_CONFIG)
        nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
        ptrs = {"g": F32, "A_log": F32, "dt_bias": F32, "gc": F32, "rq": F32, "rk": F32, "flag": I32,
                "chunk_map": I32, "cu_seqlens": I32, "p_dqp": F32, "p_dkd": F32, "p_dkp": F32, "p_da": F32,
                "p_dn": F32, "p_dbl": F32, "dg": F32, "pd_dt": F32, "pd_alog": F32}
        for sel in (1, 2):
            yield ("fixed", f"B3b K{K} sel {sel}", Bw.kda_bwd_kernel_scores,
                   _sig(Bw.kda_bwd_kernel_scores, ptrs, {"H"}, {"scale"}),
                   {"K": K, "BT": F.BT, "SUB": F.SUB, **cfg, "GATE": 1, "LOWER_BOUND": -5.0, "HAS_DT_BIAS": True,
                    "L2NORM": True, "SEL": sel}, nw, ns, None)


def moe_cases(w):
    from moestack.ops.fp8 import grouped_gemm as f8
    from moestack.ops.moe import gg_tma
    from moestack.ops.moe import triton_grouped_gemm as tg

    ints = {"N", "K", "F", "E", "D", "P", "A", "B", "ROWS_BUCKET", "BT_MAX"}
    # the kernels' tiles do not depend on the widths: one aligned and one unaligned width pair covers the layouts
    k = tg.grouped_mm_fwd_swap_kernel
    for c in _configs(k):
        for BT in (16, 32, 64, 128):
            for unit in ("stride_wk", "stride_wf"):  # forward (w^T view of [E, F, D]) and dX (w itself)
                for even in (True, False):
                    consts = {**c.kwargs, "BT": BT, "EVEN_K": even, "BE": 64, "PRECISION": "tf32", "stride_xk": 1,
                              unit: 1, "stride_yf": 1}
                    sig = _sig(k, {"offs": "*i32"}, ints)
                    yield ("gg_swap", f"bf16 swap BT{BT} {c.kwargs} {unit}=1 even {even}", k,
                           {n: t for n, t in sig.items() if n not in consts}, consts, c.num_warps, c.num_stages,
                           {"x": BF16, "BT": BT})
    k = gg_tma.gg_fwd_kernel_tma
    for c in _configs(k):
        BT, BF, BK = c.kwargs["BT"], c.kwargs["BF"], c.kwargs["BK"]
        for kmajor in (True, False):
            w_block = [BF, BK] if kmajor else [BK, BF]
            sig = _sig(k, {"offs": "*i32", "x_desc": f"tensordesc<bf16[{BT}, {BK}]>",
                           "w_desc": f"tensordesc<bf16{w_block}>"}, ints)
            consts = {**c.kwargs, "BE": 64, "PRECISION": "tf32", "W_KMAJOR": kmajor, "stride_yf": 1}
            yield ("gg_tma_fwd", f"bf16 tma fwd {c.kwargs} kmajor {kmajor} w{c.num_warps}", k,
                   {n: t for n, t in sig.items() if n not in consts}, consts, c.num_warps, c.num_stages, {"x": BF16})
    for k, rows in ((gg_tma.gg_wgrad_kernel_tma, "BT"), (gg_tma.gg_wgrad_kernel_large, "RMAX")):
        for c in _configs(k):
            for r in (16, 32, 64) if rows == "BT" else (128,):
                for out in ("bf16", "fp32"):  # dW in the parameters' dtype
                    consts = {**c.kwargs, rows: r, "PRECISION": "tf32", "stride_pa": 1, "stride_qb": 1,
                              "stride_ob": 1, **({"SKIP_ROWS": 128} if rows == "RMAX" else {})}
                    sig = _sig(k, {"offs": "*i32", "out": "*" + out}, ints)
                    yield ("gg_wgrad", f"bf16 wgrad {jit_fn(k).__name__} {rows}{r} out {out} {c.kwargs}", k,
                           {n: t for n, t in sig.items() if n not in consts}, consts, c.num_warps, c.num_stages,
                           {"p": BF16, "out": BF16 if out == "bf16" else FP32, rows: r})
    fp8 = {"qx": "*fp8e4nv", "qw": "*fp8e4nv", "sx": "*fp32", "sw": "*fp32", "offs": "*i32", "qxT": "*fp8e4nv",
           "qdyT": "*fp8e4nv", "sdy": "*fp32", "dw": "*fp32"}
    k = f8.fp8_grouped_mm_fwd_kernel
    for c in _configs(k):
        consts = {**c.kwargs, "BE": 64, "PRECISION": "tf32", "BK": 128, "stride_wk": 1}
        sig = _sig(k, fp8, ints)
        yield ("fp8_mm", f"fp8 fwd {c.kwargs}", k, {n: t for n, t in sig.items() if n not in consts}, consts,
               c.num_warps, c.num_stages, {"qx": FP8, "BK": 128})
    k = f8.fp8_grouped_mm_fwd_swap_kernel
    for c in _configs(k):
        for BT in (16, 32, 64):
            consts = {**c.kwargs, "BT": BT, "BE": 64, "PRECISION": "tf32", "BK": 128}
            yield ("fp8_swap", f"fp8 swap BT{BT} {c.kwargs} w{c.num_warps}", k, _sig(k, fp8, ints), consts,
                   c.num_warps, c.num_stages, {"qx": FP8, "BT": BT, "BK": 128})
    k = f8.fp8_grouped_mm_wgrad_kernel
    for c in _configs(k):
        consts = {**c.kwargs, "BE": 64, "PRECISION": "tf32", "G": 128}
        yield ("fp8_wgrad", f"fp8 wgrad {c.kwargs}", k, _sig(k, fp8, ints), consts, c.num_warps, c.num_stages,
               {"qxT": FP8, "G": 128})


GROUPS = {"dsa": dsa_cases, "kda": kda_cases, "moe": moe_cases}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("only", nargs="*", help=f"groups ({', '.join(GROUPS)}) or families ({', '.join(launch.SMEM)}, "
                   "fixed)")
    p.add_argument("--limit", type=int, default=H200_SMEM)
    p.add_argument("--hints", action="store_true", help="strides and pointers divisible by 16")
    p.add_argument("--ptxas", action="store_true", help="also ptxas's registers and spills per config")
    p.add_argument("--dsa-dtypes", default="bf16,fp32", help="DSA input dtypes (fp32: a model without autocast)")
    a = p.parse_args(argv)
    widths = {**model_widths(), "dsa_dtypes": a.dsa_dtypes.split(",")}
    print(f"widths: {widths}")
    print("| family | case | warps / stages | compiled smem | estimate | flag |")
    print("|---|---|---|---|---|---|")
    worst = {}
    for group, cases in GROUPS.items():
        for fam, label, kern, sig, consts, warps, stages, est in cases(widths):
            if a.only and group not in a.only and fam not in a.only:
                continue
            div = tuple(n for n, t in sig.items() if t.startswith("*") or n.startswith(("s_", "stride"))) \
                if a.hints else ()
            try:
                ck = compile_sm90(kern, sig, consts, warps, stages, divisible=div)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"| {fam} | {label} | {warps} / {stages} | COMPILE ERROR {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]} | | |", flush=True)
                continue
            smem = ck.metadata.shared
            if est is not None:
                e = launch.SMEM[fam](consts, warps, stages, {**consts, **est})  # as a launch passes them
                flag = "UNDER" if e < smem else "DROP" if e > a.limit >= smem else ""
                worst[fam] = max(worst.get(fam, 0.0), e / max(smem, 1))
            else:
                e, flag = "-", ""
            flag += " BIG" if smem > a.limit else ""
            regs = f" | {ptxas_info(ck)}" if a.ptxas else ""
            print(f"| {fam} | {label} | {warps} / {stages} | {smem} | {e} | {flag.strip()}{regs} |", flush=True)
    print("largest estimate / compiled per family: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
