"""DSA ops behind one seam: sparse MQA attention, indexer top-k from inputs, indexer KL loss, KL target, scores.

One registry per op (moestack/ops/backends.py). "reference" (moestack.ops.dsa.reference, blockwise over query rows)
serves every op on every device; "triton" (triton_op.py) serves all but the KL loss and is what "auto" picks for
CUDA tensors (CPU tensors run it under TRITON_INTERPRET=1 only when named; the indexer-score backward's fp32
atomics make "auto" take the reference under torch.use_deterministic_algorithms). A backend named for an op it
does not implement (the KL loss) runs that op's "auto" choice. The model's choice comes from
KernelSpec.dsa.backend (GatedMLA.dsa_backend, set at build time). Under torch.compile each entry is one custom op
(custom_ops.py, README "Under torch.compile"); eager calls run its @opaque `*_eager` function.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from moestack.ops import tuned
from moestack.ops.backends import Backend, ReferenceBackend, Registry
from moestack.ops.dsa import custom_ops as dsa_custom_ops
from moestack.ops.dsa import reference
from moestack.ops.opaque import opaque

OPS = (
    "sparse_mqa_attention",
    "indexer_topk_from_inputs",
    "indexer_kl_loss",
    "attention_probs_target",
    "indexer_scores_at",
)
REGISTRIES = {op: Registry(f"DSA {op}", tuned_op="dsa.sparse_mqa_attention" if op == "sparse_mqa_attention"
                           else None) for op in OPS}


class TritonDSA(Backend):
    """One op of triton_op.py (imported on first call: a test's TRITON_INTERPRET is seen before the kernels)."""

    name = "triton"

    def __init__(self, attr: str, deterministic_ok: bool = True):
        self.attr, self.deterministic_ok = attr, deterministic_ok

    def unavailable(self, device: torch.device) -> str | None:
        from moestack.ops.kda import triton_runs_on

        return triton_runs_on(device)

    def verify(self, lead: torch.Tensor) -> str | None:
        if lead.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"dtype {lead.dtype} (fp32 / fp16 / bf16 only)"
        return self.unavailable(lead.device)

    def picks(self, lead: torch.Tensor) -> bool:
        return lead.is_cuda and (self.deterministic_ok or not torch.are_deterministic_algorithms_enabled())

    def fn(self, *args, **kwargs):
        from moestack.ops.dsa import triton_op

        return getattr(triton_op, self.attr)(*args, **kwargs)


def register_backend(op: str, backend: Backend) -> None:
    """Add (or replace) `backend` for `op` (one of OPS)."""
    if op not in REGISTRIES:
        raise ValueError(f"unknown DSA op '{op}'; ops are {OPS}")
    REGISTRIES[op].register(backend, first=True)


def backends(op: str = "sparse_mqa_attention") -> list[str]:
    """Names registered for `op`."""
    return REGISTRIES[op].names()


def _pick(op: str, lead: torch.Tensor, backend: str | None, key: Callable[[], str] | None = None) -> Backend:
    reg = REGISTRIES[op]
    if backend not in (None, "auto") and backend not in reg.names():
        known = {n for r in REGISTRIES.values() for n in r.names()}
        if backend not in known:
            raise ValueError(f"DSA backend '{backend}' is not registered; registered: {sorted(known)}")
        backend = None  # a backend set that does not implement this op: the op's own choice
    return reg.pick(backend, lead, key)


def select_backend(op: str, lead: torch.Tensor, backend: str | None = None) -> str:
    """Name of the backend that runs `op` on inputs led by tensor `lead` (see module docstring)."""
    return _pick(op, lead, backend).name


def _schema_ok(tensors: tuple, optional: tuple = (), ints: tuple = (), floats: tuple = (), backend=None) -> bool:
    """Whether a call's arguments fit its custom op's schema (tensors, optional tensors, Python ints, Python numbers
    for floats, a backend name or None); anything else runs the @opaque eager path, a graph boundary under compile."""
    return (all(isinstance(t, torch.Tensor) for t in tensors)
            and all(t is None or isinstance(t, torch.Tensor) for t in optional)
            and all(isinstance(n, int) and not isinstance(n, bool) for n in ints)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in floats)
            and (backend is None or isinstance(backend, str)))


def _detached(*ts):
    return tuple(None if t is None else t.detach() for t in ts)


def attention_backend(q: torch.Tensor, idx: torch.Tensor, backend: str | None = None) -> str:
    """Name of the backend sparse_mqa_attention runs for these inputs (the tune cache included)."""
    return _pick("sparse_mqa_attention", q, backend, lambda: tuned.dsa_key(q, idx)).name


# Entries: under torch.compile one custom op each (custom_ops.py: a node of the graph, the same backend and kernels),
# otherwise (and inside those ops) the *_eager function, @opaque.


def sparse_mqa_attention(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, v_dim: int, scale: float, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,T,H,D], kv [B,S,D], idx [B,T,K] int32 (-1 = empty) -> (o [B,T,H,v_dim] q.dtype, lse [B,T,H] fp32).

    See reference.sparse_mqa_attention.
    """
    if torch.compiler.is_compiling() and _schema_ok((q, kv, idx), (), (v_dim,), (scale,), backend):
        return dsa_custom_ops.sparse_mqa_attention(q, kv, idx, v_dim, float(scale), backend)
    return sparse_mqa_attention_eager(q, kv, idx, v_dim, scale, backend=backend)


@opaque
def sparse_mqa_attention_eager(q, kv, idx, v_dim, scale, *, backend=None):
    """sparse_mqa_attention on the picked backend, as called."""
    b = _pick("sparse_mqa_attention", q, backend, lambda: tuned.dsa_key(q, idx))
    return b.fn(q, kv, idx, v_dim, scale)


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
    if torch.compiler.is_compiling() and _schema_ok((q_idx, k_idx, w), (cu_seqlens,), (top_k,), (), backend):
        return dsa_custom_ops.indexer_topk_from_inputs(*_detached(q_idx, k_idx, w), top_k, cu_seqlens, backend)
    return indexer_topk_from_inputs_eager(q_idx, k_idx, w, top_k, cu_seqlens=cu_seqlens, backend=backend)


@opaque
def indexer_topk_from_inputs_eager(q_idx, k_idx, w, top_k, *, cu_seqlens=None, backend=None):
    """indexer_topk_from_inputs on the picked backend, as called."""
    return _pick("indexer_topk_from_inputs", q_idx, backend).fn(q_idx, k_idx, w, top_k, cu_seqlens=cu_seqlens)


def indexer_kl_loss(
    index_scores: torch.Tensor,
    attn_probs_target: torch.Tensor,
    idx: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Scalar KL(p || softmax(I)) averaged over queries; see reference.indexer_kl_loss."""
    if torch.compiler.is_compiling() and _schema_ok((index_scores, attn_probs_target), (idx,), backend=backend):
        return dsa_custom_ops.indexer_kl_loss(index_scores, attn_probs_target.detach(), idx, backend)
    return indexer_kl_loss_eager(index_scores, attn_probs_target, idx, backend=backend)


@opaque
def indexer_kl_loss_eager(index_scores, attn_probs_target, idx=None, *, backend=None):
    """indexer_kl_loss on the picked backend, as called."""
    return _pick("indexer_kl_loss", index_scores, backend).fn(index_scores, attn_probs_target, idx)


def indexer_scores_at(
    q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """Indexer scores of the selected keys [B,T,K] fp32 (-inf at -1), differentiable in q_idx, k_idx, w; see
    reference.indexer_scores_at."""
    if torch.compiler.is_compiling() and _schema_ok((q_idx, k_idx, w, idx), backend=backend):
        return dsa_custom_ops.indexer_scores_at(q_idx, k_idx, w, idx, backend)
    return indexer_scores_at_eager(q_idx, k_idx, w, idx, backend=backend)


@opaque
def indexer_scores_at_eager(q_idx, k_idx, w, idx, *, backend=None):
    """indexer_scores_at on the picked backend, as called."""
    return _pick("indexer_scores_at", q_idx, backend).fn(q_idx, k_idx, w, idx)


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
    if torch.compiler.is_compiling() and _schema_ok((q, kv), (lse, idx, cu_seqlens), (), (scale,), backend):
        return dsa_custom_ops.attention_probs_target(*_detached(q, kv), float(scale), *_detached(lse), idx,
                                                     cu_seqlens, backend)
    return attention_probs_target_eager(q, kv, scale, lse, idx, cu_seqlens=cu_seqlens, backend=backend)


@opaque
def attention_probs_target_eager(q, kv, scale, lse=None, idx=None, *, cu_seqlens=None, backend=None):
    """attention_probs_target on the picked backend, as called."""
    return _pick("attention_probs_target", q, backend).fn(q, kv, scale, lse=lse, idx=idx, cu_seqlens=cu_seqlens)


for _op, _fn in (
    ("sparse_mqa_attention", reference.sparse_mqa_attention_blockwise),
    ("indexer_topk_from_inputs", reference.indexer_topk_from_inputs),
    ("indexer_kl_loss", reference.indexer_kl_loss),
    ("attention_probs_target", reference.attention_probs_target),
    ("indexer_scores_at", reference.indexer_scores_at_blockwise),
):
    REGISTRIES[_op].register(ReferenceBackend(_fn))
if importlib.util.find_spec("triton") is not None:
    for _op, _attr, _det in (
        ("sparse_mqa_attention", "sparse_mqa_attention_triton", True),
        ("indexer_topk_from_inputs", "indexer_topk_triton", True),
        ("attention_probs_target", "attention_probs_target_triton", True),
        # the indexer-score backward accumulates dk with fp32 atomics: deterministic runs take the reference
        ("indexer_scores_at", "indexer_scores_at_triton", False),
    ):
        REGISTRIES[_op].register(TritonDSA(_attr, _det), first=True)

__all__ = [
    "OPS",
    "REGISTRIES",
    "attention_probs_target",
    "backends",
    "indexer_kl_loss",
    "indexer_scores_at",
    "indexer_topk_from_inputs",
    "register_backend",
    "select_backend",
    "sparse_mqa_attention",
]
