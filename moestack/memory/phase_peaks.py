"""Peak allocated device memory per phase of one training step (a diagnostic step, not for timed steps).

    peaks = PhasePeaks(model, device)              # hooks on every block in model.layers
    peaks.mark("forward"); peaks.in_forward = True
    loss = model(tokens, targets)                  # each block output gets a gradient hook
    peaks.in_forward = False
    peaks.mark("loss + head backward")
    loss.backward()                                # "layer {name} backward" marks, last layer first
    peaks.mark("clip + optimizer")
    clip(...); opt.step(); opt.zero_grad()
    marks = peaks.close()                          # [{"phase", "peak_gib", "end_gib"}, ...]

Each mark closes the running phase: it reads the allocator's peak since the previous mark (`peak_gib`) and what
is allocated now (`end_gib`), then resets the peak statistic and opens the next phase. A gradient hook on every
block's forward output marks where that block's backward starts, so "layer i backward" runs from the gradient of
block i's output to that of block i-1's (the last one, the first block, until the next explicit mark).

What it copes with:
* wrapped blocks: the hooks sit on whatever `model.layers` holds (FSDP2 `fully_shard` modules, checkpoint
  wrappers, TP-parallelised modules are the same module objects with extra hooks). A pipeline rank passes its
  stage view (the trainer's `model`, which shares the blocks of its stage modules) or a list of stage modules.
* DTensor outputs: the hook is registered on the DTensor itself (its gradient is a DTensor; only the call matters).
* recompute: gradient hooks are only registered during the real forward -- while `in_forward` is set and outside
  any backward pass (an activation-checkpoint rerun happens inside backward), so a rerun block adds no mark.
* several micro-batches per step (gradient accumulation, pipeline schedules): each block counts its forwards in
  the step; with `microbatches > 1` a layer's label ends in " (mb k)", k its 0-based forward count (the
  micro-batch index: every micro-batch passes each block once). `stage_marks` adds, for pipeline stages, a mark
  before each stage forward ("stage s forward (mb k)") and after it ("stage s after forward (mb k)": on the last
  stage the loss and head backward, elsewhere the wait for the backward).
* no CUDA: the allocator statistics come from a `MemoryReader` (three callables); on another device the default
  reader returns 0, so the phases are still recorded (all 0). Tests inject a reader that counts calls.

The resets hide the step's peak from `torch.cuda.max_memory_allocated`; `run_peak_bytes` is the peak of the run up
to the end of this step (the peak read before the first reset, and every phase's), for callers that report it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

GIB = 2**30


def _zero() -> int:
    return 0


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class MemoryReader:
    """The allocator statistics PhasePeaks reads, in bytes: peak allocated since the last reset, allocated now,
    and the reset of the peak."""

    max_allocated: Callable[[], int]
    allocated: Callable[[], int]
    reset_peak: Callable[[], None]

    @classmethod
    def for_device(cls, device: torch.device | str | None) -> MemoryReader:
        """torch.cuda's statistics for a CUDA device (the current one for None when CUDA is available); zeros and a
        no-op reset elsewhere."""
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type != "cuda":
            return cls(_zero, _zero, _nothing)
        return cls(lambda: torch.cuda.max_memory_allocated(device), lambda: torch.cuda.memory_allocated(device),
                   lambda: torch.cuda.reset_peak_memory_stats(device))


def _in_backward() -> bool:
    """True inside an autograd backward pass (where a non-reentrant checkpoint reruns its forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _blocks(model: nn.Module | Iterable[nn.Module]) -> dict[str, nn.Module]:
    """name -> block of `model.layers` (a ModuleDict, or any module's children), of one model or of several stage
    modules (the same block reached twice is hooked once)."""
    models = [model] if isinstance(model, nn.Module) else list(model)
    out: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for m in models:
        layers = getattr(m, "layers", None)
        if layers is None:
            raise ValueError(f"PhasePeaks: {type(m).__name__} has no `layers` (the blocks to hook)")
        items = layers.items() if hasattr(layers, "items") else enumerate(layers)
        for name, blk in items:
            if id(blk) not in seen:
                seen.add(id(blk))
                out[str(name)] = blk
    return out


class PhasePeaks:
    """Peak allocated device memory per phase of one step (module docstring). Only for a diagnostic step: the
    resets hide the step's peak from the allocator's statistics (`run_peak_bytes` keeps it).

    model: a module with `layers` (ModuleDict of blocks), or several (pipeline stage modules). device: whose
    allocator to read (CUDA; elsewhere every reading is 0) unless `reader` is given. microbatches: forwards per
    block in the step (labels carry the micro-batch index when > 1). stage_marks: {stage index: module run once per
    micro-batch forward of that stage}, with last_stage the index of the pipeline's last stage.
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module], device: torch.device | str | None = None,
                 reader: MemoryReader | None = None, microbatches: int = 1,
                 stage_marks: dict[int, nn.Module] | None = None, last_stage: int | None = None):
        self.device = device
        self.reader = reader if reader is not None else MemoryReader.for_device(device)
        self.microbatches = microbatches
        self.marks: list[dict] = []
        self.label: str | None = None
        self.in_forward = False  # set around the real forward; hooks never register outside it or in backward
        self.prior_peak_bytes = 0  # the allocator's peak before the first reset
        self.max_peak_bytes = 0  # the largest phase peak
        self._started = False
        self._forwards: dict[str, int] = {}
        blocks = _blocks(model)
        self.layer_names = list(blocks)
        self.handles = [blk.register_forward_hook(self._hook(name)) for name, blk in blocks.items()]
        for sid, mod in (stage_marks or {}).items():
            self.handles.append(mod.register_forward_pre_hook(self._stage_hook(sid, before=True)))
            self.handles.append(mod.register_forward_hook(self._stage_hook(sid, before=False, last=sid == last_stage)))

    def _suffix(self, k: int) -> str:
        return f" (mb {k})" if self.microbatches > 1 else ""

    def _recording(self) -> bool:
        return self.in_forward and torch.is_grad_enabled() and not _in_backward()

    def _hook(self, name: str) -> Callable:
        def hook(_mod: nn.Module, _inp, out) -> None:
            t = out[0] if isinstance(out, (tuple, list)) else out
            if not (self._recording() and isinstance(t, torch.Tensor) and t.requires_grad):  # not the recomputation
                return
            k = self._forwards.get(name, 0)
            self._forwards[name] = k + 1
            label = f"layer {name} backward{self._suffix(k)}"
            t.register_hook(lambda _g: self.mark(label))  # a DTensor takes the hook itself (its grad is a DTensor)
        return hook

    def _stage_hook(self, sid: int, before: bool, last: bool = False) -> Callable:
        key = f"stage {sid}"

        def pre(_mod: nn.Module, _inp) -> None:
            if self._recording():
                k = self._forwards.get(key, 0)
                self._forwards[key] = k + 1
                self.mark(f"stage {sid} forward{self._suffix(k)}")

        def post(_mod: nn.Module, _inp, _out) -> None:
            if self._recording():
                what = "loss + head backward" if last else "after forward"
                self.mark(f"stage {sid} {what}{self._suffix(self._forwards.get(key, 1) - 1)}")

        return pre if before else post

    def mark(self, label: str | None) -> None:
        """Close the running phase (its peak and end allocation) and open `label` (None: open nothing)."""
        if not self._started:
            self.prior_peak_bytes = int(self.reader.max_allocated())
            self._started = True
        if self.label is not None:
            peak = int(self.reader.max_allocated())
            self.max_peak_bytes = max(self.max_peak_bytes, peak)
            self.marks.append({"phase": self.label, "peak_gib": peak / GIB, "end_gib": self.reader.allocated() / GIB})
        self.reader.reset_peak()
        self.label = label

    @property
    def run_peak_bytes(self) -> int:
        """The allocator's peak of the run up to the last mark (what max_memory_allocated would say without resets)."""
        return max(self.prior_peak_bytes, self.max_peak_bytes)

    def close(self) -> list[dict]:
        """Close the last phase, remove the hooks; the marks in order ([{"phase", "peak_gib", "end_gib"}])."""
        self.mark(None)
        for h in self.handles:
            h.remove()
        self.handles = []
        return self.marks

    def largest(self) -> dict | None:
        """The phase with the largest peak (the first of equals), None before any mark."""
        return max(self.marks, key=lambda m: m["peak_gib"]) if self.marks else None
