"""One KDA switch set per process: correctness against the fp64 reference, then fwd+bwd time at the issue shape.

    MOESTACK_KDA_BWD_X=saved python3 benchmarks/kda_switch_check.py [--recompute] [--no-time]
    python3 benchmarks/kda_switch_check.py --all        # every set in SETS, one process each, < 200 s

Run one process per switch set (env), so that a kernel that faults (illegal memory access) or returns NaN is
named on its own '|' row and does not poison the others' CUDA context. Correctness: varlen K3 gates, bf16,
T = 1000, H = 4, K = V = 128, initial states (as tests/ops/test_kda_triton.py::test_gpu_bwd_variants), rel. RMS of
the output, final state and every gradient vs the fp64 chunked reference (bounds 5e-3 / 1e-2). Time: fwd+bwd
median ms at 1x32768x32x128 (inputs as benchmarks/kda.py), save mode unless --recompute.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "ops"))


_PRE_V6 = "INTRA_DOTS=tf32 BWD_DOTS=tf32 BWD_X=recompute B3B_FORM=masked K1_EXACT=inline"  # defaults < session 4
SETS = [  # (switches without the MOESTACK_KDA_ prefix, extra args), the most telling first
    ("", ""), ("", "--recompute"),  # the defaults (session 4: bf16 K1 dots, BWD_DOTS=wy, saved X, split forms)
    ("BWD_DOTS=tf32", ""), ("BWD_DOTS=tf32", "--recompute"),  # no bf16 in the backward (same dg precision)
    ("BWD_DOTS=bf16", ""),  # session 4 call 1's default: 16.06 ms save, but dg 4-5e-2 vs fp64
    (_PRE_V6, ""),  # the previous defaults (session 3's 23.79 ms)
    ("B3A=64:32:8 BWD_DOTS=bf16", "--no-time"),  # NaN in call 1 (with 32:32:8): still?
]


def run_isolated(script: str, switches: str, extra: list[str], timeout_s: float) -> tuple[list[str], str]:
    """Run `script` in a fresh process with only these KDA switches set (space-separated NAME=value, the
    MOESTACK_KDA_ prefix optional) and MOESTACK_KDA_AUTOTUNE=0: a kernel that faults or returns NaN poisons only
    its own CUDA context. Returns (its '|' rows, "" or a note on why there are none)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("MOESTACK_KDA_")}
    for kv in switches.split():
        name, value = kv.split("=", 1)
        env[name if name.startswith("MOESTACK_KDA_") else f"MOESTACK_KDA_{name}"] = value
    env["MOESTACK_KDA_AUTOTUNE"] = "0"
    try:
        r = subprocess.run([sys.executable, script, *extra], env=env, capture_output=True, text=True,
                           timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return [], "timeout"
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    tail = (r.stderr.strip().splitlines() or [""])[-1][:150]
    return rows, "" if rows else f"no result, rc={r.returncode}: {tail}"


def run_all(budget_s: float = 190.0) -> None:
    """Each set in its own process (run_isolated), within budget_s."""
    import time

    t0 = time.perf_counter()
    print("| switches (MOESTACK_KDA_*) | mode | varlen bf16 check vs fp64 | fwd+bwd 1x32768x32x128 | errors |",
          flush=True)
    for sw, extra in SETS:
        left = budget_s - (time.perf_counter() - t0)
        if left < 8:
            print(f"| {sw or 'default'} | | skipped: time budget | | |", flush=True)
            continue
        rows, note = run_isolated(__file__, sw, extra.split(), min(30.0, left))
        print(rows[-1] if rows else f"| {sw or 'default'} | | {note} | | |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--all", action="store_true")
    args = p.parse_args()
    if args.all:
        run_all()
        return
    env = " ".join(f"{k[len('MOESTACK_KDA_'):]}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("MOESTACK_KDA_") and k != "MOESTACK_KDA_AUTOTUNE") or "default"
    mode = "recompute" if args.recompute else "save"
    from test_kda_triton import GPU_TOL_GRAD, GPU_TOL_OUT, check, make_inputs

    status, errs = "ok", {}
    cu = torch.tensor([0, 17, 300, 301, 1000], dtype=torch.int32, device="cuda")
    x = make_inputs(1, 1000, 4, 128, 128, n_seqs=4, gate="k3", dtype=torch.bfloat16, device="cuda", seed=97)
    try:
        errs = check(x, gate="k3", cu_seqlens=cu, recompute=args.recompute, tol_out=GPU_TOL_OUT,
                     tol_grad=GPU_TOL_GRAD)
    except AssertionError as e:
        status = "FAIL " + str(e).split("(all")[0][:120].replace("|", "/")
    except Exception as e:  # a faulting kernel: report it on this row, nothing else runs in this context
        print(f"| {env} | {mode} | ERROR {type(e).__name__}: {str(e)[:120]} | |", flush=True)
        return
    ms = ""
    if not args.no_time and status == "ok":
        from triton.testing import do_bench

        sys.path.insert(0, os.path.dirname(__file__))
        from kda import make_inputs as bench_inputs

        from moestack.ops.kda.triton_op import kda_fused

        xb = bench_inputs(1, 32768, 32, 128)
        ins = [xb[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
        do = torch.randn_like(xb["v"])

        def run():
            o = kda_fused(*ins, gate="none", l2norm=True, beta_sigmoid=False, recompute=args.recompute)[0]
            o.backward(do)

        try:
            run()
            ms = f"{do_bench(run, warmup=5, rep=60, grad_to_none=ins, return_mode='median'):.3f}"
        except Exception as e:  # report and stop
            ms = f"ERROR {type(e).__name__}: {str(e)[:80]}"
    worst = " ".join(f"{n}={e:.1e}" for n, e in errs.items())
    print(f"| {env} | {mode} | {status} | fwd+bwd ms {ms} | {worst} |", flush=True)


if __name__ == "__main__":
    main()
