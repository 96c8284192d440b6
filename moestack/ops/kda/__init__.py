"""KDA op: `chunk_kda` runs one backend of REGISTRY (moestack/ops/backends.py).

Backends (README.md):
    "triton"     ours (triton_op.py, imported on first use): the default on CUDA for K, V <= 256
    "reference"  kda_chunked_reference, pure PyTorch, every device and dtype (CPU training, fp64 checks)
    "fla"        fla.ops.kda.chunk_kda where `fla` is installed: a public anchor for benchmarks, only when named

`backend` None / "auto": a `moestack tune` choice for the shape, else the first of triton, reference that takes the
inputs. The model's choice comes from KernelSpec.kda.backend (KDAAttention.kda_backend, set at build time).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch._subclasses.fake_tensor import is_fake

from moestack.ops import tuned
from moestack.ops.backends import Backend, ReferenceBackend, Registry
from moestack.ops.kda import custom_ops as kda_custom_ops
from moestack.ops.kda.reference import (
    kda_chunked_reference,
    kda_gate_k3,
    kda_gate_kimi_linear,
    kda_recurrent_reference,
)
from moestack.ops.opaque import opaque

__all__ = [
    "REGISTRY",
    "chunk_kda",
    "kda_chunked_reference",
    "kda_gate_k3",
    "kda_gate_kimi_linear",
    "kda_recurrent_reference",
    "registered_backends",
    "resolve_backend",
]


def triton_runs_on(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` (None: a GPU, or the interpreter for CPU tensors)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if device.type == "cuda" or (device.type == "cpu" and _interpret()):
        return None
    return f"the Triton kernels need a CUDA device (got {device.type}; TRITON_INTERPRET=1 runs them on CPU for tests)"


def _interpret() -> bool:
    from moestack.ops.launch import interpret

    return interpret()


def fixed_smem_bytes(K: int, elt: int = 2) -> int:
    """Shared memory of the largest fixed-config kernel (K1, B3a, B3b) at head dim K, as compiled for sm_90 by
    Triton 3.6 with 2-byte intermediates (benchmarks/tools/launch_fit_check.py: 69632 B up to K = 128, B3a's
    81920 B at 256), scaled for wider ones. The autotuned K2 / B2 prune their own configs (moestack/ops/launch.py)."""
    return (69632 if K <= 128 else 81920) * elt // 2


class TritonKDA(Backend):
    """Our Triton kernels (triton_op.py). Imported on first call, so a test's TRITON_INTERPRET is seen first."""

    name = "triton"

    def unavailable(self, device: torch.device) -> str | None:
        return triton_runs_on(device)

    def verify(self, lead: torch.Tensor) -> str | None:
        if lead.shape[-1] > 256:
            return f"head dim {lead.shape[-1]} > 256"
        if lead.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {lead.dtype} (fp32 / bf16 / fp16 only)"
        if lead.is_cuda and lead.shape[-1] > 128:
            # H200, 2026-12-03: at K 256 fp16 inputs gave gradients up to 84% off and fp32 inputs an autotuned kernel
            # out of shared memory; no GPU test covers bf16 there (README.md, Backends)
            return f"head dim {lead.shape[-1]} > 128 on CUDA (no GPU test passes there)"
        if lead.is_cuda:
            from moestack.ops.launch import fits

            need = fixed_smem_bytes(lead.shape[-1], lead.element_size())
            if not fits(need, lead.device, warps=8):
                return f"its fixed-config kernels need {need} B of shared memory per block, more than this GPU has"
        return self.unavailable(lead.device)

    def fn(self, q, k, v, g, beta, **kw):
        return importlib.import_module("moestack.ops.kda.triton_op").kda_triton(q, k, v, g, beta, **kw)


class FlaKDA(Backend):
    """fla's chunk_kda (the public anchor of benchmarks/kda.py); never picked by "auto"."""

    name = "fla"

    def unavailable(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("fla") is None:
            return "fla is not installed (pip install flash-linear-attention)"
        return None if device.type == "cuda" else "fla runs on CUDA only"

    def picks(self, lead: torch.Tensor) -> bool:
        return False

    def prefers(self, device: torch.device) -> bool:
        return False

    def fn(self, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
        from fla.ops.kda import chunk_kda as fla_chunk_kda  # optional dependency

        del chunk_size  # fla picks its own (64)
        if initial_state is not None:
            initial_state = initial_state.float()  # fla keeps the recurrent state in fp32
        return fla_chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state,
                             cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())


REGISTRY = Registry("KDA", tuned_op="kda")
REGISTRY.register(TritonKDA())
REGISTRY.register(FlaKDA())
REGISTRY.register(ReferenceBackend(kda_chunked_reference))


def registered_backends() -> list[str]:
    return sorted(REGISTRY.names())


def resolve_backend(backend: str | None = None, q: torch.Tensor | None = None) -> str:
    """The backend `chunk_kda` would use for q (default: a bf16 probe of head dim 128 on the current device)."""
    if q is None:
        q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    return REGISTRY.pick(backend, q, lambda: tuned.kda_key(q)).name


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked. Layout as fla; q and k already L2-normalised by the caller.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0, already activated); beta: [B, T, H].
    scale defaults to K ** -0.5; initial_state [N, H, K, V]; cu_seqlens int [N + 1] offsets (B == 1).
    backend: a REGISTRY name, or None / "auto". Returns (o [B, T, H, V] in v.dtype, final_state [N, H, K, V]
    fp32 or None). Under torch.compile one custom op (custom_ops.py), the same backend and kernels.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if torch.compiler.is_compiling():
        o, ht = kda_custom_ops.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                         backend, chunk_size)
        return o, (ht if output_final_state else None)
    return chunk_kda_eager(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend,
                           chunk_size)


@opaque
def chunk_kda_eager(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend, chunk_size):
    """chunk_kda outside compile (and inside the custom op): the picked backend on the inputs as given."""
    if is_fake(q):
        return _shapes_only(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)
    b = REGISTRY.pick(backend, q, lambda: tuned.kda_key(q))
    return b.fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _shapes_only(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
    """A dry run (fake tensors, moestack/train/dry_run.py: shapes, no values): outputs of the right shapes and dtypes
    that depend on every input, so backward reaches each of them, in a handful of ops instead of the reference's
    chunk loop (~2 ms per op on fake tensors: the loop was half of a K3 stage's dry run). Not KDA's math."""
    B, T, H, K = q.shape
    mix = (q * k * g.exp()).sum(-1, keepdim=True) * beta.unsqueeze(-1)  # [B, T, H, 1]
    o = (v * mix).to(v.dtype)
    if not output_final_state:
        return o, None
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    S = torch.einsum("bthk,bthv->bhkv", k.float(), v.float()).sum(0, keepdim=True).expand(N, H, K, v.shape[-1])
    return o, S + initial_state.float() if initial_state is not None else S
