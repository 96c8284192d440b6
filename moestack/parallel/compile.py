"""Regional torch.compile of the transformer blocks, and CUDA-graph replay of the compiled blocks (TrainSpec.compile).

Applied to a built model from outside, after tensor / expert parallelism and the memory policies and before FSDP2
(torchtitan's order, moestack/parallel/parallelize.py), or by the single-device trainer after the FP8 recipe and
the bf16 weight cache:

    none           eager
    blocks         `block.compile(...)` for every Block: the block's forward (norms, mixer, FFN, residuals) becomes
                   one or a few graphs; the embedding, LM head and loss stay eager. Blocks of one kind share the
                   compiled code (the parameters are graph inputs), so a 61-layer model compiles its 2-3 kinds once.
                   Each block keeps its type and parameter names (state_dict, FSDP2, checkpoints unchanged).
    blocks+graphs  the same with inductor's "reduce-overhead" mode: each compiled graph (forward and backward) is
                   recorded once as a CUDA graph and replayed, so its kernels cost one launch. Needs static shapes and
                   no host sync inside the graph (a sync splits it: the static-capacity MoE path and the Triton
                   routing have none). One CUDA device without FSDP2 (its gathers change the parameters' storage).

What cannot run falls back one mode down, with one line saying why (also in <out_dir>/compile.json): no C++ compiler
(inductor on CPU), no Triton (inductor on CUDA), graphs on CPU / under a plan / with the aot_eager backend. Under
gradient accumulation with graphs, no .grad may be a graph's output that a later replay rewrites
(`CompiledBlocks.own_gradients`).
compile.json also records what dynamo did (graphs, graph breaks and their reasons) after the first steps.

Numerics: backend aot_eager (capture, no code generation) gives the eager losses bit for bit; inductor fuses and
reorders floating-point work, so its results agree to rounding (tests/parallel/test_compile.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from moestack.config.train_spec import CompileSpec


@dataclass
class CompileReport:
    requested: str
    runs: str
    backend: str
    fullgraph: bool
    blocks: int = 0
    fallback: str | None = None  # why a lower mode runs than requested
    solve_graphs_folded: int = 0  # routers whose own solve graph the block graphs capture instead (apply)
    dynamo: dict = field(default_factory=dict)  # counters after some steps (dynamo_summary)

    def line(self) -> str:
        if self.runs == "none" and self.requested == "none":
            return "compile: none (eager)"
        text = f"compile: {self.runs} ({self.blocks} blocks, {self.backend}{', fullgraph' if self.fullgraph else ''})"
        if self.fallback:
            text += f"; {self.requested} requested, not run: {self.fallback}"
        return text


def _cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def resolve_mode(spec: CompileSpec, device: torch.device, sharded: bool) -> tuple[str, str | None]:
    """(mode that runs, why it is lower than spec.mode or None). sharded: FSDP2 holds the parameters (a plan)."""
    mode = spec.mode
    if mode == "none":
        return "none", None
    if not torch._dynamo.is_dynamo_supported():
        return "none", "torch.compile does not support this Python"
    if spec.backend == "inductor":
        if device.type == "cpu" and _cxx_compiler() is None:
            return "none", "inductor on CPU needs a C++ compiler (g++ / clang++ on PATH, or $CXX)"
        if device.type == "cuda" and importlib.util.find_spec("triton") is None:
            return "none", "inductor on CUDA needs Triton (pip install triton)"
    if mode == "blocks+graphs":
        why = None
        if device.type != "cuda":
            why = f"CUDA graphs need a CUDA device (this run is on {device.type})"
        elif sharded:
            why = "CUDA graphs under FSDP2: its all-gathers move the parameters the graphs would have recorded"
        elif spec.backend != "inductor":
            why = f"CUDA graphs come from inductor's reduce-overhead mode (backend is {spec.backend})"
        if why is not None:
            return "blocks", why
    return mode, None


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    return list(layers.values()) if layers is not None else []


class CompiledBlocks:
    """One run's compile choice: what runs (`report`), `apply` to the model (or each pipeline stage), and the
    per-micro-batch hook. Made by `resolve_compile` once per run."""

    def __init__(self, report: CompileReport, spec: CompileSpec):
        self.report, self.spec = report, spec

    @property
    def graphs(self) -> bool:
        return self.report.runs == "blocks+graphs"

    def apply(self, model: nn.Module) -> nn.Module:
        """Compile every Block of `model` (a Transformer or a pipeline stage of one) in place; returns it."""
        if self.report.runs == "none":
            return model
        from moestack.ops.opaque import activate

        activate()  # the op entry points become graph boundaries (moestack/ops/opaque.py)
        options: dict = {"backend": self.spec.backend, "fullgraph": self.spec.fullgraph}
        if self.graphs:
            options["mode"] = "reduce-overhead"
            # The block graphs capture the solve's kernels themselves; its own graph (ops/graphed.py) would record
            # inside their warm-up run, and its static buffers would stay in their memory pool untracked.
            for module in model.modules():
                if getattr(module, "solve_graph", False):
                    module.solve_graph = False
                    self.report.solve_graphs_folded += 1
        for block in _blocks(model):
            block.compile(**options)
            self.report.blocks += 1
        return model

    def before_forward(self) -> None:
        """Call before every micro-batch's forward: with CUDA graphs a new replay may reuse the previous one's
        output memory (everything of the previous micro-batch has been consumed by its backward)."""
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def own_gradients(self, params: Iterable[torch.Tensor], grad_accum_steps: int) -> None:
        """Call before a step's first micro-batch with the parameters whose .grad AccumulateGrad fills (iterated only
        where it acts). With CUDA graphs and accumulation, a first micro-batch's gradient taken over as .grad would
        be a graph's output, which the next micro-batch's replay rewrites before its backward adds to it: such
        parameters get a zeroed .grad of their own (one buffer per dtype) that every micro-batch adds into."""
        if not self.graphs or grad_accum_steps == 1:
            return
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            if p.requires_grad and p.grad is None:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), group in by_dtype.items():
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
            for p, g in zip(group, flat.split([p.numel() for p in group]), strict=True):
                p.grad = g.view_as(p)

    def write(self, out_dir: str | Path) -> Path:
        self.report.dynamo = dynamo_summary()
        path = Path(out_dir) / "compile.json"
        path.write_text(json.dumps(asdict(self.report), indent=1, sort_keys=True) + "\n")
        return path


def resolve_compile(spec: CompileSpec, device: torch.device | str, sharded: bool = False) -> CompiledBlocks:
    """The mode that runs for `spec` on `device` (module doc); nothing is compiled until `apply`."""
    runs, why = resolve_mode(spec, torch.device(device), sharded)
    return CompiledBlocks(CompileReport(spec.mode, runs, spec.backend, spec.fullgraph, fallback=why), spec)


def apply_compile(model: nn.Module, spec: CompileSpec, device: torch.device | str, sharded: bool = False
                  ) -> CompiledBlocks:
    """resolve_compile(spec, device, sharded).apply(model), for callers with one model."""
    compiled = resolve_compile(spec, device, sharded)
    compiled.apply(model)
    return compiled


def dynamo_summary(max_reasons: int = 8) -> dict:
    """What dynamo has done in this process so far: frames compiled (a block kind's frame and its resume frames
    after graph breaks, each again per recompile), unique graphs, graph breaks (total and the most frequent
    reasons, first lines)."""
    from torch._dynamo.utils import counters

    breaks = dict(counters.get("graph_break", {}))
    reasons = sorted(((n, " ".join(r.strip().splitlines()[:2])[:200]) for r, n in breaks.items()), reverse=True)
    return {"unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
            "graph_breaks": int(sum(breaks.values())),
            "break_reasons": [f"{n}x {r}" for n, r in reasons[:max_reasons]],
            "frames_compiled": int(counters.get("frames", {}).get("ok", 0))}
