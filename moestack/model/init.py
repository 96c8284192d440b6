"""Canonical weight initialisation: the values a model starts from, computable one shard at a time.

`init_model(model, seed)` gives every parameter and buffer the distribution its module's `init_weights` declares,
with numbers that depend only on (seed, the tensor's name in the whole model, the element's position). A rank that
holds a shard (tensor / expert / pipeline / data parallel, after building on meta) therefore gets exactly the
slice of what a single-device build holds: `moestack.parallel.init.materialize` passes the shard's global indices.

How the values are made, per tensor (parameters and buffers, by their name in the whole model):
  1. `model.init_weights()` runs once on meta stand-ins of global shape under a recorder. A tensor whose init is a
     chain of element-wise ops on itself (`normal_`, `uniform_`, `fill_`, `zero_`, `nn.init.*`, then in-place
     unary ops such as `log_`) is a *rule*: its values are drawn per row block of dim 0 (BLOCK_ELEMS elements) with
     a generator seeded by (seed, name, block), so any set of rows / columns can be produced without the rest.
  2. A tensor initialised any other way (copied from a computed value, read by another tensor's init: KDA's A_log
     and dt_bias) is *computed*: `init_weights` runs a second time with these tensors real and full-size (every
     rule tensor still meta, consuming no random numbers) from one fixed seed, and each rank keeps its slice.
     Computed tensors must be small (per-head vectors); a large one would be built whole on every rank.
  3. Both land in the real tensors (or this rank's shards of them); Python attributes the init code sets on a
     stand-in (e.g. `_no_weight_decay`) are copied to the real tensor.
The distributions are exactly those of `init_weights`; the numbers are not those of a plain `init_weights()` call
(that one draws the whole model from one stream, which no shard can reproduce without drawing everything).
Generation runs on `device` (a GPU draws much faster than torch's single-threaded CPU normal_), block by block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

BLOCK_ELEMS = 1 << 22  # elements drawn per generator seed (whole rows of dim 0; at least one row)
SMALL_REAL = 1 << 16  # pass 1 stand-ins up to this many elements are real (CPU) tensors, larger ones meta

# (local tensor to write, global index per dim or None for the whole dim), or None when this rank holds nothing
Located = tuple[torch.Tensor, tuple[torch.Tensor | None, ...]] | None
Locate = Callable[[torch.Tensor], Located]


def plain_locate(t: torch.Tensor) -> Located:
    """A plain tensor is its own whole shard; a meta one (a pipeline stage this rank does not hold) is skipped."""
    if hasattr(t, "device_mesh"):
        raise TypeError("init_model: a DTensor needs locate=moestack.parallel.init.dtensor_locate")
    if t.is_meta:
        return None
    return t, (None,) * t.dim()


@dataclass
class _Entry:
    """One tensor object of the model (a tied weight is one entry with several owners)."""

    key: str  # the name in the whole model (the first owner's)
    tensor: torch.Tensor
    owners: list[tuple[nn.Module, str, bool]] = field(default_factory=list)  # (module, attribute, is_buffer)
    ops: list[tuple[str, tuple]] = field(default_factory=list)  # the recorded chain (rule tensors)
    computed: bool = False
    attrs: dict = field(default_factory=dict)  # Python attributes the init code set on the stand-in
    extra: list[torch.Tensor] = field(default_factory=list)  # a pipeline stage's own copy of a tied weight


_SOURCE = {"normal_", "uniform_", "fill_", "zero_"}
_UNARY = {"log_", "exp_", "neg_", "abs_", "sqrt_", "reciprocal_", "mul_", "add_", "sub_", "div_", "clamp_",
          "clamp_min_", "clamp_max_"}
# what reads only a tensor's metadata (its values never matter)
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.element_size,
             torch.Tensor.is_floating_point, torch.Tensor.is_contiguous, torch.Tensor.__len__, torch.empty_like,
             torch.zeros_like, torch.ones_like, torch.full_like, torch.Tensor.new_empty, torch.Tensor.new_zeros,
             torch.Tensor.new_ones, torch.Tensor.new_full, torch.Tensor.__setattr__}
_VALUE_GETTERS = {"data", "T", "mT", "H", "mH", "real", "imag", "grad"}


def _init_op(func, args: tuple, kwargs: dict) -> tuple[str, tuple] | None:
    """The element-wise init step `func(args)` applies to args[0], or None if it is not one."""
    if kwargs.get("generator") is not None:
        return None
    init = torch.nn.init
    if func is init.normal_:
        return "normal_", (_arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0))
    if func is init.uniform_:
        return "uniform_", (_arg(args, kwargs, 1, "a", 0.0), _arg(args, kwargs, 2, "b", 1.0))
    if func is init.constant_:
        val = _arg(args, kwargs, 1, "val", None)
        return ("fill_", ((val,), {})) if isinstance(val, float) else None
    if func is init.ones_:
        return "fill_", ((1.0,), {})
    if func is init.zeros_:
        return "fill_", ((0.0,), {})
    name = getattr(func, "__name__", "")
    if getattr(func, "__objclass__", None) not in (torch._C.TensorBase, torch.Tensor) and \
            func is not getattr(torch.Tensor, name, None):
        return None
    if name == "normal_":
        return name, (_arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0))
    if name == "uniform_":
        return name, (_arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0))
    if name in ("fill_", "zero_") or name in _UNARY:
        rest = tuple(args[1:]) + tuple(kwargs.values())
        if all(isinstance(a, (int, float, bool)) or a is None for a in rest):
            return name, (tuple(args[1:]), dict(kwargs))
    return None


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default):
    value = args[pos] if len(args) > pos else kwargs.get(name, default)
    return float(value) if isinstance(value, (int, float)) else value


class _Recorder(TorchFunctionMode):
    """Pass 1 (record=True): which stand-ins get which element-wise chain, which are computed from other values.
    Both passes: element-wise init steps on meta tensors are not run (nothing to compute; torch runs meta random
    ops through its Python references, whose first use imports torch._dynamo: seconds per process)."""

    def __init__(self, entries: dict[int, _Entry], record: bool = True):
        super().__init__()
        self.entries, self.record = entries, record  # id(stand-in or an alias of it) -> entry

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # nn.init.* pass the tensor by keyword
        first = first if isinstance(first, torch.Tensor) else None
        step = _init_op(func, args, kwargs) if first is not None else None
        out = first if step is not None and first.is_meta else func(*args, **kwargs)
        if not self.record:
            return out
        tagged = [self.entries[id(a)] for a in _tensors(args, kwargs) if id(a) in self.entries]
        if not tagged:
            return out
        if getattr(func, "__name__", None) == "__get__":  # a property
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "data":
                self.entries[id(out)] = tagged[0]  # `.data` is the same tensor
                return out
            if prop not in _VALUE_GETTERS:
                return out  # shape, dtype, device, ...
        if func in _METADATA:
            return out
        target = self.entries.get(id(first)) if first is not None else None
        if step is not None and target is not None and all(e is target for e in tagged):
            target.ops.append(step)
            return out
        for entry in tagged:  # copied into, read by another init, viewed in part: its real values are needed
            entry.computed = True
        return out


def _tensors(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _entries(model: nn.Module) -> list[_Entry]:
    """Every parameter and buffer of `model` by its whole-model name; a tied pair is one entry. A pipeline stage
    keeps its own copy of a tied LM head (moestack.parallel.pipeline): it is made one entry with the embedding."""
    by_id: dict[int, _Entry] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for kind, table in ((False, module._parameters), (True, module._buffers)):
            for attr, t in table.items():
                if t is None:
                    continue
                if id(t) not in by_id:
                    by_id[id(t)] = _Entry(f"{mod_name}.{attr}" if mod_name else attr, t)
                by_id[id(t)].owners.append((module, attr, kind))
    entries = list(by_id.values())
    spec = getattr(model, "spec", None)
    if spec is not None and getattr(spec, "tie_word_embeddings", False):
        keyed = {e.key: e for e in entries}
        embed, head = keyed.get("embed.weight"), keyed.get("lm_head.weight")
        if embed is not None and head is not None and head is not embed:
            embed.owners += head.owners
            embed.extra.append(head.tensor)
            entries.remove(head)
    return entries


def _swap(entries: list[_Entry], stand_ins: list[torch.Tensor]) -> None:
    for entry, t in zip(entries, stand_ins, strict=True):
        for module, attr, is_buffer in entry.owners:
            (module._buffers if is_buffer else module._parameters)[attr] = t


def _run_init(model: nn.Module, entries: list[_Entry], stand_ins: list[torch.Tensor], mode=None) -> None:
    originals = [[(m._buffers if b else m._parameters)[a] for m, a, b in e.owners] for e in entries]
    _swap(entries, stand_ins)
    try:
        with torch.no_grad():
            if mode is None:
                model.init_weights()
            else:
                with mode:
                    model.init_weights()
    finally:
        for entry, tensors in zip(entries, originals, strict=True):
            for (module, attr, is_buffer), t in zip(entry.owners, tensors, strict=True):
                (module._buffers if is_buffer else module._parameters)[attr] = t


def block_seed(seed: int, key: str, block: int) -> int:
    """The generator seed of one row block of one tensor (stable across processes and Python versions)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill_block(vals: torch.Tensor, entry: _Entry, seed: int, block: int, gen: torch.Generator) -> None:
    """Run the entry's recorded chain on `vals` (the rows of one block) with the block's generator."""
    gen.manual_seed(block_seed(seed, entry.key, block))
    for name, op_args in entry.ops:
        if name == "normal_":
            vals.normal_(*op_args, generator=gen)
        elif name == "uniform_":
            vals.uniform_(*op_args, generator=gen)
        else:
            pos, kw = op_args
            getattr(vals, name)(*pos, **kw)


def _write_rule(entry: _Entry, seed: int, local: torch.Tensor, index: tuple, device: torch.device) -> None:
    """Write the global rows / columns `index` of a rule tensor into `local`, drawing whole row blocks."""
    shape = entry.tensor.shape
    if len(shape) == 0:  # a scalar: one row of one element
        shape, local, index = torch.Size([1]), local.view(1), (None,)
    per = max(1, BLOCK_ELEMS // max(1, math.prod(shape[1:])))  # rows per block
    gen = torch.Generator(device=device)
    if all(i is None for i in index) and local.device == device:  # the whole tensor: draw into place
        for b in range(-(-shape[0] // per)):
            _fill_block(local[b * per : (b + 1) * per], entry, seed, b, gen)
        return
    rows = (index[0] if index[0] is not None else torch.arange(shape[0])).to(device=device, dtype=torch.long)
    block_of = rows // per
    for b in torch.unique(block_of).tolist():
        lo, hi = b * per, min(shape[0], (b + 1) * per)
        vals = torch.empty((hi - lo, *shape[1:]), dtype=local.dtype, device=device)
        _fill_block(vals, entry, seed, b, gen)
        where = (block_of == b).nonzero().flatten()
        vals = vals[rows[where] - lo]
        for d, idx in enumerate(index[1:], start=1):
            if idx is not None:
                vals = vals.index_select(d, idx.to(device))
        local.index_copy_(0, where.to(local.device), vals.to(local.device))


def init_model(model: nn.Module, seed: int | None = None, device: torch.device | str | None = None,
               locate: Locate = plain_locate) -> None:
    """Initialise every parameter and buffer of `model` (a whole Transformer: its tree fixes the names) in place.

    seed: None draws one from torch's global generator. device: where values are drawn (default: the first real
    tensor's device); rule tensors are drawn in their own dtype, block by block, and copied into place.
    locate(tensor) -> (local tensor, global index per dim) | None: which part of each tensor this process holds
    (default: plain tensors whole, meta ones skipped; `moestack.parallel.init.dtensor_locate` for DTensors).
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    entries = _entries(model)
    if device is None:
        real = next((e.tensor for e in entries if not e.tensor.is_meta), None)
        device = real.device if real is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "meta":
        device = torch.device("cpu")

    # pass 1: record on stand-ins of global shape (small ones real, so that computations reading them run on real
    # numbers; big ones meta); its random numbers are thrown away
    stand_ins = [torch.empty(e.tensor.shape, dtype=e.tensor.dtype) if e.tensor.numel() <= SMALL_REAL
                 else torch.empty(e.tensor.shape, dtype=e.tensor.dtype, device="meta") for e in entries]
    with torch.random.fork_rng(devices=[]):
        _run_init(model, entries, stand_ins, _Recorder({id(t): e for t, e in zip(stand_ins, entries)}))
    for entry, t in zip(entries, stand_ins):
        entry.attrs = dict(vars(t))
        if not entry.ops and not entry.computed:
            raise RuntimeError(f"init_model: {entry.key} is left uninitialised by {type(model).__name__}.init_weights")

    # pass 2: the computed tensors, real and whole, from one fixed seed (the rule tensors stay meta)
    full: dict[int, torch.Tensor] = {}
    if any(e.computed for e in entries):
        stand_ins = [torch.zeros(e.tensor.shape, dtype=e.tensor.dtype, device=device) if e.computed
                     else torch.empty(e.tensor.shape, dtype=e.tensor.dtype, device="meta") for e in entries]
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(block_seed(seed, "<computed>", 0))
            _run_init(model, entries, stand_ins, _Recorder({}, record=False))
        full = {id(e): t for e, t in zip(entries, stand_ins) if e.computed}

    # pass 3: this process's part of every tensor
    with torch.no_grad():
        for entry in entries:
            for t in [entry.tensor, *entry.extra]:
                for name, value in entry.attrs.items():
                    setattr(t, name, value)
                where = locate(t)
                if where is None:
                    continue
                local, index = where
                if id(entry) in full:
                    part = full[id(entry)]
                    for d, idx in enumerate(index):
                        if idx is not None:
                            part = part.index_select(d, idx.to(part.device))
                    local.copy_(part)
                else:
                    _write_rule(entry, seed, local, index, device)
