"""Host-memory offload: saved activations (per Block) and routed-expert weights (per MoE layer).

Activation offload (`ActivationOffloader`, Plan.offload.activations): inside each wrapped Block, every tensor that
autograd saves for backward goes through `torch.autograd.graph.saved_tensors_hooks`: the pack hook copies it to
pinned host memory on a side stream (D2H) and autograd keeps only the host copy; the unpack hook returns it to the
device. When backward unpacks the first tensor of block i, the tensors of the block that ran before it (i - 1)
are copied back on another side stream (H2D prefetch), so by the time backward reaches that block they are
resident. At most `max_inflight` blocks have D2H copies in flight: a new block waits for the oldest, which bounds
the device memory held by pending copies. Kept on the device: tensors below `min_bytes`, parameters and their
views / autocast copies (they are weights, not activations), tensors already on the host. Tensors saved inside a
recomputed (checkpointed) part go to the checkpoint's hooks instead (innermost hooks win): offload applies to
what recompute keeps outside its regions. On a CPU "device" the host copy is a separate CPU tensor (tests).

Expert offload (`ExpertOffload`, Plan.offload.experts): the routed experts' weights (`Experts.w_gate_up`,
`Experts.w_down`) live in host memory, and so do their gradients and hence their optimizer states (any torch
optimizer steps host parameters on the host). The experts' GEMM strategy (`Experts.gemm`) is wrapped by
`ExpertSeam`: for each grouped GEMM it copies into a device buffer only the experts that received rows
(offs_E, i.e. the router's counts on this rank; experts with no rows are not fetched), runs the original GEMM,
and does not keep the weights for backward: backward fetches them again (prefetched one GEMM ahead, in reverse
order), computes the input gradient with the same GEMM and the weight gradient per expert, and adds the fetched
experts' rows into the host `param.grad` (async D2H, flushed at the end of backward). The first gradient of a
step (param.grad None) is written by the D2H copy itself, in fp32, into a persistent host buffer that becomes
`param.grad` (pinned on a GPU: no staging copy, no host-side add, no page faults of a fresh 4 B / param buffer per
step); later ones (gradient accumulation) go through a staging copy and `index_add_`. Without expert
parallelism the router's forward hook starts the H2D copy as soon as the experts are known, overlapping it with
the latent down-projection and the permutation. Copies move `transfer_dtype` (bf16 halves the traffic; a bf16
host shadow of the fp32 weights is refreshed when the weights change: all stale shadows at once, after one device
synchronisation, at the first fetch after an optimizer step). On a GPU, `init_weights` of an attached Experts
module draws its normal values on the device, one block of experts at a time, and copies them to the host (torch's
CPU normal_ is single-threaded; README.md).

Legend: N rows (routed copies), D / F GEMM in / out width, E experts.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from moestack.memory.precision import Fp8Rows, dequantize_rows_fp8, quantize_rows_fp8
from moestack.model.wrappers import wrap_forward

_PARAM_PATH = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0", "ExpandBackward0",
               "PermuteBackward0", "UnsafeViewBackward0", "SliceBackward0", "SelectBackward0"}


def is_weight_like(t: torch.Tensor) -> bool:
    """A parameter, or a view / dtype copy of one (what autocast saves for a GEMM's backward)."""
    if t.is_leaf:
        return t.requires_grad
    fn, depth = t.grad_fn, 0
    while fn is not None and type(fn).__name__ in _PARAM_PATH and depth < 4:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn, depth = nxt[0], depth + 1
    return type(fn).__name__ == "AccumulateGrad"


def _canonical(device: torch.device) -> torch.device:
    """cuda -> cuda:<current index>, so it compares equal to tensors' devices."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _pinned_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


# ------------------------------------------------------------------------------------------------------------
# activation offload


@dataclass
class ActivationOffloadStats:
    tensors: int = 0  # saved tensors moved to the host
    bytes: int = 0  # bytes moved to the host (once per save)
    kept: int = 0  # saved tensors left on the device (small, weights, already on host)
    prefetched: int = 0  # unpacks served by a prefetch
    fetched_sync: int = 0  # unpacks that had to copy on demand
    inflight_wait_s: float = 0.0  # host time forward spent waiting for old D2H copies (in-flight bound)
    d2h_s: float = 0.0  # copy-stream time of the D2H copies (CUDA, with `timing`; read by copy_times())
    h2d_s: float = 0.0  # copy-stream time of the prefetch / on-demand H2D copies (idem)


class _Group:
    """The saved tensors of one Block forward."""

    def __init__(self, prev: _Group | None):
        self.handles: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.prev = weakref.ref(prev) if prev is not None else None
        self.d2h_event = None  # the last D2H copy of this group (CUDA)
        self.prefetched = False


class _Saved:
    """What autograd holds instead of a saved device tensor."""

    __slots__ = ("host", "device", "group", "ready", "ready_event", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _Group):
        self.host, self.device, self.group = host, device, group
        self.ready: torch.Tensor | None = None  # device copy made by a prefetch
        self.ready_event = None


class ActivationOffloader:
    """Moves saved activations of wrapped modules to host memory and back (see module docstring).

    Args:
        device: the compute device (saved tensors elsewhere, e.g. host-resident expert weights, are kept).
        min_bytes: tensors smaller than this stay on the device (default 64 KiB: not worth a copy).
        max_inflight: blocks whose D2H copies may be in flight at once (>= 1).
    `stats` counts what happened; `wrap(module)` routes a module's forward through `region()`. With `timing` set
    (benchmarks), every side-stream copy is bracketed by timing events and `copy_times()` adds their durations to
    `stats.d2h_s` / `stats.h2d_s`: the transfer time the step had to hide (the overlap is 1 - exposed / that).
    """

    def __init__(self, device: torch.device | str, min_bytes: int = 1 << 16, max_inflight: int = 2):
        assert max_inflight >= 1
        self.device = _canonical(torch.device(device))
        self.min_bytes, self.max_inflight = min_bytes, max_inflight
        self.stats = ActivationOffloadStats()
        self.timing = False
        self._timed: list[tuple[str, object, object]] = []  # (d2h / h2d, start event, end event)
        self._group: _Group | None = None
        self._last: _Group | None = None
        self._inflight: list[_Group] = []
        self._d2h: dict[torch.device, torch.cuda.Stream] = {}
        self._h2d: dict[torch.device, torch.cuda.Stream] = {}

    # -- timing ----------------------------------------------------------------------------------------------
    def _start_timer(self, stream):
        if not self.timing:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    def _stop_timer(self, kind: str, start, stream) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._timed.append((kind, start, end))

    def copy_times(self) -> tuple[float, float]:
        """Add the timed copies recorded so far to stats.d2h_s / h2d_s (synchronises on them); returns the two."""
        for kind, start, end in self._timed:
            end.synchronize()
            ms = start.elapsed_time(end)
            if kind == "d2h":
                self.stats.d2h_s += ms / 1e3
            else:
                self.stats.h2d_s += ms / 1e3
        self._timed.clear()
        return self.stats.d2h_s, self.stats.h2d_s

    # -- streams ---------------------------------------------------------------------------------------------
    def _stream(self, table: dict, device: torch.device):
        if device not in table:
            table[device] = torch.cuda.Stream(device)
        return table[device]

    # -- regions ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self):
        """Offload what autograd saves inside this block (one group; prefetch links groups in forward order)."""
        if not torch.is_grad_enabled():
            yield
            return
        self._bound_inflight()
        outer, self._group = self._group, _Group(self._last)
        self._last = self._group
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            if self._group.d2h_event is not None:
                self._inflight.append(self._group)
            self._group = outer

    def wrap(self, module: nn.Module) -> nn.Module:
        """Run `module.forward` inside `region()` (instance forward replaced; names and hooks unchanged)."""

        def make(inner):
            @functools.wraps(inner)
            def forward(*args, **kwargs):
                with self.region():
                    return inner(*args, **kwargs)

            return forward

        wrap_forward(module, "offload", make)
        return module

    def _bound_inflight(self) -> None:
        while len(self._inflight) >= self.max_inflight:
            group = self._inflight.pop(0)
            t0 = time.perf_counter()
            group.d2h_event.synchronize()
            self.stats.inflight_wait_s += time.perf_counter() - t0

    # -- hooks -----------------------------------------------------------------------------------------------
    def _keep(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.numel() * t.element_size() < self.min_bytes:
            return True
        if t.device != self.device:  # e.g. host-resident expert weights
            return True
        return is_weight_like(t)

    def _pack(self, t: torch.Tensor):
        if self._keep(t):
            self.stats.kept += 1
            return t
        group = self._group
        if t.is_cuda:
            stream = self._stream(self._d2h, t.device)
            host = _pinned_empty(t.shape, t.dtype, pin=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                start = self._start_timer(stream)  # after the wait: it brackets the copy alone
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                self._stop_timer("d2h", start, stream)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy is done
            group.d2h_event = event
        else:
            host = t.detach().clone()  # CPU "device": the host copy is a separate tensor
        saved = _Saved(host, t.device, group)
        group.handles.add(saved)
        self.stats.tensors += 1
        self.stats.bytes += t.numel() * t.element_size()
        return saved

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.ready is not None:
            t, saved.ready = saved.ready, None
            if t.is_cuda:
                current = torch.cuda.current_stream(t.device)
                current.wait_event(saved.ready_event)
                t.record_stream(current)
            self.stats.prefetched += 1
        else:
            t = self._to_device(saved)
            self.stats.fetched_sync += 1
        prev = saved.group.prev() if saved.group.prev is not None else None
        if prev is not None and not prev.prefetched:
            self._prefetch(prev)
        return t

    def _to_device(self, saved: _Saved) -> torch.Tensor:
        if saved.device.type != "cuda":
            return saved.host
        current = torch.cuda.current_stream(saved.device)
        if saved.group.d2h_event is not None:
            current.wait_event(saved.group.d2h_event)
        start = self._start_timer(current)
        t = saved.host.to(saved.device, non_blocking=True)
        self._stop_timer("h2d", start, current)
        return t

    def _prefetch(self, group: _Group) -> None:
        group.prefetched = True
        for saved in list(group.handles):
            if saved.ready is not None:
                continue
            if saved.device.type != "cuda":
                saved.ready = saved.host
                continue
            stream = self._stream(self._h2d, saved.device)  # no wait on compute: only the D2H must be done
            with torch.cuda.stream(stream):
                if group.d2h_event is not None:
                    stream.wait_event(group.d2h_event)
                start = self._start_timer(stream)
                saved.ready = saved.host.to(saved.device, non_blocking=True)
                saved.ready_event = torch.cuda.Event()
                saved.ready_event.record(stream)
                self._stop_timer("h2d", start, stream)


def apply_activation_offload(model: nn.Module, device: torch.device | str, min_bytes: int = 1 << 16,
                             max_inflight: int = 2) -> ActivationOffloader:
    """Offload the saved activations of every Block of `model` (`model.layers`). Apply after recompute wrapping
    so that checkpointed regions keep their own hooks (see module docstring)."""
    offloader = ActivationOffloader(device, min_bytes, max_inflight)
    for block in model.layers.values():
        offloader.wrap(block)
    return offloader


# ------------------------------------------------------------------------------------------------------------
# the expert GEMM seam (expert offload and FP8 saved inputs)


def _grouped_wgrad(x_ND: torch.Tensor, dy_NF: torch.Tensor, offs_E: torch.Tensor, E: int) -> torch.Tensor:
    """dW [E, D, F] with dW[e] = x[rows of e]^T @ dy[rows of e]; zero for experts without rows."""
    if x_ND.is_cuda and dy_NF.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        try:  # the 2-D x 2-D form of torch's grouped GEMM groups the reduction dim (what its own backward uses)
            dw = torch._grouped_mm(x_ND.to(dy_NF.dtype).t(), dy_NF, offs=offs_E)
            empty_E = torch.diff(offs_E.long(), prepend=offs_E.new_zeros(1, dtype=torch.long)) == 0
            return dw.masked_fill_(empty_E[:, None, None], 0)  # experts without rows: zero, whatever the kernel
        except RuntimeError:
            pass
    D, F = x_ND.shape[1], dy_NF.shape[1]
    dw = None
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            piece = x_ND[start:end].t() @ dy_NF[start:end]
            if dw is None:
                dw = piece.new_zeros((E, D, F))
            dw[e] = piece
        start = end
    return dw if dw is not None else dy_NF.new_zeros((E, D, F))


class _ExpertGEMM(torch.autograd.Function):
    """y = seam.inner(x, w, offs) that saves x (optionally in FP8) and, with offload, not the weights."""

    @staticmethod
    def forward(ctx, x_ND, w_EDF, offs_E, seam: ExpertSeam, name: str):
        ctx.seam, ctx.x_dtype, ctx.dev = seam, x_ND.dtype, x_ND.device.type
        ctx.autocast = (torch.is_autocast_enabled(ctx.dev), torch.get_autocast_dtype(ctx.dev))
        ctx.fetch = None
        w_run = w_EDF
        if seam.offload is not None:
            w_run, ctx.fetch = seam.offload.forward_fetch(seam.experts, name, w_EDF, offs_E)
        y_NF = seam.inner(x_ND, w_run, offs_E)
        if seam.fp8_inputs:
            q = quantize_rows_fp8(x_ND)
            saved = [q.data_ND, q.scale_NG, offs_E]
        else:
            saved = [x_ND, offs_E]
        ctx.fp8 = seam.fp8_inputs
        ctx.has_w = ctx.fetch is None
        ctx.save_for_backward(*saved, *([w_EDF] if ctx.has_w else []))
        return y_NF

    @staticmethod
    def backward(ctx, dy_NF):
        seam = ctx.seam
        saved = ctx.saved_tensors
        if ctx.fp8:
            x_ND = dequantize_rows_fp8(Fp8Rows(saved[0], saved[1], ctx.x_dtype))
            rest = saved[2:]
        else:
            x_ND, rest = saved[0], saved[1:]
        offs_E = rest[0]
        w_EDF = rest[1] if ctx.has_w else seam.offload.backward_fetch(ctx.fetch)
        enabled, dtype = ctx.autocast
        with torch.autocast(ctx.dev, dtype=dtype, enabled=enabled):
            dx = seam.inner(dy_NF, w_EDF.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
            need_w = ctx.needs_input_grad[1] or (ctx.fetch is not None and ctx.fetch.param.requires_grad)
            dw = _grouped_wgrad(x_ND, dy_NF, offs_E, w_EDF.shape[0]) if need_w else None
        if dx is not None:
            dx = dx.to(ctx.x_dtype)
        if ctx.fetch is not None:
            if dw is not None:
                seam.offload.accumulate_grad(ctx.fetch, dw)
            return dx, None, None, None, None
        return dx, (dw.to(w_EDF.dtype) if dw is not None else None), None, None, None


class ExpertSeam:
    """Wraps the experts' GEMM strategy `Experts.gemm` (keeping it as `inner`): adds expert offload and / or FP8
    saved inputs; with neither it calls `inner` unchanged."""

    def __init__(self, experts: nn.Module):
        self.experts = experts
        self.inner = experts.gemm  # the bf16 strategy, or the FP8 recipe's installed before
        self.offload: ExpertOffload | None = None
        self.fp8_inputs = False

    def _param_name(self, w_EDF: torch.Tensor) -> str | None:
        ptr = w_EDF.untyped_storage().data_ptr()
        for name in ("w_gate_up", "w_down"):
            if getattr(self.experts, name).untyped_storage().data_ptr() == ptr:
                return name
        return None

    def __call__(self, x_ND: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        if self.offload is None and not self.fp8_inputs:
            return self.inner(x_ND, w_EDF, offs_E)
        name = self._param_name(w_EDF)
        if name is None:  # not one of this module's weights: nothing to manage
            return self.inner(x_ND, w_EDF, offs_E)
        return _ExpertGEMM.apply(x_ND, w_EDF, offs_E, self, name)


def expert_seam(experts: nn.Module) -> ExpertSeam:
    """The ExpertSeam of an Experts module, installed on first use."""
    seam = getattr(experts, "_moestack_seam", None)
    if seam is None:
        seam = ExpertSeam(experts)
        experts.gemm = seam
        experts._moestack_seam = seam
    return seam


# ------------------------------------------------------------------------------------------------------------
# expert offload


@dataclass
class ExpertOffloadStats:
    fetched: int = 0  # expert weight slices copied to the device (one per expert per weight per pass)
    skipped: int = 0  # expert weight slices not copied because the expert had no rows
    prefetched: int = 0  # fetches served by a prefetch (router hook in forward, previous GEMM in backward)
    h2d_bytes: int = 0
    d2h_bytes: int = 0  # gradient bytes copied back


@dataclass
class _Fetch:
    """One grouped GEMM's use of one weight: which experts, the view the GEMM got, and a backward prefetch."""

    param: nn.Parameter
    ids: list[int]
    view: tuple  # (size, stride, storage_offset - param's storage_offset) of the GEMM's weight view
    prev: weakref.ref | None
    ready: torch.Tensor | None = None
    ready_event: object = None


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted expert ids -> [start, end) runs of consecutive ids (one copy per run)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class ExpertOffload:
    """Keeps routed-expert weights on the host and streams in the experts each grouped GEMM needs.

    Args:
        device: where the GEMMs run.
        transfer_dtype: dtype of the device copies (None: the weights' own dtype; bf16 halves the H2D traffic
            under bf16 autocast and keeps a bf16 host shadow of the fp32 weights).
    Attach with `attach(experts, router)`; `stats` counts fetched and skipped expert slices.
    """

    def __init__(self, device: torch.device | str, transfer_dtype: torch.dtype | None = None):
        self.device = _canonical(torch.device(device))
        self.cuda = self.device.type == "cuda"
        self.transfer_dtype = transfer_dtype
        self.stats = ExpertOffloadStats()
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last: _Fetch | None = None
        self._ready: dict[int, tuple[set[int], torch.Tensor, object]] = {}  # id(param) -> router prefetch
        self._shadows: dict[int, tuple[int, torch.Tensor]] = {}
        self._pending: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, object]] = []
        self._flush_queued = False
        self._grad_buffers: dict[int, torch.Tensor] = {}  # id(param) -> persistent host gradient (module docstring)
        self._fresh: set[int] = set()  # params whose first gradient of this backward is pending
        self.attached: list[nn.Module] = []

    # -- setup -----------------------------------------------------------------------------------------------
    def attach(self, experts: nn.Module, router: nn.Module | None = None) -> None:
        """Move `experts`' weights to host memory (pinned when the device is a GPU) and route its GEMMs here.

        Call on a materialised model (meta weights become uninitialised host tensors: initialise them after).
        With `router` (its experts are all local: no EP slicing) its forward hook prefetches the routed experts.
        """
        self._to_host(experts)
        expert_seam(experts).offload = self
        self.attached.append(experts)
        if self.cuda:
            experts.init_weights = functools.partial(self._init_on_device, experts)
        if router is not None and router.num_experts == experts.w_gate_up.shape[0]:
            router.register_forward_hook(functools.partial(self._on_route, experts))

    def _to_host(self, experts: nn.Module) -> None:
        for name in ("w_gate_up", "w_down"):
            p = getattr(experts, name)
            if p.device.type == "cpu" and (p.is_pinned() or not self.cuda):
                continue
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self.cuda)  # pinned once, no copy
            if not p.is_meta:
                host.copy_(p.detach())
            if p.is_meta:  # `.data =` cannot change a meta tensor's type: swap contents, keep the object
                torch.utils.swap_tensors(p, nn.Parameter(host, requires_grad=p.requires_grad))
            else:
                p.data = host

    @torch.no_grad()
    def _init_on_device(self, experts: nn.Module, std: float, block_bytes: int = 1 << 28) -> None:
        """Experts.init_weights (normal(0, std) for both weights), drawn on the device block by block."""
        for name in ("w_gate_up", "w_down"):
            p = getattr(experts, name)
            if p.is_meta:  # moestack.model.init records the distribution on a meta stand-in and draws it itself
                nn.init.normal_(p, 0.0, std)
                continue
            E = p.shape[0]
            per = max(1, block_bytes // max(1, p[0].numel() * p.element_size()))
            for a in range(0, E, per):
                b = min(E, a + per)
                block = torch.empty(p[a:b].shape, dtype=p.dtype, device=self.device).normal_(0.0, std)
                p[a:b].copy_(block)  # synchronous: the device block is freed right after

    def rehome(self) -> None:
        """Move the attached experts' weights back to host memory after something moved them (e.g. meta
        initialisation: `model.to_empty(device=...)` then `init_weights()`). Parameter objects are kept, so call
        it before building the optimizer (its state would otherwise be created on the device)."""
        for experts in self.attached:
            self._to_host(experts)

    # -- forward ---------------------------------------------------------------------------------------------
    def _host_source(self, param: nn.Parameter) -> torch.Tensor:
        if self.transfer_dtype is None or self.transfer_dtype == param.dtype:
            return param.detach()
        hit = self._shadows.get(id(param))
        if hit is None or hit[0] != param._version:
            self._refresh_shadows(param)
            hit = self._shadows[id(param)]
        return hit[1]

    def _refresh_shadows(self, param: nn.Parameter) -> None:
        """Rewrite every stale shadow (the optimizer changed all weights at once): one synchronisation per step
        instead of one per weight, and the conversions back to back (each copy_ is multi-threaded)."""
        if self.cuda:  # copies still reading the old shadows must finish before the CPU rewrites them
            self._stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        params = [getattr(e, n) for e in self.attached for n in ("w_gate_up", "w_down")]
        if all(p is not param for p in params):
            params.append(param)
        for p in params:
            if p.device.type != "cpu":
                continue
            hit = self._shadows.get(id(p))
            if hit is not None and hit[0] == p._version:
                continue
            shadow = hit[1] if hit is not None else _pinned_empty(p.shape, self.transfer_dtype, self.cuda)
            shadow.copy_(p.detach())
            self._shadows[id(p)] = (p._version, shadow)

    def _copy_in(self, param: nn.Parameter, ids: list[int], side_stream: bool):
        """Device buffer shaped like `param` with the rows `ids` copied in (others zero), and its ready event."""
        if param.device.type != "cpu":
            raise RuntimeError("expert offload: the experts' weights are no longer in host memory (the model was "
                               "moved with .to() / to_empty() after apply_memory_policies: call "
                               "model.memory_policies.expert_offload.rehome() before building the optimizer)")
        src = self._host_source(param)
        ctx = torch.cuda.stream(self._stream) if (self.cuda and side_stream) else contextlib.nullcontext()
        with ctx:  # a side-stream fetch depends on host data only: it does not wait for the compute stream
            E = param.shape[0]
            alloc = torch.empty if len(ids) == E else torch.zeros  # every row is copied: no need to zero
            buf = alloc(param.shape, dtype=src.dtype, device=self.device)
            for a, b in _runs(ids):
                buf[a:b].copy_(src[a:b], non_blocking=self.cuda)
            event = None
            if self.cuda and side_stream:
                event = torch.cuda.Event()
                event.record(self._stream)
        E = param.shape[0]
        self.stats.fetched += len(ids)
        self.stats.skipped += E - len(ids)
        self.stats.h2d_bytes += len(ids) * (src.numel() // E) * src.element_size()
        return buf, event

    def _take(self, buf: torch.Tensor, event) -> torch.Tensor:
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            buf.record_stream(current)
        return buf

    @torch.no_grad()
    def _on_route(self, experts: nn.Module, router: nn.Module, args, output) -> None:
        topk_idx_TK = output[0]
        ids = torch.unique(topk_idx_TK).tolist()  # one host sync: the copies need the expert ids
        for name in ("w_gate_up", "w_down"):
            param = getattr(experts, name)
            buf, event = self._copy_in(param, ids, side_stream=True)
            self._ready[id(param)] = (set(ids), buf, event)

    def forward_fetch(self, experts: nn.Module, name: str, w_EDF: torch.Tensor, offs_E: torch.Tensor):
        """(device weight view like w_EDF with the experts that have rows, the record backward needs)."""
        param = getattr(experts, name)
        counts_E = torch.diff(offs_E.long(), prepend=offs_E.new_zeros(1, dtype=torch.long))
        ids = torch.nonzero(counts_E).flatten().tolist()  # host sync (the fallback GEMMs make one anyway)
        ready = self._ready.pop(id(param), None)
        if ready is not None and set(ids) <= ready[0]:
            buf = self._take(ready[1], ready[2])
            self.stats.prefetched += 1
        else:
            buf = self._take(*self._copy_in(param, ids, side_stream=False))
        view = (tuple(w_EDF.shape), tuple(w_EDF.stride()), w_EDF.storage_offset() - param.storage_offset())
        record = _Fetch(param, ids, view, weakref.ref(self._last) if self._last is not None else None)
        self._last = record
        return buf.as_strided(*view), record

    # -- backward --------------------------------------------------------------------------------------------
    def backward_fetch(self, record: _Fetch) -> torch.Tensor:
        if record.ready is not None:
            buf = self._take(record.ready, record.ready_event)
            record.ready = record.ready_event = None
            self.stats.prefetched += 1
        else:
            buf = self._take(*self._copy_in(record.param, record.ids, side_stream=False))
        prev = record.prev() if record.prev is not None else None
        if prev is not None and prev.ready is None:  # the GEMM that ran before this one is next in backward
            prev.ready, prev.ready_event = self._copy_in(prev.param, prev.ids, side_stream=True)
        return buf.as_strided(*record.view)

    @torch.no_grad()
    def accumulate_grad(self, record: _Fetch, dw_view: torch.Tensor) -> None:
        """Add the fetched experts' rows of dW (given in the GEMM's view layout) into the host param.grad."""
        param = record.param
        fresh = param.grad is None and id(param) not in self._fresh
        g = torch.zeros(param.shape, dtype=param.dtype if fresh else dw_view.dtype, device=dw_view.device)
        g.as_strided(*record.view).copy_(dw_view)
        if fresh:  # the first gradient of this step: written straight into the persistent host buffer
            self._fresh.add(id(param))
            buf = self._grad_buffers.get(id(param))
            if buf is None:
                buf = _pinned_empty(param.shape, param.dtype, self.cuda)
                self._grad_buffers[id(param)] = buf
            runs = _runs(record.ids)
            self.stats.d2h_bytes += len(record.ids) * g[0].numel() * g.element_size()
            event = None
            if self.cuda:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    for a, b in runs:
                        buf[a:b].copy_(g[a:b], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                g.record_stream(self._stream)
            else:
                for a, b in runs:
                    buf[a:b].copy_(g[a:b])
            self._pending.append((param, runs, buf, event))
            self._queue_flush()
            return
        ids_dev = torch.tensor(record.ids, device=g.device, dtype=torch.long)
        rows = g.index_select(0, ids_dev)
        self.stats.d2h_bytes += rows.numel() * rows.element_size()
        ids_host = torch.tensor(record.ids, dtype=torch.long)
        if not self.cuda:
            self._pending.append((param, ids_host, rows, None))
            self._queue_flush()
            return
        staging = _pinned_empty(rows.shape, rows.dtype, pin=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staging.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        rows.record_stream(self._stream)
        self._pending.append((param, ids_host, staging, event))
        self._queue_flush()

    def _queue_flush(self) -> None:
        if self._flush_queued:
            return
        self._flush_queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        except RuntimeError:  # not inside a backward (a direct call): flush() must be called by the caller
            self._flush_queued = False

    @staticmethod
    def _add_rows(param: nn.Parameter, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.index_add_(0, ids, rows.to(param.grad.dtype))

    def flush(self) -> None:
        """Finish the pending gradient copies (runs at the end of each backward; call before reading grads)."""
        for param, ids, data, event in self._pending:
            if event is not None:
                event.synchronize()
            if isinstance(ids, list):  # a fresh gradient: `data` is the buffer, rows outside `ids` are zeroed
                start = 0
                for a, b in ids + [(param.shape[0], param.shape[0])]:
                    if a > start:
                        data[start:a].zero_()
                    start = b
                if param.grad is None:
                    param.grad = data
                else:  # an accumulation made after this one's copy was queued (cannot happen in one backward)
                    param.grad.add_(data)
            else:
                self._add_rows(param, ids, data)
        self._pending.clear()
        self._fresh.clear()
        self._flush_queued = False


def apply_expert_offload(model: nn.Module, device: torch.device | str,
                         transfer_dtype: torch.dtype | None = None) -> ExpertOffload:
    """Offload the routed experts of every MoE layer of `model` (Transformer.moe_layers()) to host memory."""
    offload = ExpertOffload(device, transfer_dtype)
    for moe in model.moe_layers().values():
        offload.attach(moe.experts, moe.router)
    return offload
