"""DSA's ops as custom ops (moestack/ops/dsa/custom_ops.py): torch.library.opcheck (schema, fake tensors, autograd
registration, AOT dispatch) at awkward shapes (T = 37, top-k above the early rows' causal prefix so -1 slots appear,
two packed documents), and every entry under torch.compile(fullgraph=True) gives the eager outputs and gradients bit
for bit, on the reference and on the Triton kernels (interpreter on CPU, fp32); the model's chain (top-k -> sparse
attention -> KL target, scores, KL loss) compiles without a graph break. GPU: bf16 at T = 4096, top-2048, inductor
within bf16 bounds of eager."""

from __future__ import annotations

import os

import pytest
import torch

from moestack.ops import dsa
from moestack.ops.dsa import custom_ops as C

triton_runs = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
BACKENDS = [pytest.param("triton", marks=triton_runs), "reference"]

B, T, H, V, R, K, Hi, Di = 1, 37, 3, 32, 16, 20, 2, 16  # K = 20 > t + 1 for the first 19 rows: -1 slots
SCALE = (V + R) ** -0.5
CU = [0, 15, 37]


def _inputs(seed, device="cpu", dtype=torch.float32, shape=(B, T, H, V, R, Hi, Di)):
    b, t, h, v, r, hi, di = shape
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    return rnd(b, t, h, v + r), rnd(b, t, v + r), rnd(b, t, hi, di), rnd(b, t, di), rnd(b, t, hi)


def _cu(device="cpu"):
    return torch.tensor(CU, dtype=torch.int32, device=device)


def _idx(q_idx, k_idx, w, backend, cu=None, top_k=K):
    return dsa.indexer_topk_from_inputs(q_idx.detach(), k_idx.detach(), w.detach(), top_k, cu_seqlens=cu,
                                        backend=backend)


def _outputs_and_grads(fn, inputs, seed):
    outs = [o for o in fn(*inputs) if o is not None]
    gen = torch.Generator().manual_seed(seed)
    diff = [o for o in outs if o.requires_grad]
    seeds = [torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype) for o in diff]
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(diff, wrt, seeds, allow_unused=True) if diff else ()
    return [*outs, *grads]


def _compare_compiled(fn, inputs, seed=7):
    eager = _outputs_and_grads(fn, inputs, seed)
    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs, seed)
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        assert (a is None) == (b is None), i
        assert a is None or torch.equal(a, b), i


# ------------------------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_attention_and_topk(backend):
    q, kv, q_idx, k_idx, w = _inputs(0)
    plain = [t.detach() for t in (q_idx, k_idx, w)]
    torch.library.opcheck(C.indexer_topk_from_inputs, (*plain, K, None, backend))
    torch.library.opcheck(C.indexer_topk_from_inputs, (*plain, K, _cu(), backend))
    idx = _idx(q_idx, k_idx, w, backend, _cu())
    assert (idx < 0).any() and (idx >= 0).any()
    torch.library.opcheck(C.sparse_mqa_attention, (q, kv, idx, V, SCALE, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_scores_target_kl(backend):
    q, kv, q_idx, k_idx, w = _inputs(1)
    idx = _idx(q_idx, k_idx, w, backend)
    torch.library.opcheck(C.indexer_scores_at, (q_idx, k_idx, w, idx, backend))
    _, lse = dsa.sparse_mqa_attention(q.detach(), kv.detach(), idx, V, SCALE, backend=backend)
    torch.library.opcheck(C.attention_probs_target, (q.detach(), kv.detach(), SCALE, lse, idx, None, backend))
    target = dsa.attention_probs_target(q.detach(), kv.detach(), SCALE, lse=lse, idx=idx, backend=backend)
    scores = dsa.indexer_scores_at(q_idx, k_idx, w, idx, backend=backend).detach().requires_grad_()
    torch.library.opcheck(C.indexer_kl_loss, (scores, target, None, backend))  # KL over the selection [B, T, K]


def test_opcheck_dense_forms():
    """The dense warm-up's target (two documents) and the KL's sparse-over-S form: the reference serves them."""
    q, kv, q_idx, k_idx, w = _inputs(2)
    qd, kvd = q.detach(), kv.detach()
    torch.library.opcheck(C.attention_probs_target, (qd, kvd, SCALE, None, None, _cu(), "reference"))
    target = dsa.attention_probs_target(qd, kvd, SCALE, cu_seqlens=_cu())
    scores = dsa.reference.indexer_scores(q_idx, k_idx, w, _cu()).detach().requires_grad_()
    torch.library.opcheck(C.indexer_kl_loss, (scores, target, None, None))
    idx = _idx(q_idx, k_idx, w, "reference", _cu())
    torch.library.opcheck(C.indexer_kl_loss, (scores, target, idx, None))


# ------------------------------------------------------------------------------------------------ compiled == eager


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_compiles_whole(backend):
    q, kv, q_idx, k_idx, w = _inputs(3)
    idx = _idx(q_idx, k_idx, w, backend, _cu())
    _compare_compiled(lambda q, kv: dsa.sparse_mqa_attention(q, kv, idx, V, SCALE, backend=backend), (q, kv))
    if backend == "reference":  # o alone (lse's gradient None; test_model_chain_* for triton), kv fp64 under q fp32
        kv64 = kv.detach().double().requires_grad_()
        _compare_compiled(lambda q, kv: dsa.sparse_mqa_attention(q, kv, idx, V, SCALE, backend=backend)[0] * 1.0,
                          (q, kv64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu", [False, True])
def test_topk_and_target_compile_whole(backend, cu):
    q, kv, q_idx, k_idx, w = _inputs(4)
    cu_t = _cu() if cu else None

    def fn(q, kv, q_idx, k_idx, w):
        idx = _idx(q_idx, k_idx, w, backend, cu_t)
        _, lse = dsa.sparse_mqa_attention(q.detach(), kv.detach(), idx, V, SCALE, backend=backend)
        target = dsa.attention_probs_target(q, kv, SCALE, lse=lse, idx=idx, backend=backend)
        return idx, target

    _compare_compiled(fn, (q, kv, q_idx, k_idx, w))
    if backend == "reference":  # the dense warm-up target
        _compare_compiled(lambda q, kv: (dsa.attention_probs_target(q, kv, SCALE, cu_seqlens=cu_t),), (q, kv))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_and_kl_compile_whole(backend):
    q, kv, q_idx, k_idx, w = _inputs(5)
    idx = _idx(q_idx, k_idx, w, backend)
    target = torch.rand(B, T, K, generator=torch.Generator().manual_seed(5)).masked_fill(idx < 0, 0)
    target = target / target.sum(-1, keepdim=True)
    _compare_compiled(lambda a, b, c: (dsa.indexer_scores_at(a, b, c, idx, backend=backend).nan_to_num(0.0),),
                      (q_idx, k_idx, w))
    _compare_compiled(lambda a, b, c: (dsa.indexer_kl_loss(dsa.indexer_scores_at(a, b, c, idx, backend=backend),
                                                           target, backend=backend),), (q_idx, k_idx, w))


def test_kl_dense_forms_compile_whole():
    _, _, q_idx, k_idx, w = _inputs(6)
    idx = _idx(q_idx, k_idx, w, "reference", _cu())
    p = torch.rand(B, T, T, generator=torch.Generator().manual_seed(6))
    for sel in (None, idx):
        _compare_compiled(lambda a, b, c, sel=sel: (dsa.indexer_kl_loss(dsa.reference.indexer_scores(a, b, c, _cu()),
                                                                        p, sel),), (q_idx, k_idx, w))


def _chain(backend, top_k=K, v_dim=V, scale=SCALE):
    """moestack/model/dsa.py's sparse stage: top-k -> sparse attention -> KL target, scores at the selection, KL."""

    def fn(q_abs, kv, q_idx, k_idx, w, cu):
        idx = _idx(q_idx, k_idx, w, backend, cu, top_k)
        o, lse = dsa.sparse_mqa_attention(q_abs, kv, idx, v_dim, scale, backend=backend)
        target = dsa.attention_probs_target(q_abs.detach(), kv.detach(), scale, lse=lse.detach(), idx=idx,
                                            backend=backend)
        scores = dsa.indexer_scores_at(q_idx, k_idx, w, idx, backend=backend)
        return o, dsa.indexer_kl_loss(scores, target, backend=backend)

    return fn


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_chain_compiles_whole(backend):
    """One graph (fullgraph=True) through every DSA op, fp32: the same outputs and gradients as eager (bit for bit:
    AOTAutograd sums the two gradients of kv in its own order, so kv within 1e-6)."""
    inputs = _inputs(8)
    fn = _chain(backend)
    eager = _outputs_and_grads(fn, (*inputs, _cu()), 9)
    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), (*inputs, _cu()), 9)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_layer_compiles_whole():
    """GatedMLA (sparse mode, rope, gate, two documents) compiled whole: its DSA calls are graph nodes."""
    from moestack.config.model_spec import IndexerSpec, MLASpec
    from moestack.model.dsa import GatedMLA

    spec = MLASpec(num_heads=3, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16,
                   v_head_dim=8, use_rope=True, output_gate=True,
                   indexer=IndexerSpec(num_heads=2, head_dim=16, top_k=8))
    torch.manual_seed(0)
    layer = GatedMLA(32, spec, 1e-5)
    layer.init_weights(0.3)
    layer.dsa_backend = "reference"
    x = torch.randn(1, 20, 32, requires_grad=True)
    cu = torch.tensor([0, 7, 20])
    runs = []
    for f in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        layer.zero_grad()
        x.grad = None
        y = f(x, cu_seqlens=cu)
        y.square().mean().backward()
        runs.append((y, x.grad, layer.kv_a_proj.weight.grad, layer.indexer.wq.weight.grad, layer.last_indexer_loss))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unschematic_arguments_stay_a_graph_boundary():
    """A tensor scale has no custom-op schema here: the entry runs its @opaque eager path (a graph break)."""
    from moestack.ops.opaque import activate

    activate()
    q, kv, q_idx, k_idx, w = _inputs(10)
    idx = _idx(q_idx, k_idx, w, "reference")
    scale = torch.tensor(SCALE, dtype=torch.float64)
    torch._dynamo.reset()
    got = torch.compile(lambda q, kv: dsa.sparse_mqa_attention(q, kv, idx, V, scale), backend="aot_eager")(q, kv)
    want = dsa.sparse_mqa_attention(q, kv, idx, V, scale)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------------------------------------ GPU, bf16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_chain_gpu_bf16_inductor():
    """T = 4096, 16 heads of a 512 + 64 latent, top-2048, an 8 x 128 indexer, two documents: the chain under
    inductor (custom ops inside one graph) vs eager, the Triton kernels both ways."""
    shape = (1, 4096, 16, 512, 64, 8, 128)
    q, kv, q_idx, k_idx, w = _inputs(11, "cuda", torch.bfloat16, shape)
    cu = torch.tensor([0, 1500, 4096], dtype=torch.int32, device="cuda")
    fn = _chain("auto", top_k=2048, v_dim=512, scale=576**-0.5)
    eager = _outputs_and_grads(fn, (q, kv, q_idx, k_idx, w, cu), 12)
    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(fn, fullgraph=True), (q, kv, q_idx, k_idx, w, cu), 12)
    for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        a, b = a.double(), b.double()
        assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() < 2e-2, i
