"""A pure, sync-free device function replayed as one CUDA graph per input signature.

For host-bound helpers that launch many small kernels (the batch-scope quantile solve: ~50 Triton launches per MoE
layer and micro-batch) and that a compiled block runs eagerly (an @opaque op): the first call of a signature runs
the function once on a side stream (Triton compiles and autotunes there, outside any capture), then captures it;
every later call copies its inputs into the graph's static ones, replays, and returns a copy of the static outputs.
A replay runs the captured kernels on the same values, so the results are bitwise those of the eager call.

Requirements on `fn`: tensor arguments only (the other choices are part of the key), no host sync, no collective,
no output that aliases an input, and results that depend on nothing but the inputs. Where CUDA graphs cannot run
(not CUDA, or a capture already running on this stream) the function runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class _Captured:
    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...]):
        self.inputs = tuple(x.clone() for x in inputs)
        device = inputs[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn(*self.inputs)  # compile, autotune and first-launch work outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = fn(*self.inputs)
        self.single = isinstance(out, torch.Tensor)
        self.outputs = (out,) if self.single else tuple(out)

    def __call__(self, inputs: tuple[torch.Tensor, ...]):
        for static, x in zip(self.inputs, inputs, strict=True):
            static.copy_(x)
        self.graph.replay()
        outs = tuple(o.clone() for o in self.outputs)  # the next replay rewrites the static outputs
        return outs[0] if self.single else outs


class GraphCache:
    """`cache(key, fn, *tensors)`: fn(*tensors) through the captured graph of (key, the tensors' shapes, dtypes,
    devices); `key` holds every non-tensor choice fn depends on."""

    def __init__(self):
        self._graphs: dict[Hashable, _Captured] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()

    @staticmethod
    def usable(*tensors: torch.Tensor) -> bool:
        return (all(t.is_cuda for t in tensors) and not torch.cuda.is_current_stream_capturing()
                and len({t.device for t in tensors}) == 1)

    def __call__(self, key: Hashable, fn: Callable, *tensors: torch.Tensor):
        if not self.usable(*tensors):
            return fn(*tensors)
        signature = (key, tuple((tuple(t.shape), t.dtype, t.device) for t in tensors))
        captured = self._graphs.get(signature)
        if captured is None:
            captured = self._graphs[signature] = _Captured(fn, tensors)
        return captured(tensors)
