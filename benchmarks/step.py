"""Whole training steps on one GPU: eager vs compiled blocks vs compiled blocks replayed as CUDA graphs, bf16 vs the
FP8 recipe, one micro-batch vs gradient accumulation, on the proxy and the K3 slice (issue #30).

    python benchmarks/step.py                                    # the whole grid: 24 configurations, far over 8 min
    python benchmarks/step.py --models k3slice --modes eager,blocks --precisions bf16,fp8 --accum 4 --steps 3
    python benchmarks/step.py --smoke                            # tiny model, CPU, 2 steps: the script's own check

Time per configuration (estimates, not measured yet): model build and data ~10-20 s; an eager K3-slice step at
accumulation 4 ~1 s, a proxy step ~0.5 s; the first FP8 configuration autotunes its kernels (tens of seconds); a
compiled mode compiles each block kind's graphs on its first step (the proxy has 3 kinds, the K3 slice 2; with the
op boundaries ~15-30 small graphs per kind and pass: guessed 30-120 s per compiled configuration, again for graphs
mode and for FP8, which compile other graphs). --budget keeps a run inside a time limit.

Each configuration builds a fresh Trainer (moestack/train/trainer.py, one device, fused AdamW, the bf16 weight cache
unless --weight-cache off) and runs `--warmup` steps (compile, autotuning, CUDA-graph recording: their first-step
time is the "first s" column), `--steps` timed steps (median step time), then `--profile` steps under torch.profiler
(CUDA activity only) for the GPU-busy fraction: the union of kernel intervals over the wall time of those steps.

Columns: tokens/s (global tokens per step / median step time); model TFLOP/s (tokens/s x the trainer's train FLOPs
per token, the MFU definition of moestack/planner/profile.py); MFU against 989.4 TFLOP/s (H200 dense bf16, also for
FP8 runs); peak GiB (torch.cuda.max_memory_allocated over the timed steps); GPU busy %; expert load max/mean (the
busiest expert's routed rows over the mean, worst MoE layer, last micro-batch); step ms (median); host ms: the
host's time to queue a step (median; the trainer reads the device once, after queueing everything: host ms = step
ms means host-bound, divided by layers x micro-batches it is Calibration.host_modes' layer_s); first s: the first
step's wall time (compile, autotune, graph recording); "ran": the compile mode that ran (a fallback names why).

Routing: "learned" is the model's own router from its initialisation (a few steps: near balanced, not collapsed);
"uniform*" is a benchmark-only forced routing, clearly not the model: after the router has scored the tokens, token
t's slot j is sent to expert (t*K + j) mod E (K distinct experts per token, every expert T*K/E rows), the routing
weights stay the router's (so it still gets gradients). It isolates step speed from the balance of a young router.

Models: proxy = `--model proxy --seq-len 4096 -b 1`; k3slice = benchmarks/configs/k3-ep16-slice.yaml at 1 x 4096;
tiny = the smoke model (2 layers of the tiny preset, seq 32, CPU). Rows are printed as they finish (a run stopped by
a time limit keeps them); --json PATH also writes them. On CUDA each configuration runs in a process of its own
(--isolate, the default there; --no-isolate runs them in this one): compiled graphs' memory pools and caches left by
one configuration made the next slower or run out of memory (benchmarks/RESULTS.md, "Gradient accumulation").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moestack.config.kernel_spec import KernelSpec, with_fields  # noqa: E402
from moestack.config.model_spec import ModelSpec, load_model_spec  # noqa: E402
from moestack.config.train_spec import TrainSpec  # noqa: E402
from moestack.planner.profile import load_any_model_spec  # noqa: E402

PEAK_BF16 = 989.4e12  # H200 dense bf16 tensor-core peak (the trainer's MFU denominator)
MODELS = {  # name -> (model, seq_len, micro-batch)
    "proxy": ("proxy", 4096, 1),
    "k3slice": (str(ROOT / "benchmarks" / "configs" / "k3-ep16-slice.yaml"), 4096, 1),
    "tiny": ("tiny", 32, 1),
}
MODES = {"eager": "none", "blocks": "blocks", "graphs": "blocks+graphs"}


@dataclass
class Row:
    model: str
    routing: str
    mode: str
    precision: str
    accum: int
    weight_cache: bool
    tokens_per_s: float = float("nan")
    tflops: float = float("nan")
    mfu: float = float("nan")
    peak_gib: float = float("nan")
    busy: float = float("nan")
    load_max_mean: float = float("nan")
    step_ms: float = float("nan")
    host_ms: float = float("nan")
    first_s: float = float("nan")
    ran: str = ""
    skipped_steps: int = 0
    error: str = ""


HEADER = ("| model | routing | mode | prec | accum | wcache | tokens/s | TFLOP/s | MFU | peak GiB | GPU busy | "
          "load max/mean | step ms | host ms | first s | ran |")


def fmt(r: Row) -> str:
    if r.error:
        cache = "on" if r.weight_cache else "off"
        return f"| {r.model} | {r.routing} | {r.mode} | {r.precision} | {r.accum} | {cache} | error: {r.error} |"

    def num(v, spec, suffix=""):
        return "-" if v != v else format(v, spec) + suffix  # NaN -> "-"

    return (f"| {r.model} | {r.routing} | {r.mode} | {r.precision} | {r.accum} | {'on' if r.weight_cache else 'off'} | "
            f"{num(r.tokens_per_s, ',.0f')} | {num(r.tflops, '.1f')} | {num(r.mfu * 100, '.1f', '%')} | "
            f"{num(r.peak_gib, '.1f')} | {num(r.busy * 100, '.1f', '%')} | {num(r.load_max_mean, '.2f')} | "
            f"{num(r.step_ms, '.1f')} | {num(r.host_ms, '.1f')} | {num(r.first_s, '.1f')} | {r.ran}"
            f"{f' ({r.skipped_steps} non-finite steps skipped)' if r.skipped_steps else ''} |")


# ---------------------------------------------------------------------------------------------------------------
# forced-uniform routing (benchmark only)


@contextlib.contextmanager
def uniform_routing():
    """Replace moestack.ops.moe.routing.route for the duration: the router's own top-k is computed (its cost stays in
    the step) and then overridden by the balanced assignment of the module docstring; counts follow the override.
    Plain torch after the real route (its custom op under compile): a compiled block traces it, no graph break."""
    from moestack.ops.moe import routing

    real = routing.route

    def forced(logits_TE, bias, top_k, *args, **kwargs):
        idx_TK, w_TK, scores_TE, _ = real(logits_TE, bias, top_k, *args, **kwargs)
        T, E = logits_TE.shape
        slot_TK = torch.arange(T * top_k, device=idx_TK.device).view(T, top_k)
        idx_TK = (slot_TK % E).to(idx_TK.dtype)
        return idx_TK, w_TK, scores_TE, routing.expert_counts(idx_TK, E)

    routing.route = forced
    try:
        yield
    finally:
        routing.route = real


# ---------------------------------------------------------------------------------------------------------------
# one configuration


def _model_spec(name: str) -> ModelSpec:
    if name == "tiny":  # (KDA, dense MLP) and (gated DSA, LatentMoE): every part kind in two small blocks
        data = load_model_spec("tiny").model_dump()
        data.update(num_layers=2, full_attention_layers=[2], dense_layers=[1])
        return ModelSpec.model_validate(data)
    return load_any_model_spec(MODELS[name][0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy_fraction(trainer, steps: int, device: torch.device, kernels: dict[str, list[float]] | None = None) -> float:
    """Union of CUDA kernel / memcpy intervals over the wall time of `steps` train steps (profiler, CUDA only).
    `kernels`, if given, receives each kernel name's [total us, launches] over those steps."""
    if device.type != "cuda" or steps <= 0:
        return float("nan")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        _sync(device)
        wall = time.perf_counter() - t0
    cuda_events = [e for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    spans = sorted((e.time_range.start, e.time_range.end) for e in cuda_events)
    if kernels is not None:
        for e in cuda_events:
            entry = kernels.setdefault(e.name, [0.0, 0])
            entry[0] += (e.time_range.end - e.time_range.start) / steps
            entry[1] += 1 / steps
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # microseconds
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy * 1e-6 / wall if wall > 0 else float("nan")


@contextlib.contextmanager
def _issue_clock(issued: list[float]):
    """Append the perf_counter time at which each train_step has queued all of its work: the trainer's one host read
    (read_stats) comes after the optimizer step was queued and before it waits for the device. Minus the step's
    start, that is the host's time for the step: equal to the step time where the host is the bottleneck, below it
    where the device is (the host then waits at the read). Per layer and micro-batch: HostCalibration.layer_s."""
    import moestack.train.trainer as trainer_mod

    real = trainer_mod.read_stats

    def timed(values):
        issued.append(time.perf_counter())
        return real(values)

    trainer_mod.read_stats = timed
    try:
        yield
    finally:
        trainer_mod.read_stats = real


def _load(trainer) -> float:
    worst = float("nan")
    for moe in trainer.model.moe_layers().values():
        counts = moe.last_expert_counts
        if counts is not None:
            c = counts.double()
            ratio = float(c.max() / c.mean().clamp(min=1e-9))
            worst = ratio if worst != worst else max(worst, ratio)
    return worst


def empty_row(model: str, routing: str, mode: str, precision: str, accum: int, weight_cache: bool, **values) -> Row:
    """A configuration's row before it is measured; the forced routing labelled "uniform*"."""
    return Row(model, "uniform*" if routing == "uniform" else routing, mode, precision, accum, weight_cache, **values)


def run_config(model: str, routing: str, mode: str, precision: str, accum: int, weight_cache: bool, args,
               device: torch.device) -> Row:
    from moestack.train.trainer import Trainer

    row = empty_row(model, routing, mode, precision, accum, weight_cache)
    _, seq, mbs = MODELS[model]
    compile_spec = {"mode": MODES[mode], "backend": args.backend}
    trainer = None
    with tempfile.TemporaryDirectory(prefix="step_bench_") as out, \
            (uniform_routing() if routing == "uniform" else contextlib.nullcontext()):
        try:
            spec = TrainSpec(model=model, out_dir=out, steps=args.warmup + args.steps + args.profile + 2,
                             micro_batch_size=mbs, grad_accum_steps=accum, seq_len=seq, precision=precision,
                             device=str(device), eval_every=0, compile=compile_spec, weight_cache=weight_cache,
                             kernels=args.kernel_spec,
                             optimizer={"lr": 3e-4}, schedule={"warmup_steps": 2},
                             data={"eval_fraction": 0.0}, checkpoint={"every": 0, "save_final": False},
                             logging={"tensorboard": False, "progress": False, "every": 10_000})
            trainer = Trainer(spec, _model_spec(model), log=lambda *a, **k: None)
            report = trainer.compiled.report
            row.ran = {v: k for k, v in MODES.items()}[report.runs] + (f" [{report.fallback}]" if report.fallback
                                                                         else "")
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                row.skipped_steps += trainer.train_step() is None
                if row.first_s != row.first_s:
                    _sync(device)
                    row.first_s = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, issued = [], []
            with _issue_clock(issued):
                for _ in range(args.steps):
                    _sync(device)
                    t = time.perf_counter()
                    row.skipped_steps += trainer.train_step() is None
                    _sync(device)
                    times.append(time.perf_counter() - t)
                    issued[-1] -= t
            step_s = statistics.median(times)
            row.step_ms = step_s * 1e3
            row.host_ms = statistics.median(issued) * 1e3
            row.tokens_per_s = trainer.tokens_per_step / step_s
            row.tflops = row.tokens_per_s * trainer.flops_per_token / 1e12
            row.mfu = row.tflops * 1e12 / PEAK_BF16
            if device.type == "cuda":
                row.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
            row.load_max_mean = _load(trainer)
            kernels: dict[str, list[float]] = {}
            row.busy = _busy_fraction(trainer, args.profile, device, kernels if args.kernels else None)
            if kernels:
                _print_kernels(kernels, args.kernels, row)
            if report.runs != "none":
                from moestack.parallel.compile import dynamo_summary

                summary = dynamo_summary()
                row.ran += f" ({summary['unique_graphs']} graphs, {summary['graph_breaks']} breaks)"
        except Exception as err:  # noqa: BLE001 - one failed configuration must not lose the others' rows
            row.error = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            if args.verbose:
                traceback.print_exc()
        finally:
            del trainer
            _cleanup(device)
    return row


def _print_kernels(kernels: dict[str, list[float]], top: int, row: Row) -> None:
    """All kernels' GPU time and launches per step, then the `top` kernels by GPU time (names cut to 90 characters)."""
    total = sum(us for us, _ in kernels.values())
    print(f"kernels per step ({row.model} {row.mode} {row.precision} accum {row.accum}): {total / 1e3:.1f} ms GPU in "
          f"{sum(n for _, n in kernels.values()):.0f} launches")
    print("| ms / step | share | launches | kernel |")
    print("|---|---|---|---|")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {us / 1e3:.2f} | {us / total:.1%} | {n:.0f} | {name[:90].replace('|', '/')} |")
    sys.stdout.flush()


def _cleanup(device: torch.device) -> None:
    with contextlib.suppress(Exception):
        torch._dynamo.reset()  # compiled code and CUDA-graph pools of this configuration
        from torch._dynamo.utils import counters

        counters.clear()  # the next configuration's graphs / breaks are its own
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------


def _list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="proxy,k3slice", help="proxy, k3slice, tiny (comma separated)")
    p.add_argument("--modes", default="eager,blocks,graphs", help="eager, blocks, graphs (run in this order)")
    p.add_argument("--precisions", default="bf16,fp8", help="bf16, fp8")
    p.add_argument("--accum", default="1,4", help="micro-batches per optimizer step (comma separated)")
    p.add_argument("--routing", default="uniform", help="uniform (forced, benchmark only), learned")
    p.add_argument("--weight-cache", default="on", help="on, off: the bf16 weight cache (TrainSpec.weight_cache)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (compile, autotune, graph recording)")
    p.add_argument("--profile", type=int, default=2, help="profiled steps for the GPU-busy fraction (0: skip)")
    p.add_argument("--kernels", type=int, default=0, help="print the N kernels with the most GPU time per step")
    p.add_argument("--backend", default="inductor", help="compile backend: inductor | aot_eager")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 2 steps: a check of the script")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: start no configuration after this much wall time (the rest are listed as skipped)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--verbose", action="store_true", help="print the traceback of a failed configuration")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each configuration in a process of its own (default on CUDA: compiled graphs' memory pools "
                        "and caches of one configuration otherwise stay for the next, which then runs slower or out "
                        "of memory)")
    p.add_argument("--kernel", action="append", default=[], metavar="FIELD=VALUE",
                   help="a KernelSpec field for every configuration (repeatable), e.g. moe.solve_graph=false")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child of --isolate: one row, no header
    args = p.parse_args(argv)
    if args.smoke:
        args.models = "tiny" if args.models == p.get_default("models") else args.models
        args.modes = "eager" if args.modes == p.get_default("modes") else args.modes
        args.precisions = "bf16" if args.precisions == p.get_default("precisions") else args.precisions
        args.accum = "1,2" if args.accum == p.get_default("accum") else args.accum
        args.steps, args.warmup, args.profile = min(args.steps, 2), min(args.warmup, 1), 0
        args.device = args.device or "cpu"
    try:
        args.kernel_spec = kernel_spec(args.kernel)
    except ValueError as err:
        p.error(f"--kernel: {err}")
    for name, allowed in (("models", MODELS), ("modes", MODES), ("precisions", ("bf16", "fp8")),
                          ("routing", ("uniform", "learned")), ("weight_cache", ("on", "off"))):
        bad = [v for v in _list(getattr(args, name)) if v not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')}: {', '.join(bad)} not in {', '.join(allowed)}")
    return args


def kernel_spec(fields: list[str]) -> KernelSpec:
    """KernelSpec with the --kernel FIELD=VALUE choices (values read as YAML scalars: false, 512, triton)."""
    import yaml

    pairs = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not FIELD=VALUE (e.g. moe.solve_graph=false)")
        pairs[name.strip()] = yaml.safe_load(value)
    return with_fields(KernelSpec(), pairs)


def _child_argv(config: tuple, args, json_path: str) -> list[str]:
    """The command line that runs one configuration in a fresh process (--isolate)."""
    model, routing, mode, precision, accum, cache = config
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", "--no-isolate", "--models", model, "--routing",
            routing, "--modes", mode, "--precisions", precision, "--accum", str(accum), "--weight-cache",
            "on" if cache else "off", "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile",
            str(args.profile), "--kernels", str(args.kernels), "--backend", args.backend, "--json", json_path]
    if args.device:
        argv += ["--device", args.device]
    for item in args.kernel:
        argv += ["--kernel", item]
    return argv + (["--verbose"] if args.verbose else [])


def run_isolated(config: tuple, args) -> Row:
    """One configuration in a child process: its row (from the child's --json), or an error row naming the exit code
    when the child died before writing it (a crash, the OOM killer)."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row.json"
        proc = subprocess.run(_child_argv(config, args, str(path)), cwd=ROOT)
        if path.is_file():
            rows = json.loads(path.read_text())
            if rows:
                return Row(**rows[0])
    return empty_row(*config, error=f"the configuration's process exited with code {proc.returncode} before its row")


def main(argv=None) -> list[Row]:
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    isolate = device.type == "cuda" if args.isolate is None else args.isolate
    if args.one:
        config = (_list(args.models)[0], _list(args.routing)[0], _list(args.modes)[0], _list(args.precisions)[0],
                  int(_list(args.accum)[0]), args.weight_cache == "on")
        row = run_config(*config, args, device)
        Path(args.json).write_text(json.dumps([asdict(row)]))
        return [row]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    commit = ""
    with contextlib.suppress(Exception):
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        # a copied working tree (the device machine's) can sit on an older HEAD: say that the files are not it
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        commit += " + uncommitted changes" if commit and dirty else ""
    print(f"step benchmark on {where}, torch {torch.__version__}, commit {commit or '?'}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; warmup {args.warmup}, timed {args.steps}, profiled {args.profile}; "
          f"uniform* = forced balanced routing (benchmark only)"
          + (f"; kernels: {', '.join(args.kernel)}" if args.kernel else ""), flush=True)
    print(HEADER, flush=True)
    print("|" + "---|" * HEADER.count(" | ") + "---|", flush=True)
    rows, start, skipped = [], time.perf_counter(), []
    # the modes of one setting side by side, in the order given (default eager, blocks, graphs); fp8 after bf16
    configs = [(model, routing, mode, precision, int(accum), cache == "on")
               for model in _list(args.models) for routing in _list(args.routing)
               for precision in _list(args.precisions) for accum in _list(args.accum)
               for cache in _list(args.weight_cache) for mode in _list(args.modes)]
    for config in configs:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            skipped.append(config)
            continue
        t = time.perf_counter()
        row = run_isolated(config, args) if isolate else run_config(*config, args, device)
        rows.append(row)
        print(fmt(row) + f"  <!-- {time.perf_counter() - t:.0f} s{', own process' if isolate else ''} -->", flush=True)
    if skipped:
        print(f"skipped (--budget {args.budget:.0f} s): " + ", ".join(":".join(map(str, c[:5])) for c in skipped))
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
