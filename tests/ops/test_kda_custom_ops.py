"""KDA's chunked recurrence and short conv as custom ops (moestack/ops/kda/custom_ops.py): torch.library.opcheck
(schema, fake tensors, autograd registration), and the entries under torch.compile(fullgraph=True) give the eager
outputs and every gradient bit for bit: the Triton kernels (interpreter on CPU, fp32) and the reference backend
(fp64, whose backward op differentiates its forward again). GPU: bf16, inductor, within bf16 bounds of eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestack.ops.kda import chunk_kda
from moestack.ops.kda import custom_ops as kda_ops

triton_runs = pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET")
                                 != "1", reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


def _kda_inputs(B, T, H, K, V, *, h0, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = F.normalize(rnd(B, T, H, K), dim=-1), F.normalize(rnd(B, T, H, K), dim=-1)
    x = [q, k, rnd(B, T, H, V), F.logsigmoid(rnd(B, T, H, K) + 1.0), torch.sigmoid(rnd(B, T, H))]
    x = [t.to(device=device, dtype=dtype).requires_grad_() for t in x]
    state = (0.5 * rnd(B, H, K, V)).to(device=device, dtype=dtype).requires_grad_() if h0 else None
    return x, state


def _outputs_and_grads(fn, inputs, seed):
    outs = [o for o in fn(*inputs) if o is not None]
    gen = torch.Generator().manual_seed(seed)
    seeds = [torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype) for o in outs]
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return (*outs, *torch.autograd.grad(outs, wrt, seeds))


def _compare_compiled(fn, inputs, seed=7):
    eager = _outputs_and_grads(fn, inputs, seed)
    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs, seed)
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend,dtype", [pytest.param("triton", torch.float32, marks=triton_runs),
                                           ("reference", torch.float64)])
def test_chunk_kda_opcheck(backend, dtype):
    (q, k, v, g, beta), h0 = _kda_inputs(1, 37, 2, 16, 8, h0=True, dtype=dtype)
    torch.library.opcheck(kda_ops.chunk_kda, (q, k, v, g, beta, 0.25, h0, True, None, backend, 64))
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    torch.library.opcheck(kda_ops.chunk_kda, (q, k, v, g, beta, 0.25, None, False, cu, backend, 64))


@pytest.mark.parametrize("backend,dtype", [pytest.param("triton", torch.float32, marks=triton_runs),
                                           ("reference", torch.float64)])
@pytest.mark.parametrize("final_state", [False, True])
def test_chunk_kda_compiles_whole(backend, dtype, final_state):
    (q, k, v, g, beta), h0 = _kda_inputs(2, 70, 2, 16, 8, h0=final_state, dtype=dtype, seed=3)

    def fn(q, k, v, g, beta, h0):
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=final_state, backend=backend)
        return o * 1.0, ht

    _compare_compiled(fn, (q, k, v, g, beta, h0))


@pytest.mark.parametrize("backend,dtype", [pytest.param("triton", torch.float32, marks=triton_runs),
                                           ("reference", torch.float64)])
def test_chunk_kda_documents_compile_whole(backend, dtype):
    (q, k, v, g, beta), _ = _kda_inputs(1, 90, 2, 16, 8, h0=False, dtype=dtype, seed=4)
    cu = torch.tensor([0, 3, 50, 90], dtype=torch.int32)
    _compare_compiled(lambda *x: chunk_kda(*x, cu_seqlens=cu, backend=backend)[:1], (q, k, v, g, beta))


def _conv_inputs(B, T, C, W, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.rand(C, 1, W, generator=gen) - 0.5).to(device).requires_grad_()
    return x, w


@triton_runs
def test_short_conv_opcheck_and_compiles_whole():
    from moestack.model.kda import _doc_positions
    from moestack.ops.kda.short_conv import short_conv_silu

    x, w = _conv_inputs(2, 37, 12, 4)
    torch.library.opcheck(kda_ops.short_conv_silu, (x, w, None))
    pos = _doc_positions(37, torch.tensor([0, 5, 37]), torch.device("cpu"))
    torch.library.opcheck(kda_ops.short_conv_silu, (x[:1].detach().requires_grad_(), w, pos))
    _compare_compiled(lambda x, w: (short_conv_silu(x, w) + 0.0,), (x, w))
    _compare_compiled(lambda x, w: (short_conv_silu(x, w, pos) + 0.0,), (x[:1].detach().requires_grad_(), w))
    # the backward's real outputs have its fake's (contiguous) strides: inductor asserts them on the GPU
    dx, dw = kda_ops.short_conv_silu_backward(x.detach(), w.detach(), None, torch.randn_like(x))
    assert dx.shape == x.shape and dw.shape == w.shape and dx.is_contiguous() and dw.is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_kda_and_conv_within_bf16():
    """bf16 at a K3 KDA layer's per-head shapes, inductor: the compiled graph runs the same kernels, so outputs and
    gradients agree with eager to bf16 rounding of the glue."""
    from moestack.ops.kda.short_conv import short_conv_silu

    (q, k, v, g, beta), h0 = _kda_inputs(1, 4096, 8, 128, 128, h0=True, dtype=torch.bfloat16, device="cuda")
    x, w = _conv_inputs(1, 4096, 1024, 4, device="cuda", dtype=torch.bfloat16)

    def fn(q, k, v, g, beta, h0, x, w):
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return o * 2.0, ht, short_conv_silu(x, w) * 2.0

    inputs = (q, k, v, g, beta, h0, x, w)
    eager = _outputs_and_grads(fn, inputs, 9)
    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(fn, fullgraph=True), inputs, 9)
    for a, b in zip(eager, compiled, strict=True):
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        assert torch.isfinite(b).all() and err < 1e-2, err
