"""TrainSpec: everything about a training run that is not the model's shape."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from moestack.config.base import ConfigError, StrictModel, read_yaml, validate
from moestack.config.kernel_spec import KernelSpec


class DataSpec(StrictModel):
    # builtin: Python's own standard-library sources and docs (present on every machine, no download)
    # text: plain .txt files; jsonl: one JSON object per line with a text field; bin: pre-tokenized token ids
    source: Literal["builtin", "text", "jsonl", "bin"] = "builtin"
    paths: list[str] = []  # files or directories (text/jsonl/bin)
    tokenizer: str = "byte"  # "byte" or a path to a local HF tokenizer.json
    jsonl_field: str = "text"
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    eval_fraction: float = Field(default=0.02, ge=0, lt=0.5)  # tail of the token stream held out for eval

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if self.source != "builtin" and not self.paths:
            raise ValueError(f"data.source is '{self.source}' but data.paths is empty; list files or directories")
        return self


class OptimizerSpec(StrictModel):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(default=3e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, ge=0)  # global L2 norm; 0 disables

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(value):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] = {b} is outside [0, 1); AdamW's betas are decay rates, e.g. "
                                 "--set optimizer.betas=[0.9,0.95]")
        return value


class ScheduleSpec(StrictModel):
    warmup_steps: int = Field(default=20, ge=0)
    decay: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)


class CheckpointSpec(StrictModel):
    every: int = Field(default=100, ge=0)  # steps between checkpoints; 0 = only at the end
    keep: int = Field(default=2, gt=0)  # newest checkpoints kept on disk
    save_final: bool = True  # also at the last step (benchmark runs turn it off: a proxy checkpoint is ~45 GB)
    # a file holding a secret key (>= 16 bytes): checkpoints are signed with it (HMAC over their file digests) and
    # resuming refuses one that is not signed with it (moestack/train/safe_load.py); None: no signature check
    trust_key_file: str | None = None


class TimeoutSpec(StrictModel):
    # the process group's timeout: a collective that waits longer fails on the ranks waiting in it, and the run ends
    # with one line naming the rank that stopped answering (moestack/train/watchdog.py)
    collective_minutes: float = Field(default=10.0, gt=0)
    # no completed step, checkpoint save / load or evaluation for this long ends the run on every rank (exit 3);
    # 0 = off. Raise it when one step or one checkpoint write takes longer. On CUDA with several ranks the bound is
    # at most collective_minutes (a stalled NCCL collective does not raise; moestack/train/guard.py)
    watchdog_minutes: float = Field(default=15.0, ge=0)


class LoggingSpec(StrictModel):
    every: int = Field(default=10, gt=0)
    tensorboard: bool = True
    progress: bool = True  # rich progress bar (off for tests / non-tty)
    # expert-load telemetry (moestack/train/expert_load.py): one warning when a MoE layer has more than this
    # fraction of its experts idle for collapse_window logging steps in a row
    collapse_idle_fraction: float = Field(default=0.25, gt=0, lt=1)
    collapse_window: int = Field(default=10, gt=0)


class DSATrainSpec(StrictModel):
    # dense: main attention is full causal, the indexer trains on KL(main attention || indexer) (warm-up);
    # sparse: attention over the indexer's top-k keys, KL over the selected set, indexer input detached
    mode: Literal["dense", "sparse"] = "sparse"
    indexer_loss_coef: float = Field(default=1.0, ge=0)
    freeze_main_in_dense: bool = False  # V3.2 warm-up trains only the indexer


class CompileSpec(StrictModel):
    """How the transformer blocks run (moestack/parallel/compile.py; what ran lands in <out_dir>/compile.json).

    none: eager. blocks: torch.compile of each block on its own (regional, as torchtitan; the embedding, head and
    loss stay eager). blocks+graphs: the compiled blocks also replayed as CUDA graphs (inductor's reduce-overhead
    mode; CUDA, one device). Where a mode cannot run, the next one down runs and one line says why.
    """

    mode: Literal["none", "blocks", "blocks+graphs"] = "none"
    # aot_eager: the graphs are captured and run by ATen, no code generation (bitwise eager; isolates inductor)
    backend: Literal["inductor", "aot_eager"] = "inductor"
    fullgraph: bool = False  # a graph break inside a block is an error naming it (instead of a split graph)

    @model_validator(mode="before")
    @classmethod
    def _from_mode(cls, value):
        return {"mode": value} if isinstance(value, str) else value  # `compile: blocks` / --compile blocks


class TrainSpec(StrictModel):
    model: str = "tiny"  # preset name, ModelSpec YAML or HF config.json
    # start from these model weights (a moestack checkpoint or an HF directory; moestack/train/init_from.py):
    # optimizer, schedule, data position and step start fresh. --resume of an existing checkpoint takes precedence.
    init_from: str | None = None
    out_dir: str = "runs/tiny"
    seed: int = Field(default=0, ge=0, lt=2**32)  # numpy, Python and torch generators all take [0, 2**32)
    steps: int = Field(default=300, gt=0)
    micro_batch_size: int = Field(default=8, gt=0)
    grad_accum_steps: int = Field(default=1, gt=0)
    seq_len: int = Field(default=64, gt=1)
    eval_every: int = Field(default=100, ge=0)  # 0 = only at the end
    eval_batches: int = Field(default=4, gt=0)
    # auto: bf16 autocast on CUDA, fp32 elsewhere; fp8: bf16 autocast + the FP8 GEMM recipe (moestack/ops/fp8);
    # fp64: float64 weights and compute (CPU layout-equivalence tests: layouts then agree to ~1e-14)
    precision: Literal["auto", "fp32", "bf16", "fp8", "fp64"] = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_bad_steps: int = Field(default=3, gt=0)  # consecutive non-finite losses before the run stops
    # quantisation-aware training. mxfp4_experts: the routed experts' forward uses their MXFP4 values (the
    # released K3 format, moestack/ops/mxfp4.py) with a straight-through gradient, so an MXFP4 export stores
    # exactly the weights the run trained with
    qat: Literal["none", "mxfp4_experts"] = "none"
    compile: CompileSpec = CompileSpec()
    # bf16 runs on one device: every Linear / expert weight cast to bf16 once per optimizer step and kept across the
    # micro-batches (moestack/memory/compute_weights.py; the same numbers as autocast's per-forward cast). Under a
    # plan FSDP2 gathers the weights in bf16 instead (MixedPrecisionPolicy).
    weight_cache: bool = True
    data: DataSpec = DataSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    logging: LoggingSpec = LoggingSpec()
    dsa: DSATrainSpec = DSATrainSpec()
    kernels: KernelSpec = KernelSpec()  # which implementation runs each hot op (config/kernel_spec.py)
    # "A:B": torch.profiler over the 1-based steps A..B-1 (steps before A warm up); per-rank tables and a chrome
    # trace land in out_dir as profile_rank{r}.txt / .json.gz (moestack/train/step_profile.py). Quote it in YAML.
    profile_steps: str | None = None
    # 1-based step run with moestack.memory.phase_peaks.PhasePeaks: every rank writes phase_peaks_rank{r}.json
    # (peak allocated GiB per phase: forward, loss + head backward, each layer's backward, clip + optimizer) to out_dir
    phase_peaks_step: int | None = None
    # multi-rank runs: build on the meta device, shard, then draw each rank's shards (moestack/parallel/init.py; the
    # same values as the full build). auto: for models above 4B parameters on a GPU; on / off: always / never
    meta_init: Literal["auto", "on", "off"] = "auto"
    timeouts: TimeoutSpec = TimeoutSpec()

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"'{value}' is not a device moestack trains on; use auto, cpu, cuda or cuda:N (N a "
                             "GPU index, e.g. cuda:0)")
        return value

    @field_validator("out_dir")
    @classmethod
    def _check_out_dir(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty; give a run directory, e.g. --out runs/mine (an empty one would write into "
                             "the current folder)")
        return value

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _check_profile_steps(cls, value, info: ValidationInfo):
        if value is None:
            return None
        first, last = parse_profile_steps(value)
        steps = info.data.get("steps")  # validated before (declared earlier)
        if steps is not None and last - 1 > steps:
            raise ValueError(f"--profile-steps {first}:{last} profiles up to step {last - 1} but the run has {steps} "
                             "steps; pick B <= steps + 1 or raise --steps")
        return f"{first}:{last}"

    @field_validator("phase_peaks_step", mode="after")
    @classmethod
    def _check_phase_peaks_step(cls, value: int | None, info: ValidationInfo):
        steps = info.data.get("steps")  # validated before (declared earlier)
        if value is not None and (value < 1 or (steps is not None and value > steps)):
            raise ValueError(f"phase_peaks_step: {value} is not a step of the run (1..{steps}); set "
                             f"--set phase_peaks_step=N with 1 <= N <= steps")
        return value

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """(A, B) of profile_steps: steps A..B-1 (1-based) are profiled; None when off."""
        return parse_profile_steps(self.profile_steps) if self.profile_steps is not None else None

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.seq_len


def parse_profile_steps(value) -> tuple[int, int]:
    """'A:B' -> (A, B) with 1 <= A < B; anything else is a ValueError naming the option and the fix."""
    fix = ("--profile-steps: expected A:B, 1-based steps with 1 <= A < B (steps A..B-1 are profiled, earlier ones "
           "warm up), e.g. --profile-steps 6:9")
    if isinstance(value, int) and not isinstance(value, bool):  # YAML 1.1 reads an unquoted 6:9 as base 60 (369)
        raise ValueError(f"{fix}; in YAML or --set quote it (profile_steps: '6:9'), unquoted A:B reads as a number")  # noqa: TRY004 - pydantic reports ValueError
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", value) if isinstance(value, str) else None
    if match is None or not 1 <= int(match[1]) < int(match[2]):
        raise ValueError(fix)
    return int(match[1]), int(match[2])


def load_train_spec(path: str | Path | None, overrides: dict | None = None) -> TrainSpec:
    """Read a TrainSpec YAML (or defaults) and apply dotted overrides like {"optimizer.lr": 1e-3}."""
    data = read_yaml(path) if path else {}
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                section = ".".join(parents[:i + 1])
                raise ConfigError(f"{key}: '{section}' is a value, not a section with fields; set {section}=... "
                                  "itself, or check the key's spelling")
        node[leaf] = value
    return validate(TrainSpec, data, str(path) if path else "train options")
