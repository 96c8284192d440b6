"""Op entry points that torch.compile calls instead of tracing into (moestack/parallel/compile.py).

Every hot op's entry is a torch.library custom op under compile (a node inside the graph: moestack/ops/custom_ops.py
lists them) except the FP8 GEMMs, which are decorated with `@opaque`, as are the eager fallbacks the custom-op entries
keep for the calls a custom op cannot express (a collective inside the quantile solve, an offloaded or tuned table
route). Outside compile the decorator is one extra Python call. Once `activate()` has run (apply_compile does it), a
compiled block that reaches an opaque op stops its graph there, runs the op eagerly (its dispatcher, its
autograd.Function, its Triton kernels, exactly as without compile) and resumes in the next graph.

Why not let dynamo trace the ops: their dispatchers read the tune cache per call and their
Triton launches come with host logic dynamo cannot follow (it would break the graph inside them anyway), and the
pure-torch references are the spec: inductor on CPU (torch 2.13) computes wrong gradients for the KDA reference's
per-chunk tensor indexing (x[torch.tensor([j])] with a backward through it; it also corrupts the heap). Opaque ops run
the same code as eager, so compiled and eager blocks differ only by the fused glue.

The FP8 GEMMs' next step is a custom op like the others (register_fake + register_autograd).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def _plain_call(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


_CALL: list[Callable] = [_plain_call]  # replaced by a compile-disabled trampoline in activate()


def opaque(fn: F) -> F:
    """Decorate an op entry point: after activate(), torch.compile runs it eagerly (module doc)."""

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        return _CALL[0](fn, *args, **kwargs)

    # dynamo's mark for a disabled function: a traced caller breaks its graph here instead of inlining `entry`
    entry._torchdynamo_disable = True  # type: ignore[attr-defined]
    return entry  # type: ignore[return-value]


_ENTRY_CODE = opaque(_plain_call).__code__  # every entry wrapper shares this code object


def activate() -> None:
    """Make every @opaque entry a compile boundary (imports torch._dynamo: called when something is compiled):
    dynamo never compiles the wrapper's own frame (skip_code) and runs what it calls with compilation off."""
    if _CALL[0] is not _plain_call:
        return
    import torch
    from torch._dynamo.eval_frame import skip_code

    def _eager(fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)

    skip_code(_ENTRY_CODE)
    _CALL[0] = torch.compiler.disable(_eager, recursive=True)
