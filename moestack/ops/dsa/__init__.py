"""DSA ops behind one seam: sparse MQA attention, indexer top-k from inputs, indexer KL loss.

Backends are a small registry per op. The backend of a call is, in order: the explicit `backend=` argument, the
environment variable MOESTACK_DSA_BACKEND, else the first available of ("triton", "reference"). A named backend
that does not implement the op (e.g. a kernel set that only accelerates attention) falls back to that default
order for this op; a named backend that implements the op but is unavailable for these inputs is an error.
"reference" (moestack.ops.dsa.reference, blockwise over query rows) is always registered and available.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moestack.ops import tuned
from moestack.ops.dsa import reference
from moestack.ops.opaque import opaque

ENV_VAR = "MOESTACK_DSA_BACKEND"
PREFERENCE = ("triton", "reference")
OPS = (
    "sparse_mqa_attention",
    "indexer_topk_from_inputs",
    "indexer_kl_loss",
    "attention_probs_target",
    "indexer_scores_at",
)


@dataclass(frozen=True)
class _Backend:
    fn: Callable
    available: Callable[[torch.Tensor], bool]  # given the op's first tensor (device / dtype checks)
    automatic: Callable[[torch.Tensor], bool]  # may the default order pick it (False: only when named)


_REGISTRY: dict[str, dict[str, _Backend]] = {op: {} for op in OPS}


def register_backend(
    name: str,
    fn: Callable,
    available: Callable[[torch.Tensor], bool] = lambda t: True,
    op: str = "sparse_mqa_attention",
    automatic: Callable[[torch.Tensor], bool] | None = None,
) -> None:
    """Register (or replace) `fn` as backend `name` for `op` (one of OPS); fn has the op's signature.

    `automatic` (default: `available`) narrows what the default order may pick, e.g. Triton kernels run on CPU
    tensors under the interpreter when named, but are never picked for CPU tensors by default.
    """
    if op not in _REGISTRY:
        raise ValueError(f"unknown DSA op '{op}'; ops are {OPS}")
    _REGISTRY[op][name] = _Backend(fn, available, automatic or available)


def backends(op: str = "sparse_mqa_attention") -> list[str]:
    """Names registered for `op`."""
    return list(_REGISTRY[op])


def select_backend(op: str, lead: torch.Tensor, backend: str | None = None) -> str:
    """Name of the backend that runs `op` on inputs led by tensor `lead` (see module docstring for the order)."""
    table = _REGISTRY[op]
    name = backend or os.environ.get(ENV_VAR) or None
    if name is not None:
        known = {n for t in _REGISTRY.values() for n in t}
        if name not in known:
            raise ValueError(f"DSA backend '{name}' is not registered; registered: {sorted(known)}")
        if name in table:
            if not table[name].available(lead):
                raise RuntimeError(
                    f"DSA backend '{name}' is not available for {op} on {lead.device} {lead.dtype}; "
                    f"unset {ENV_VAR} or choose one of {backends(op)}"
                )
            return name
    for candidate in PREFERENCE:
        if candidate in table and table[candidate].available(lead) and table[candidate].automatic(lead):
            return candidate
    raise RuntimeError(f"no available DSA backend for {op}")  # unreachable while "reference" is registered


@opaque
def sparse_mqa_attention(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int, scale: float, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,T,H,D], kv [B,S,D], idx [B,T,K] int32 (-1 = empty) -> (o [B,T,H,v_dim] q.dtype, lse [B,T,H] fp32).

    See reference.sparse_mqa_attention.
    """
    if backend is None and not os.environ.get(ENV_VAR):  # a choice measured by `moestack tune` at this shape
        choice = tuned.lookup("dsa.sparse_mqa_attention", tuned.dsa_key(q, idx), q.device)
        entry = _REGISTRY["sparse_mqa_attention"].get(choice) if choice else None
        if entry is not None and entry.available(q) and entry.automatic(q):  # the default order's own rules
            backend = choice
    name = select_backend("sparse_mqa_attention", q, backend)
    return _REGISTRY["sparse_mqa_attention"][name].fn(q, kv, idx, v_dim, scale)


@opaque
def indexer_topk_from_inputs(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w: torch.Tensor,
    top_k: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """q_idx [B,T,Hi,Di], k_idx [B,T,Di], w [B,T,Hi] -> idx [B,T,top_k] int32, -1 padded; causal, no gradient.

    See reference.indexer_topk_from_inputs.
    """
    name = select_backend("indexer_topk_from_inputs", q_idx, backend)
    return _REGISTRY["indexer_topk_from_inputs"][name].fn(q_idx, k_idx, w, top_k, cu_seqlens=cu_seqlens)


@opaque
def indexer_kl_loss(
    index_scores: torch.Tensor,
    attn_probs_target: torch.Tensor,
    idx: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Scalar KL(p || softmax(I)) averaged over queries; see reference.indexer_kl_loss."""
    name = select_backend("indexer_kl_loss", index_scores, backend)
    return _REGISTRY["indexer_kl_loss"][name].fn(index_scores, attn_probs_target, idx)


@opaque
def indexer_scores_at(
    q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """Indexer scores of the selected keys [B,T,K] fp32 (-inf at -1), differentiable in q_idx, k_idx, w; see
    reference.indexer_scores_at."""
    name = select_backend("indexer_scores_at", q_idx, backend)
    return _REGISTRY["indexer_scores_at"][name].fn(q_idx, k_idx, w, idx)


@opaque
def attention_probs_target(
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    lse: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The indexer's KL target (head-summed attention probabilities, L1-normalised), no gradient; see
    reference.attention_probs_target."""
    name = select_backend("attention_probs_target", q, backend)
    return _REGISTRY["attention_probs_target"][name].fn(q, kv, scale, lse=lse, idx=idx, cu_seqlens=cu_seqlens)


register_backend("reference", reference.sparse_mqa_attention_blockwise, op="sparse_mqa_attention")
register_backend("reference", reference.indexer_topk_from_inputs, op="indexer_topk_from_inputs")
register_backend("reference", reference.indexer_kl_loss, op="indexer_kl_loss")
register_backend("reference", reference.attention_probs_target, op="attention_probs_target")
register_backend("reference", reference.indexer_scores_at_blockwise, op="indexer_scores_at")


def _register_triton() -> None:
    """Backend "triton" for sparse_mqa_attention where Triton imports: picked by default for CUDA tensors; CPU
    tensors only when named and the kernels were built for the interpreter (TRITON_INTERPRET=1, tests)."""
    try:
        from moestack.ops.dsa import triton_op
    except ImportError:  # no triton in this environment: the reference serves every op
        return

    def on_cuda(t: torch.Tensor) -> bool:
        return t.is_cuda

    def on_cuda_nondeterministic(t: torch.Tensor) -> bool:
        # the indexer-score backward accumulates dk with fp32 atomics: deterministic runs take the reference
        return t.is_cuda and not torch.are_deterministic_algorithms_enabled()

    for op, fn, automatic in (
        ("sparse_mqa_attention", triton_op.sparse_mqa_attention_triton, on_cuda),
        ("indexer_topk_from_inputs", triton_op.indexer_topk_triton, on_cuda),
        ("attention_probs_target", triton_op.attention_probs_target_triton, on_cuda),
        ("indexer_scores_at", triton_op.indexer_scores_at_triton, on_cuda_nondeterministic),
    ):
        register_backend("triton", fn, available=triton_op.triton_available, op=op, automatic=automatic)


_register_triton()

__all__ = [
    "ENV_VAR",
    "OPS",
    "attention_probs_target",
    "backends",
    "indexer_kl_loss",
    "indexer_scores_at",
    "indexer_topk_from_inputs",
    "register_backend",
    "select_backend",
    "sparse_mqa_attention",
]
