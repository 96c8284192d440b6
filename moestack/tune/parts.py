"""Measure each layer part (mixer / FFN kind) of a model on the local GPU: forward and backward seconds and the
bytes autograd keeps, at the plan's per-device shape, with the backends this process runs.

`moestack tune` turns these into `Calibration.parts`: the time the analytic terms of planner/cost/ do not
explain (launch-bound small ops, fp32 elementwise work of reference kernels, ...) per token, and the measured saved
bytes per token. The cost model adds the first to every pass and uses the second instead of its analytic activation
bytes, so its predictions follow the code that actually runs (benchmarks/planner_measured.py checks them against
whole training steps at other batch sizes, lengths and recompute settings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestack.config.model_spec import ModelSpec
from moestack.tune.timer import median_seconds


@dataclass
class PartTiming:
    kind: str
    fwd_s: float
    bwd_s: float
    saved_bytes: float  # kept by autograd after forward (excluding the part's output), incl. autocast weight copies
    weight_copy_bytes: float  # of which bf16 copies of fp32 GEMM weights made by autocast
    tokens: int


def local_expert_spec(spec: ModelSpec, ep: int) -> ModelSpec:
    """The experts one EP rank holds as a model of its own: E/ep experts, same top-k, so each receives the same
    rows per expert as under balanced EP routing (T*k*ep/E). Group-limited routing is dropped (it needs all E)."""
    if spec.moe is None or ep <= 1:
        return spec
    moe = spec.moe
    local = max(moe.top_k, moe.num_experts // ep)
    router = moe.router.model_copy(update={"num_groups": 1, "topk_groups": 1})
    return spec.model_copy(update={"moe": moe.model_copy(update={"num_experts": local, "router": router})})


def _gemm_weight_bytes(module: torch.nn.Module) -> float:
    """bf16 bytes of the fp32 GEMM weights autocast copies (Linear weights and stacked expert weights)."""
    from moestack.model.moe import Experts

    total = 0
    for m in module.modules():  # the router's own weight is not a Linear (fp32 matmul, no autocast copy)
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32:
            total += m.weight.numel()
        elif isinstance(m, Experts):
            total += sum(p.numel() for p in m.parameters() if p.dtype == torch.float32)
    return 2.0 * total


def _saved_bytes(forward, device: torch.device) -> tuple[torch.Tensor, float]:
    """Run forward; bytes it left allocated besides its output (allocator on CUDA, saved tensors elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        y = forward()
        return y, float(torch.cuda.memory_allocated(device) - before - y.numel() * y.element_size())
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    return y, float(sum(storages.values()))


def _measure_part(kind: str, norm, part, block, micro_batch: int, seq_len: int, hidden: int, reps: int,
                  device: torch.device, chain: int) -> PartTiming:
    """Time x + part(norm(x)) chained `chain` times (fewer on OOM), forward and forward+backward; saved bytes of one."""
    cuda = device.type == "cuda"
    amp_dtype = torch.bfloat16 if cuda else torch.float32  # CPU: a smoke run of the same code, no autocast
    x = torch.randn(micro_batch, seq_len, hidden, device=device, requires_grad=True)
    dy = torch.randn_like(x)

    def forward(times: int = 1):
        h = x
        with torch.autocast(device.type, amp_dtype, enabled=cuda):
            for _ in range(times):
                h = h + part(norm(h))
        return h

    n = chain
    try:
        for _ in range(2):
            forward(n).backward(dy)
    except torch.OutOfMemoryError:
        n = 1
        x.grad = None
        if cuda:
            torch.cuda.empty_cache()
        forward(n).backward(dy)
    t_f = median_seconds(lambda: forward(n), reps, device=device) / n
    t_fb = median_seconds(lambda: forward(n).backward(dy), reps, device=device) / n
    x.grad = None
    for p in block.parameters():
        p.grad = None
    y, saved = _saved_bytes(forward, device)
    del y
    copies = (_gemm_weight_bytes(norm) + _gemm_weight_bytes(part)) if cuda else 0.0
    return PartTiming(kind, t_f, max(t_fb - t_f, 1e-9), saved, copies, micro_batch * seq_len)


def measure_parts(spec: ModelSpec, micro_batch: int, seq_len: int, ep: int = 1, reps: int = 3,
                  device: torch.device | str = "cuda", chain: int = 3) -> dict[str, PartTiming]:
    """One block of each distinct layer kind, fp32 weights under bf16 autocast (the single-device trainer's
    setup); each part (its pre-norm included) timed forward and forward+backward on random hidden states.

    The part is applied `chain` times in a row (as consecutive layers are) and the time divided by `chain`: in a
    model the host launches one layer while the GPU still runs the previous one, and a lone part timed from idle
    would charge its launch latency as if nothing overlapped it.
    """
    from moestack.model.block import Block

    spec = local_expert_spec(spec, ep)
    device = torch.device(device)
    cuda = device.type == "cuda"
    out: dict[str, PartTiming] = {}
    done: set[str] = set()
    for layer_id, kind in enumerate(spec.layer_kinds()):
        todo = [(p, k) for p, k in (("attn", kind.mixer), ("ffn", kind.ffn)) if k not in done and k != "none"]
        if not todo:
            continue
        torch.manual_seed(layer_id)
        with torch.device(device):
            block = Block(spec, kind, layer_id)
        block.init_weights(0.02)
        block.train()
        for which, part_kind in todo:
            done.add(part_kind)
            norm = block.attn_norm if which == "attn" else block.ffn_norm
            out[part_kind] = _measure_part(part_kind, norm, getattr(block, which), block, micro_batch, seq_len,
                                           spec.hidden_size, reps, device, chain)
        del block
        if cuda:
            torch.cuda.empty_cache()
    return out
