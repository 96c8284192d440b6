"""Forward wrappers applied from outside the model: one registry, one order.

Parallelism and the memory policies change what a module's forward does without touching the model code: token
dedup and the shared-expert overlap rewire an MoE, tensor parallelism swaps in local shards and head counts, context
parallelism adds halos and state relays, activation recompute and offload act on what autograd saves. Each goes
through `wrap_forward(module, kind, make)`: the module's instance `forward` becomes `make(inner)` (inner: the forward
before it; the module's name, parameters and hooks are unchanged), the layer is recorded on the module, and a kind
applied out of ORDER (innermost first: the order `parallelize()` runs them in) is refused, e.g. recompute before
tensor parallelism would checkpoint the global-shape forward. `unwrap_forward` takes the outermost layer off again and
leaves the ones below it in place.

Class swaps (Fp8Linear, CachedLinear, the expert-parallel and replicated experts) are not forward wrappers: they keep
the object and change its type, and are made by their converters.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

ORDER = ("dedup", "overlap", "tp", "cp", "recompute", "offload")

_LAYERS = "_forward_layers"  # in module.__dict__: [(kind, the forward it wraps or None for the class's)]


def wrapped_kinds(module: nn.Module) -> tuple[str, ...]:
    """The kinds wrapped around `module.forward`, innermost first."""
    return tuple(kind for kind, _ in module.__dict__.get(_LAYERS, ()))


def wrap_forward(module: nn.Module, kind: str, make: Callable[[Callable], Callable]) -> None:
    """module.forward = make(current forward), recorded as a `kind` layer (module doc). Several layers of one kind may
    stack; a kind earlier in ORDER than the outermost layer is a RuntimeError naming both."""
    if kind not in ORDER:
        raise ValueError(f"unknown forward wrapper kind {kind!r}; kinds are {', '.join(ORDER)}")
    layers = module.__dict__.setdefault(_LAYERS, [])
    if layers and ORDER.index(layers[-1][0]) > ORDER.index(kind):
        raise RuntimeError(f"{type(module).__name__}: the {kind} wrapper must be applied before {layers[-1][0]} "
                           f"(order, innermost first: {', '.join(ORDER)})")
    own = module.__dict__.get("forward")  # None: the class's forward
    module.forward = make(module.forward)
    layers.append((kind, own))


def unwrap_forward(module: nn.Module, kind: str) -> None:
    """Take the outermost layer, which must be `kind`, off module.forward."""
    layers = module.__dict__.get(_LAYERS) or []
    if not layers or layers[-1][0] != kind:
        raise RuntimeError(f"{type(module).__name__}: the outermost forward wrapper is "
                           f"{layers[-1][0] if layers else 'none'}, not {kind}")
    _, own = layers.pop()
    if own is None:
        del module.forward  # the class's forward shows through again
    else:
        module.forward = own
