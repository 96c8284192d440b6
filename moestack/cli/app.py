"""`moestack` command line: train | profile | plan | tune | tune-comm | adapt | convert.

Every user error (bad config, bad flag value, bad checkpoint) is printed as one line starting with "error:" and
exits with status 2; no tracebacks for mistakes the user can fix. A rank that failed or stalled ends the run with
status 3 (moestack/train/watchdog.py). Under torchrun only rank 0 prints (the others exit with the same status).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from moestack.config.base import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
console = Console(stderr=False)
err_console = Console(stderr=True)


def _parse_sets(pairs: list[str]) -> dict:
    import yaml

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set: expected key=value (e.g. optimizer.lr=1e-3), got '{pair}'")
        key, value = pair.split("=", 1)
        if not key.strip():
            raise ConfigError(f"--set: no key before '=' in '{pair}'; write field=value, e.g. optimizer.lr=1e-3")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {key.strip()}: '{value}' is not a value ({getattr(err, 'problem', err)}); quote "
                              "strings, write lists as [a,b]") from None
    return out


@app.command()
def train(
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="preset name, ModelSpec YAML or HF config.json (default: the plan's "
                                             "model, else tiny)"),
    plan: Optional[Path] = typer.Option(None, "--plan", "-p",
                                        help="Plan YAML (moestack plan): run on its devices under torchrun"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TrainSpec YAML (defaults if omitted)"),
    steps: Optional[int] = typer.Option(None, help="optimizer steps"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="run directory (default runs/<model>)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="micro-batch size (sequences)"),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="micro-batches per optimizer step"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="tokens per sequence"),
    lr: Optional[float] = typer.Option(None, help="peak learning rate"),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda | cuda:N"),
    precision: Optional[str] = typer.Option(None, help="auto | fp32 | bf16 | fp8 (FP8 GEMM recipe, GPU) | fp64"),
    data: Optional[list[str]] = typer.Option(None, "--data", help="text/jsonl/bin file or directory (repeatable)"),
    data_source: Optional[str] = typer.Option(None, "--data-source", help="builtin | text | jsonl | bin"),
    tokenizer: Optional[str] = typer.Option(None, help="'byte' or path to a local tokenizer.json"),
    dsa_mode: Optional[str] = typer.Option(None, "--dsa-mode", help="dense (indexer warm-up) | sparse"),
    compile_: Optional[str] = typer.Option(None, "--compile",
                                           help="none | blocks (torch.compile of each block) | blocks+graphs (and "
                                                "CUDA-graph replay); what ran: <out>/compile.json"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in the run directory"),
    init_from: Optional[str] = typer.Option(None, "--init-from",
                                            help="start from these model weights (moestack checkpoint or HF "
                                                 "directory); fresh optimizer, schedule and data position"),
    set_: list[str] = typer.Option([], "--set", help="any TrainSpec field, dotted: --set optimizer.weight_decay=0"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    memory_report: bool = typer.Option(False, "--memory-report",
                                       help="after training, print where one step's memory goes (allocator on "
                                            "CUDA) next to the planner's prediction (moestack/memory/report.py)"),
    profile_steps: Optional[str] = typer.Option(None, "--profile-steps", metavar="A:B",
                                                help="torch.profiler over the 1-based steps A..B-1 (earlier steps "
                                                     "warm up); every rank writes profile_rank{r}.txt (top ops by "
                                                     "device / CPU time) and .json.gz (chrome trace) to the run "
                                                     "directory"),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="with --plan: build rank --rank's part at the plan's full world size on this "
                                      "CPU (fake process group, meta / fake tensors), run one step, report memory "
                                      "and collectives next to the planner (moestack/train/dry_run.py)"),
    rank: int = typer.Option(0, "--rank", help="--dry-run: the rank to play"),
    step: bool = typer.Option(True, "--step/--no-step", help="--dry-run: run the fake step (collectives)"),
) -> None:
    """Train a model (default: the tiny preset on the built-in corpus, on whatever device exists).

    Many devices: `torchrun --nproc-per-node N -m moestack train --plan plan.yaml`; the plan sets the layout,
    micro-batch size, micro-batches per step and sequence length (moestack/parallel/README.md).
    """
    from moestack.config.plan import load_plan
    from moestack.config.train_spec import load_train_spec
    from moestack.planner.profile import load_any_model_spec

    run_plan = load_plan(plan) if plan is not None else None
    if run_plan is not None:
        clash = [flag for flag, value in (("--batch-size", batch_size), ("--grad-accum", grad_accum),
                                          ("--seq-len", seq_len)) if value is not None]
        if clash:
            raise ConfigError(f"{' '.join(clash)}: with --plan the plan sets the batch layout (micro_batch_size, "
                              "global_batch_size, seq_len); edit the plan instead")
    if model is None and run_plan is None and init_from is not None:  # an HF directory names its own model
        from moestack.train.init_from import hf_config_path

        found = hf_config_path(init_from)
        model = str(found) if found is not None else None
    model = model or (run_plan.model if run_plan is not None else "tiny")
    overrides = {"model": model}
    flag_values = {
        "steps": steps, "out_dir": out, "micro_batch_size": batch_size, "grad_accum_steps": grad_accum,
        "seq_len": seq_len, "optimizer.lr": lr, "device": device, "precision": precision,
        "data.paths": data, "data.source": data_source, "data.tokenizer": tokenizer, "dsa.mode": dsa_mode,
        "profile_steps": profile_steps, "init_from": init_from, "compile.mode": compile_,
    }
    overrides.update({k: v for k, v in flag_values.items() if v is not None})
    if data and data_source is None:
        overrides["data.source"] = _guess_source(data)
    overrides.update(_parse_sets(set_))
    if out is None and "out_dir" not in overrides:
        overrides["out_dir"] = f"runs/{Path(model).stem}"
    if quiet:
        overrides["logging.progress"] = False
    spec = load_train_spec(config, overrides)
    model_spec = load_any_model_spec(spec.model)
    if dry_run:
        if run_plan is None:
            raise ConfigError("--dry-run: needs --plan plan.yaml (it checks that plan at its full world size)")
        from moestack.train.dry_run import dry_run as run_dry

        for line in run_dry(run_plan, spec, model_spec, rank, step).lines():
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    _run_training(spec, model_spec, resume, run_plan, memory_report)


def _guess_source(paths: list[str]) -> str:
    suffixes = {Path(p).suffix for p in paths}
    if suffixes <= {".jsonl", ".json"}:
        return "jsonl"
    if suffixes <= {".bin"}:
        return "bin"
    return "text"


def _run_training(spec, model_spec, resume: bool, plan=None, memory_report: bool = False) -> None:
    from moestack.train.trainer import Trainer

    trainer = Trainer(spec, model_spec, log=console.print, plan=plan)
    try:
        _fit(trainer, model_spec, resume)
        if memory_report:
            from moestack.memory.report import trainer_memory_report

            lines = trainer_memory_report(trainer)
            trainer.log("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
    finally:
        trainer.close()


def _fit(trainer, model_spec, resume: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from moestack.train.trainer import count_params

    spec, say = trainer.spec, trainer.log  # trainer.log prints on rank 0 only
    layout = f" plan={trainer.plan.short()!r} ranks={trainer.plan.devices}" if trainer.plan is not None else ""
    say(
        f"[bold]moestack train[/] model={model_spec.name} params={count_params(trainer.model) / 1e6:.2f}M "
        f"device={trainer.device}{layout} tokens/step={trainer.tokens_per_step} steps={spec.steps} "
        f"out={spec.out_dir}"
    )
    if resume and not trainer.resume():
        say(f"--resume: no checkpoint under {trainer.ckpt_dir} (a new run); starting from step 0")
    if spec.logging.progress and sys.stdout.isatty() and trainer.is_main:
        columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn()]
        with Progress(*columns, console=console) as bar:
            task = bar.add_task("train", total=spec.steps, completed=trainer.step, info="")
            result = trainer.fit(lambda step, s: bar.update(task, completed=step, info=_fmt(s)))
    else:
        every = spec.logging.every

        def report(step, s):
            if step % every == 0 or step == spec.steps:
                say(f"step {step}/{spec.steps} {_fmt(s)}")

        result = trainer.fit(report if spec.logging.progress else None)
    losses = result["losses"]
    if losses:
        k = max(1, min(10, len(losses) // 5))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        say(f"loss {first:.3f} -> {last:.3f} (mean of first/last {k} steps)")
    if result["expert_load"]:
        say(result["expert_load"])
    say(f"checkpoint: {result['checkpoint']}")
    say(f"metrics:    {result['metrics']} (TensorBoard: {spec.out_dir})")
    say(f"loss plot:  {result['plot']}")
    if result.get("load_heatmap"):
        say(f"load map:   {result['load_heatmap']}")


def _fmt(s) -> str:
    mfu = f" mfu {s.mfu * 100:.1f}%" if s.mfu is not None else ""
    load = f" {s.load}" if getattr(s, "load", "") else ""
    return f"loss {s.loss:.4f} lr {s.lr:.2e} gnorm {s.grad_norm:.2f} tok/s {s.tokens_per_s:,.0f}{mfu}{load}"


def _register_commands() -> None:
    """The other commands, one module each under moestack/cli/; each exposes typer-annotated functions."""
    from moestack.cli import adapt, plan, profile

    app.command("profile")(profile.profile)
    app.command("adapt")(adapt.adapt)
    app.command("convert")(adapt.convert)
    app.command("plan")(plan.plan)
    app.command("tune")(plan.tune)
    app.command("tune-comm")(plan.tune_comm)


_register_commands()


def _rank() -> int:
    """This process's rank under torchrun (RANK), 0 otherwise."""
    import os

    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0


def _error(msg: str, print_here: bool) -> None:
    from rich.markup import escape

    if print_here:
        err_console.print(f"[red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)


def _loaded(module: str, name: str) -> type[BaseException] | None:
    loaded = sys.modules.get(module)
    return getattr(loaded, name) if loaded is not None else None


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions printed as one line. The checkpoint and trainer errors are caught only when their (torch-importing)
    modules were loaded by the command: a command that never imported them cannot raise them, and `plan` /
    `profile` stay free of the torch import (seconds)."""
    errors: list[type[BaseException]] = [ConfigError, ValueError, FileNotFoundError]
    lazy = (("moestack.train.safe_load", "CheckpointError"), ("moestack.train.trainer", "TrainingStopped"))
    errors += [e for e in (_loaded(m, n) for m, n in lazy) if e is not None]
    return tuple(errors)


class _NeverRaised(Exception):
    pass


def _rank_failure() -> type[BaseException]:
    """moestack.train.watchdog.RankFailure if a command loaded it (only multi-rank training raises it)."""
    return _loaded("moestack.train.watchdog", "RankFailure") or _NeverRaised


def main(argv: list[str] | None = None) -> int:
    lead = _rank() == 0  # every rank meets the same bad input: rank 0 says it once, the others exit quietly
    try:
        rc = app(args=argv, standalone_mode=False)
    except _rank_failure() as err:
        from moestack.train.watchdog import EXIT_STALLED

        _error(str(err), err.print_here)
        return EXIT_STALLED
    except _user_errors() as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _error(msg, lead)
        return 2
    except OSError as err:  # the filesystem said no (permission, not a directory, disk full): one line, the path
        where = f"{err.filename}: " if err.filename else ""
        _error(f"{where}{err.strerror or err}; check the path and its permissions", lead)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        return 1
    except typer.exceptions.TyperException as err:  # usage errors (bad flag value, unknown option): one line
        ctx = getattr(err, "ctx", None)
        if hasattr(err, "format_message") and getattr(err, "exit_code", 2) == 2:  # click's UsageError family
            path = ctx.command_path if ctx is not None else "moestack"
            _error(f"{err.format_message()} (see {path} --help)", lead)
        elif hasattr(err, "show") and lead:
            err.show()
        return getattr(err, "exit_code", 2)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
