"""`moestack plan`, `moestack tune` and `moestack tune-comm` (registered by moestack/cli/app.py; `--help` lists
each command's options). tune-comm measures under torchrun (>= 2 ranks); `--from comm.json --merge-into F` merges a
saved measurement without torchrun.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from moestack.config.base import ConfigError


def plan(
    model: Annotated[str, typer.Argument(help="preset name, moestack ModelSpec YAML, or HF config.json")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="cluster preset or ClusterSpec YAML")] = "h200-1gpu",
    devices: Annotated[Optional[int], typer.Option("--devices", "-n", help="devices (default: the preset's)")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", "-s", help="tokens per sequence")] = None,
    global_batch_tokens: Annotated[
        Optional[int], typer.Option("--global-batch-tokens", "-t", help="tokens per optimizer step (default 16M)")
    ] = None,
    top: Annotated[int, typer.Option("--top", "-k", help="plans to list")] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    fix: Annotated[
        Optional[str],
        typer.Option("--fix", help="evaluate one plan: tp=2,pp=8,vpp=4,ep=64,cp=1,dp=64,mbs=1,recompute=selective"),
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="where to write the best plan")] = Path("plan.yaml"),
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write memory.png and timeline.png here")] = None,
    precision: Annotated[
        str, typer.Option("--precision", help="GEMM recipe: bf16 | fp8 (moestack's blockwise) | fp8_tensorwise | "
                          "mxfp8 | nvfp4 (the last three are priced for published runs; the trainer runs bf16 and fp8)")
    ] = "bf16",
    optimizer: Annotated[str, typer.Option("--optimizer", help="adamw | adamw_bf16 | muon")] = "adamw",
    calibration: Annotated[
        Optional[Path], typer.Option("--calibration", help="efficiency file from `moestack tune`")
    ] = None,
    host_profile: Annotated[
        str, typer.Option("--host-profile", help="whose host launches the kernels: eager (moestack's trainer, the "
                          "calibration's host) | blocks (moestack with compiled blocks: the plan runs them; needs a "
                          "calibration from `moestack tune --measure-host`) | megatron | megatron-graphs | "
                          "megatron-full-graphs (Megatron-LM runs; planner/host_profile.py)")
    ] = "eager",
) -> None:
    """Find the fastest parallel plan that fits, or evaluate one (--fix); write the best as plan.yaml."""
    from moestack.config.plan import save_plan
    from moestack.planner import report
    from moestack.planner.search import Planner, load_problem, parse_fix

    if top < 1:
        raise ConfigError(f"--top: must be >= 1 (got {top})")
    problem = load_problem(model, cluster, devices, seq_len, global_batch_tokens, calibration, precision, optimizer,
                           host_profile=host_profile)
    fixed = parse_fix(fix)
    result = Planner(problem).search(fixed, require_fit=not fixed)
    best = result.best
    if best is not None:
        plan_obj = best.plan.model_copy(update={"predicted": best.prediction()})
        save_plan(plan_obj, out)
    if plot is not None and best is not None:
        plot.mkdir(parents=True, exist_ok=True)
        report.plot_memory(result.ranked[:top], plot / "memory.png")
        report.plot_timeline(best, plot / "timeline.png")
    if json_out:
        data = report.result_json(result, top)
        data["plan_yaml"] = str(out) if best is not None else None
        print(json.dumps(data))
        return
    pb = problem
    print(f"{pb.spec.name} on {pb.cluster.num_devices} x {pb.cluster.device.name} ({pb.cluster.name}), seq_len "
          f"{pb.seq_len}, {pb.global_batch_tokens:,} tokens/step target, {pb.precision}, {pb.optimizer}; "
          f"calibration: {pb.cal.device}{_comm_note(pb.cal)}; host profile: {pb.host_profile}")
    if best is None:
        c = result.closest
        print("no plan fits.")
        if c is not None:
            print("closest (least memory) plan:")
            for line in report.breakdown(c):
                print("  " + line)
        for line in report.why_others_lost(result, top):
            print(line)
        need = f"; the closest needs {c.memory_total / 2**30:.0f} GiB of {c.hbm_bytes / 2**30:.0f} GiB" if c else ""
        raise ConfigError(f"no plan fits {pb.spec.name} on {pb.cluster.num_devices} x {pb.cluster.device.name}{need}"
                          " (try more devices, --optimizer muon/adamw_bf16, or a shorter --seq-len)")
    if fixed and not best.fits(problem.margin):
        print(f"warning: this plan needs {best.memory_total / 2**30:.1f} GiB of {best.hbm_bytes / 2**30:.1f} GiB HBM "
              f"(over the {problem.margin:.0%} margin)")
    print(report.ranked_table(result, top))
    for line in report.why_others_lost(result, top):
        print(line)
    print()
    for line in report.breakdown(best):
        print(line)
    print(f"wrote {out}")
    if plot is not None:
        print(f"wrote {plot / 'memory.png'} and {plot / 'timeline.png'}")


def _comm_note(cal) -> str:
    """How tier-0 collectives are priced: measured (tune-comm) or the cluster's datasheet bandwidth."""
    c = cal.comm
    if c is None:
        return ""
    bws = ", ".join(f"{k} {v.busbw_gb_s:.3g}" for k, v in c.collectives.items())
    return f"; tier-0 collectives measured on {c.world} x {c.device} ({c.backend}): busbw GB/s {bws}"


def tune(
    model: Annotated[str, typer.Argument(help="preset name, moestack ModelSpec YAML, or HF config.json")],
    plan_path: Annotated[Optional[Path], typer.Option("--plan", help="plan.yaml whose shapes to measure")] = None,
    out: Annotated[
        Optional[Path], typer.Option("--out", "-o", help="calibration JSON to write (default: per-GPU name)")
    ] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", "-s", help="tokens per sequence")] = None,
    measure_host: Annotated[
        bool, typer.Option("--measure-host", help="also measure the host floor (host.layer_s) on this machine, "
                           "eager and with compiled blocks (host_modes, the blocks host profile; opt-in until checked "
                           "on a GPU; default: the 2 x H200 fit)")
    ] = False,
) -> None:
    """Measure GEMM / grouped GEMM / attention efficiencies at the model's shapes and write a calibration file."""
    from moestack.tune.calibrate import run_tune

    run_tune(model, plan_path, out, seq_len, measure_host=measure_host)


def tune_comm(
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="tune-comm JSON to write (rank 0)")] = None,
    sizes_mib: Annotated[
        Optional[str], typer.Option("--sizes-mib", help="buffer sizes in MiB (default 1,16,128 on GPU, "
                                                         "0.0625,0.25,1 on CPU)")
    ] = None,
    iters: Annotated[int, typer.Option("--iters", help="timed calls per size (median)")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed calls per size first")] = 5,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32 | bf16 (random data)")] = "fp32",
    merge_into: Annotated[
        Optional[Path], typer.Option("--merge-into", help="calibration JSON whose `comm` field to set (rewritten "
                                                          "atomically; missing: the default calibration is the base)")
    ] = None,
    from_file: Annotated[
        Optional[Path], typer.Option("--from", help="merge this earlier tune-comm JSON instead of measuring")
    ] = None,
) -> None:
    """Measure all-reduce / reduce-scatter / all-gather / all-to-all bus bandwidth and latency on the ranks of a
    torchrun job (NCCL on GPU, gloo on CPU); the planner prices tier-0 collectives with them once merged into the
    calibration (`--merge-into`)."""
    from moestack.tune.comm import parse_sizes, run_tune_comm

    run_tune_comm(out, parse_sizes(sizes_mib), iters, warmup, dtype, merge_into, from_file)
