"""Shared experts overlapped with the routed path's dispatch / combine, on a side CUDA stream (from outside).

`MoE.forward` computes `shared(x)` after the routed experts, so on one stream the shared GEMMs wait for the
all-to-alls. `apply_shared_expert_overlap(model)` wraps each MoE's forward: it launches `shared(x)` first on a side
stream (after that stream waits for x), then runs the unchanged forward with `moe.shared` temporarily replaced by a
stub that hands back the already-launched result (the main stream waits for the side stream's event there). The
router, dispatch exchange, local experts and combine run on the main stream meanwhile, so the shared GEMMs fill
the time the main stream spends in the all-to-alls (and the host sync of the split sizes).

Autograd runs each backward op on the stream its forward ran on and inserts the cross-stream waits itself, so the
shared experts' backward runs on the side stream too. The module tree is untouched outside the call: parameter
names, FSDP groups and hooks on `moe.shared` (TP) are the same; the hooks run on the side stream.

On CPU (or with streams off) the side stream is a no-op context: the shared experts run first, inline, through
the same code path (that is what the CPU test exercises).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from moestack.model.moe import MoE
from moestack.model.wrappers import wrap_forward


class _Launched(nn.Module):
    """Stands in for `moe.shared` during one forward: returns the result launched on the side stream."""

    def __init__(self, x_TD: torch.Tensor, y_TD: torch.Tensor, event: torch.cuda.Event | None):
        super().__init__()
        self.x_TD, self.y_TD, self.event = x_TD, y_TD, event
        self.used = 0

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if x_TD.shape != self.x_TD.shape or x_TD.data_ptr() != self.x_TD.data_ptr():
            raise RuntimeError("shared-expert overlap: MoE.forward called shared() on another input than x")
        self.used += 1
        if self.event is not None:
            torch.cuda.current_stream(x_TD.device).wait_event(self.event)
            self.y_TD.record_stream(torch.cuda.current_stream(x_TD.device))
        return self.y_TD


def _side_stream(device: torch.device, cache: dict) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    if device not in cache:
        cache[device] = torch.cuda.Stream(device=device)
    return cache[device]


def apply_shared_expert_overlap(model: nn.Module) -> list[str]:
    """Wrap every MoE with shared experts under `model` (see the module docstring). Returns the wrapped names.
    Apply after expert parallelism and before tensor parallelism (whose unit swap must wrap this launch, which
    reads the shared weights), activation recompute and FSDP, as parallelize does."""
    streams: dict = {}  # one side stream per device, shared by all layers (they run one after another)
    wrapped = []
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE) or moe.shared is None:
            continue
        inner = moe.forward

        @functools.wraps(inner)
        def forward(x_BTD: torch.Tensor, _moe: MoE = moe, _inner=inner) -> torch.Tensor:
            shared = _moe._modules["shared"]
            x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])  # the same view MoE.forward makes (same storage)
            side = _side_stream(x_TD.device, streams)
            event = None
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(x_TD.device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                y_TD = shared(x_TD)
                if side is not None:
                    x_TD.record_stream(side)
                    event = torch.cuda.Event()
                    event.record(side)
            stub = _Launched(x_TD, y_TD, event)
            _moe._modules["shared"] = stub
            try:
                out = _inner(x_BTD)
            finally:
                _moe._modules["shared"] = shared
            assert stub.used == 1, "MoE.forward did not call shared() exactly once"
            _moe._shared_overlap_calls = getattr(_moe, "_shared_overlap_calls", 0) + 1
            return out

        wrap_forward(moe, "overlap", lambda _inner, f=forward: f)  # f calls inner, the same forward
        wrapped.append(name)
    return wrapped
