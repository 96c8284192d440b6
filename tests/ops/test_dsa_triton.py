"""Triton DSA kernels against the PyTorch reference: sparse MQA attention (o, lse, dq, dkv; both dKV modes),
indexer top-k, dispatcher registration.

CPU: kernels under TRITON_INTERPRET=1 in fp32 at tiny shapes (the interpreter's fp32 dot is exact, bounds tight).
GPU (`-m gpu`, scripts/gpu_check.sh): bf16 at full size (576 = 512 + 64 latent, k = 2048), bf16 bounds.
Fresh seeded random inputs; kernel outputs are allocated NaN-poisoned, so an unwritten element fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are decorated
pytest.importorskip("triton")

from moestack.ops import dsa as dsa_ops
from moestack.ops.dsa import reference as ref
from moestack.ops.dsa.triton_indexer import attention_probs_target_triton, indexer_topk_triton
from moestack.ops.dsa.triton_indexer_scores import indexer_scores_at_triton
from moestack.ops.dsa.triton_op import sparse_mqa_attention_triton

CPU_TOL = 2e-5
GPU_TOL_OUT, GPU_TOL_GRAD = 2e-2, 3e-2  # bf16 inputs, bf16 P in the PV / dKV products


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _random_idx(B, T, K, seed, cu=None, device="cpu"):
    """Per query a random subset of its visible keys (causal, same document), -1 padded, in random slot order."""
    g = torch.Generator().manual_seed(seed)
    doc = None if cu is None else ref.document_ids(torch.tensor(cu), T)
    idx = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            lo = 0 if doc is None else int(cu[int(doc[t])])
            vis = torch.arange(lo, t + 1)
            n = int(torch.randint(1, min(K, len(vis)) + 1, (1,), generator=g))
            pick = vis[torch.randperm(len(vis), generator=g)[:n]]
            idx[b, t, torch.randperm(K, generator=g)[:n]] = pick.to(torch.int32)
    return idx.to(device)


def _check_attention(B, T, H, V, R, K, idx, mode, dtype, device, tol_o, tol_g, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, V + R, generator=g, device=device, dtype=torch.float32)
    kv = torch.randn(B, T, V + R, generator=g, device=device, dtype=torch.float32)
    scale = (V + R) ** -0.5
    qa, ka = q.to(dtype).requires_grad_(), kv.to(dtype).requires_grad_()
    o, lse = sparse_mqa_attention_triton(qa, ka, idx, V, scale, dkv_mode=mode)
    do = torch.randn(o.shape, generator=g, device=device, dtype=torch.float32)
    dlse = torch.randn(lse.shape, generator=g, device=device, dtype=torch.float32)
    ((o.float() * do).sum() + (lse * dlse).sum()).backward()

    q64, kv64 = qa.detach().double().requires_grad_(), ka.detach().double().requires_grad_()
    ro, rlse = ref.sparse_mqa_attention_blockwise(q64, kv64, idx, V, scale)  # bounded memory at full size
    ((ro * do.double()).sum() + (rlse * dlse.double()).sum()).backward()
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert _rel(o, ro) < tol_o, ("o", _rel(o, ro))
    assert _rel(lse, rlse) < tol_o, ("lse", _rel(lse, rlse))
    assert _rel(qa.grad, q64.grad) < tol_g, ("dq", _rel(qa.grad, q64.grad))
    assert _rel(ka.grad, kv64.grad) < tol_g, ("dkv", _rel(ka.grad, kv64.grad))


# ------------------------------------------------------------------------------------------------ CPU (interpreter)


# H 20: one full + one padded head block of 16; 33: three blocks
@pytest.mark.parametrize(("H", "mode"), [(20, "kmajor_ds"), (33, "kmajor_ds"), (20, "sorted_ds")])
def test_attention_matches_reference(H, mode):
    B, T, V, R, K = 3 - H // 20, 17, 32, 16, 18  # T, K not multiples of the 16-wide blocks
    _check_attention(B, T, H, V, R, K, _random_idx(B, T, K, seed=H), mode, torch.float32, "cpu", CPU_TOL, CPU_TOL)


@pytest.mark.parametrize("mode", ["kmajor_ds", "sorted_ds"])
def test_attention_odd_dims_and_no_rope(mode):
    """V, R need not be powers of two (padded tiles); R = 0 (NoPE latent) works; V = 40 spans two 32-wide column
    chunks (the interpreter's BLOCK_C), the second one partly masked."""
    for V, R in [(20, 8), (24, 0), (40, 8)]:
        idx = _random_idx(1, 9, 5, seed=V)
        _check_attention(1, 9, 3, V, R, 5, idx, mode, torch.float32, "cpu", CPU_TOL, CPU_TOL, seed=V)


@pytest.mark.parametrize("mode", ["kmajor_ds", "sorted_ds"])
def test_attention_varlen_packed(mode):
    cu = [0, 5, 6, 17]
    idx = _random_idx(1, 17, 6, seed=3, cu=cu)
    _check_attention(1, 17, 4, 32, 16, 6, idx, mode, torch.float32, "cpu", CPU_TOL, CPU_TOL)


@pytest.mark.parametrize(("mode", "tile"), [("kmajor_ds", 64), ("kmajor_ds", 4), ("sorted_ds", 2)])
def test_two_pass_token_chunks(mode, tile, monkeypatch):
    """The two-pass backward over several token chunks (dS buffer of 3 tokens, 2 x 13 tokens: a chunk straddles
    the sequences); K = 20 spans two 16-slot blocks, the second one partly masked; slots sorted by key, pass 1 in
    tiles of `tile` tokens (partial tiles in every chunk)."""
    from moestack.ops.dsa import triton_attn_bwd

    B, T, H, V, R, K = 2, 13, 3, 32, 16, 20
    monkeypatch.setattr(triton_attn_bwd, "DS_BUFFER_BYTES", 3 * K * triton_attn_bwd.DS_HEAD_PAD * 4)
    monkeypatch.setattr(triton_attn_bwd, "TOKEN_TILE", tile)
    _check_attention(B, T, H, V, R, K, _random_idx(B, T, K, seed=41), mode, torch.float32, "cpu", CPU_TOL, CPU_TOL)


def test_all_keys_selected_equals_dense():
    """k >= T with every visible key selected (padding -1 after them): sparse == dense causal attention."""
    B, T, H, V, R, K = 1, 13, 5, 32, 16, 16
    g = torch.Generator().manual_seed(7)
    q, kv = torch.randn(B, T, H, V + R, generator=g), torch.randn(B, T, V + R, generator=g)
    ar = torch.arange(K)
    idx = torch.where(ar[None, :] <= torch.arange(T)[:, None], ar[None, :], -1).to(torch.int32)[None]
    o, lse = sparse_mqa_attention_triton(q, kv, idx, V, 0.3)
    do_, dl_ = ref.dense_mqa_attention(q.double(), kv.double(), V, 0.3)
    assert _rel(o, do_) < CPU_TOL and _rel(lse, dl_) < CPU_TOL


def test_empty_rows_and_bad_input():
    q, kv = torch.randn(1, 3, 2, 48), torch.randn(1, 3, 48)
    idx = torch.tensor([[[-1, -1], [0, -1], [2, 1]]], dtype=torch.int32)
    o, lse = sparse_mqa_attention_triton(q, kv, idx, 32, 0.2)
    assert torch.all(o[0, 0] == 0) and torch.all(lse[0, 0] == float("-inf"))  # as the reference
    with pytest.raises(ValueError, match="v_dim"):
        sparse_mqa_attention_triton(q, kv, idx, 64, 0.2)
    with pytest.raises(ValueError, match="dkv_mode"):
        sparse_mqa_attention_triton(q, kv, idx, 32, 0.2, dkv_mode="fast")


def test_backward_empty_rows_all_modes():
    """Queries with no selected key (lse = -inf, o = 0) get dq = 0 and add nothing to dkv in every dKV mode; the
    other rows' gradients agree across modes (the reference's autograd gives NaN through an empty logsumexp)."""
    g = torch.Generator().manual_seed(19)
    q, kv = torch.randn(1, 9, 3, 48, generator=g), torch.randn(1, 9, 48, generator=g)
    idx = _random_idx(1, 9, 5, seed=19)
    idx[0, 3] = idx[0, 7] = -1
    do, dlse = torch.randn(1, 9, 3, 32, generator=g), torch.randn(1, 9, 3, generator=g)
    empty = (idx < 0).all(-1, keepdim=True)  # [1, 9, 1]: rows 3 and 7
    grads = {}
    for mode in ("kmajor_ds", "sorted_ds"):
        qa, ka = q.clone().requires_grad_(), kv.clone().requires_grad_()
        o, lse = sparse_mqa_attention_triton(qa, ka, idx, 32, 0.2, dkv_mode=mode)
        ((o * do).sum() + (lse.masked_fill(empty, 0) * dlse).sum()).backward()  # lse -inf there
        assert torch.all(qa.grad[0, [3, 7]] == 0) and torch.isfinite(ka.grad).all()
        grads[mode] = (qa.grad, ka.grad)
    for a, b in zip(grads["sorted_ds"], grads["kmajor_ds"], strict=True):
        assert _rel(a, b) < CPU_TOL


def _assert_same_topk(got, q, k, w, top_k, cu):
    """Equal selected-score multisets and -1 counts (index order may differ on exact ties)."""
    S = ref.indexer_scores(q.double(), k.double(), w.double(), cu)
    want = ref.indexer_topk(S, top_k)
    assert torch.equal((got < 0).sum(-1), (want < 0).sum(-1))
    def sc(i):
        return S.gather(-1, i.long().clamp_min(0)).masked_fill(i < 0, 0).sort(-1).values
    torch.testing.assert_close(sc(got), sc(want), rtol=1e-5, atol=1e-5)
    assert torch.all(got.long() <= torch.arange(got.shape[1])[None, :, None])  # causal


@pytest.mark.parametrize("cu", [None, [0, 10, 25, 37]])
def test_indexer_topk_matches_reference(cu):
    g = torch.Generator().manual_seed(11)
    B, T, Hi, Di = 1, 37, 4, 20
    q, k, w = (
        torch.randn(B, T, Hi, Di, generator=g),
        torch.randn(B, T, Di, generator=g),
        torch.randn(B, T, Hi, generator=g),
    )
    cu_t = None if cu is None else torch.tensor(cu)
    got = indexer_topk_triton(q, k, w, 8, cu_t, chunk_bytes=16 * T * 4)  # several chunks
    assert got.dtype == torch.int32 and got.shape == (B, T, 8)
    _assert_same_topk(got, q, k, w, 8, cu_t)


def test_probs_target_matches_reference():
    """The sparse-stage KL target from the attention's lse (head-summed probabilities over the selection)."""
    g = torch.Generator().manual_seed(13)
    B, T, H, D, K = 2, 11, 20, 48, 7
    q, kv = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, D, generator=g)
    idx = _random_idx(B, T, K, seed=13)
    _, lse = ref.sparse_mqa_attention(q, kv, idx, 32, 0.2)
    got = attention_probs_target_triton(q, kv, 0.2, lse=lse, idx=idx)
    want = ref.attention_probs_target(q.double(), kv.double(), 0.2, lse=lse.double(), idx=idx)
    assert torch.all(got[idx < 0] == 0)
    assert _rel(got, want) < CPU_TOL


def test_indexer_scores_at_and_grads():
    """Scores at the selected keys (-inf at -1) and the gradients of q_idx, k_idx, w through the sparse KL loss."""
    g = torch.Generator().manual_seed(17)
    B, T, Hi, Di, K = 2, 13, 3, 20, 6
    q, k, w = (torch.randn(*s, generator=g) for s in ((B, T, Hi, Di), (B, T, Di), (B, T, Hi)))
    idx = _random_idx(B, T, K, seed=17)
    p = torch.rand(B, T, K, generator=g).masked_fill(idx < 0, 0)
    p = p / p.sum(-1, keepdim=True)
    got_in = [x.clone().requires_grad_() for x in (q, k, w)]
    want_in = [x.double().requires_grad_() for x in (q, k, w)]
    I_got = indexer_scores_at_triton(*got_in, idx)
    I_want = ref.indexer_scores_at(*want_in, idx)
    assert torch.equal(I_got == float("-inf"), idx < 0)
    assert _rel(I_got.masked_fill(idx < 0, 0), I_want.masked_fill(idx < 0, 0)) < CPU_TOL
    ref.indexer_kl_loss(I_got, p).backward()
    ref.indexer_kl_loss(I_want, p.double()).backward()
    for a, b in zip(got_in, want_in, strict=True):
        assert _rel(a.grad, b.grad) < CPU_TOL


def test_dispatcher_registration():
    q = torch.randn(1, 4, 2, 48)
    assert "triton" in dsa_ops.backends("sparse_mqa_attention")
    assert dsa_ops.select_backend("sparse_mqa_attention", q) == "reference"  # never picked for CPU by default
    assert dsa_ops.select_backend("sparse_mqa_attention", q, "triton") == "triton"  # interpreter, when named
    idx = _random_idx(1, 4, 3, seed=1)
    o, _ = dsa_ops.sparse_mqa_attention(q, torch.randn(1, 4, 48), idx, 32, 0.2, backend="triton")
    assert o.shape == (1, 4, 2, 32)
    for op in ("indexer_topk_from_inputs", "attention_probs_target", "indexer_scores_at"):
        assert dsa_ops.select_backend(op, q) == "reference" and "triton" in dsa_ops.backends(op)


def test_gated_dsa_layer_triton_backend_matches_reference(monkeypatch):
    """The Gated DSA layer end to end (packed documents, rope, gate; sparse mode) with every op on "triton"
    (interpreter) vs "reference": output, input / latent / indexer gradients, indexer loss."""
    from moestack.config.model_spec import IndexerSpec, MLASpec
    from moestack.model.dsa import GatedMLA

    spec = MLASpec(
        num_heads=3, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8,
        use_rope=True, output_gate=True, indexer=IndexerSpec(num_heads=2, head_dim=16, top_k=8),
    )  # fmt: skip
    torch.manual_seed(0)
    layer = GatedMLA(32, spec, 1e-5)
    layer.init_weights(0.3)
    x = torch.randn(1, 20, 32)
    runs = {}
    for name in ("triton", "reference"):
        layer.dsa_backend = name
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi, cu_seqlens=torch.tensor([0, 7, 20]))
        y.square().mean().backward()
        runs[name] = (y, xi.grad, layer.kv_a_proj.weight.grad, layer.indexer.wq.weight.grad, layer.last_indexer_loss)
    for got, want in zip(runs["triton"], runs["reference"], strict=True):
        assert _rel(got, want) < CPU_TOL


# ------------------------------------------------------------------------------------------------ GPU, bf16


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["kmajor_ds", "sorted_ds"])
@pytest.mark.parametrize("H", [20, 64, 96])
def test_attention_gpu_bf16_full_size(H, mode):
    B, T, V, R, K = 1, 1000, 512, 64, 256
    g = torch.Generator().manual_seed(H)
    idx = torch.stack([torch.cat((torch.randperm(t + 1, generator=g)[:K], torch.full((max(0, K - t - 1),), -1)))
                       for t in range(T)]).to(torch.int32)[None].cuda()  # fmt: skip
    _check_attention(B, T, H, V, R, K, idx, mode, torch.bfloat16, "cuda", GPU_TOL_OUT, GPU_TOL_GRAD)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["kmajor_ds", "sorted_ds"])
def test_attention_gpu_k2048_varlen(mode):
    cu = [0, 1500, 1501, 4096]
    T, K = 4096, 2048
    g = torch.Generator().manual_seed(5)
    doc = ref.document_ids(torch.tensor(cu), T)
    rows = []
    for t in range(T):
        lo = cu[int(doc[t])]
        pick = lo + torch.randperm(t + 1 - lo, generator=g)[:K]
        rows.append(torch.cat((pick, torch.full((K - len(pick),), -1))))
    idx = torch.stack(rows).to(torch.int32)[None].cuda()
    _check_attention(1, T, 64, 512, 64, K, idx, mode, torch.bfloat16, "cuda", GPU_TOL_OUT, GPU_TOL_GRAD)


@pytest.mark.gpu
@pytest.mark.parametrize("cu", [None, [0, 3000, 8192]])
def test_indexer_topk_gpu(cu):
    g = torch.Generator(device="cuda").manual_seed(2)
    B, T, Hi, Di = 1, 8192, 32, 128
    q = torch.randn(B, T, Hi, Di, generator=g, device="cuda")
    k = torch.randn(B, T, Di, generator=g, device="cuda")
    w = torch.randn(B, T, Hi, generator=g, device="cuda") * Hi**-0.5
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    got = indexer_topk_triton(q, k, w, 2048, cu_t)  # fp32 inputs: tf32 dots, compare score multisets loosely
    want = ref.indexer_topk_from_inputs(q, k, w, 2048, cu_seqlens=cu_t)
    assert torch.equal((got < 0).sum(-1), (want < 0).sum(-1))
    chosen = torch.zeros(T, T + 1, dtype=torch.bool, device="cuda")  # column T collects the -1 slots
    chosen.scatter_(1, want[0].long() % (T + 1), True)
    hits = chosen.gather(1, got[0].long() % (T + 1))[got[0] >= 0]
    assert hits.float().mean() > 0.99, float(hits.float().mean())  # near-tie flips only


@pytest.mark.gpu
def test_gated_dsa_layer_gpu_triton_vs_reference(monkeypatch):
    """The Gated DSA layer (proxy dims: 20 heads, latent 512 + 64, indexer 32 x 128) in sparse mode, bf16 autocast:
    the "triton" backend (picked by default on CUDA) against backend "reference", output and grads."""
    from moestack.config.model_spec import IndexerSpec, MLASpec
    from moestack.model.dsa import GatedMLA

    spec = MLASpec(
        num_heads=20, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, use_rope=False, output_gate=True, indexer=IndexerSpec(num_heads=32, head_dim=128, top_k=256),
    )  # fmt: skip
    torch.manual_seed(0)
    layer = GatedMLA(1536, spec, 1e-5).cuda()
    layer.init_weights(0.02)
    x = torch.randn(1, 1024, 1536, device="cuda")
    runs = {}
    for name in ("triton", "reference"):
        layer.dsa_backend = name
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.float().square().mean().backward()
        runs[name] = (y.float(), xi.grad.float(), layer.kv_a_proj.weight.grad.float(), layer.last_indexer_loss)
    (y_t, gx_t, gw_t, loss_t), (y_r, gx_r, gw_r, loss_r) = runs["triton"], runs["reference"]
    # both bf16; differences come from accumulation order and the top-k flips it causes on near ties
    assert _rel(y_t, y_r) < 5e-2 and _rel(gx_t, gx_r) < 8e-2 and _rel(gw_t, gw_r) < 8e-2
    assert abs(float(loss_t) - float(loss_r)) < 2e-2 * max(1.0, abs(float(loss_r)))


def test_deterministic_algorithms_pick_deterministic_paths(monkeypatch):
    """torch.use_deterministic_algorithms(True): the two-pass sorted dKV scatter, no atomic indexer-score backward."""
    from moestack.ops import dsa
    from moestack.ops.dsa import triton_op

    seen = []
    monkeypatch.setattr(triton_op._SparseMQAttention, "apply", lambda *a: seen.append(a[-1]) or (None, None))
    q, kv = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8)
    idx = torch.zeros(1, 4, 2, dtype=torch.int32)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        triton_op.sparse_mqa_attention_triton(q, kv, idx, 4, 1.0)
        torch.use_deterministic_algorithms(True)
        triton_op.sparse_mqa_attention_triton(q, kv, idx, 4, 1.0)
        cuda_like = type("T", (), {"is_cuda": True})()
        entry = dsa.REGISTRIES["indexer_scores_at"].get("triton")
        assert not entry.picks(cuda_like)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == ["kmajor_ds", "sorted_ds"]
    assert entry.picks(cuda_like)


def test_gluon_forward_refuses_what_it_does_not_cover():
    from moestack.ops.dsa.triton_attn_fwd import sparse_mqa_fwd

    q, kv = torch.randn(1, 4, 2, 576), torch.randn(1, 4, 576)
    idx = torch.zeros(1, 4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="'gluon' needs an sm_90 GPU"):
        sparse_mqa_fwd(q, kv, idx, 512, 0.1, variant="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize(("H", "K", "cfg"), [(64, 2048, None), (20, 256, None), (96, 256, None), (128, 200, None),
                                             (64, 2048, (32, 3)), (64, 2048, (32, 2)), (64, 2000, (16, 4)),
                                             (20, 30, (32, 3))])
def test_gluon_forward_gpu_matches_reference(H, K, cfg):
    """The sm_90 Gluon forward (score tile split over the warpgroups) against the fp32 reference: -1 slots (the
    first rows see fewer than K keys), a row with no key, K not a multiple of the key block, head counts that are
    not a multiple of 64, every key-block / stage config."""
    from moestack.ops.dsa import gluon_attn_fwd

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is sm_90 only")
    B, T, V, R = 1, 2500, 512, 64
    g = torch.Generator(device="cuda").manual_seed(H * 7 + K)
    q = torch.randn(B, T, H, V + R, generator=g, device="cuda").bfloat16()
    kv = torch.randn(B, T, V + R, generator=g, device="cuda").bfloat16()
    idx = _random_idx(B, T, K, seed=H + K, device="cuda")
    scale = (V + R) ** -0.5
    o_ref, lse_ref = ref.sparse_mqa_attention(q.float(), kv.float(), idx.long(), V, scale)
    idx[0, 7] = -1  # a query with no key: o = 0, lse = -inf (the reference needs >= 1 key: row 7 checked alone)
    o, lse = gluon_attn_fwd.sparse_mqa_fwd_gluon(q, kv, idx, V, scale, config=cfg)
    keep = torch.ones(T, dtype=torch.bool, device="cuda")
    keep[7] = False
    assert _rel(o[0, keep], o_ref[0, keep]) < GPU_TOL_OUT
    assert _rel(lse[0, keep], lse_ref[0, keep]) < 1e-3
    assert float(o[0, 7].abs().max()) == 0.0 and bool(torch.isneginf(lse[0, 7]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("cu", [None, [0, 3000, 3001, 8192]])
@pytest.mark.parametrize("config", [None, (256, 4, 2), (256, 6, 2)])
def test_gluon_indexer_scorer_gpu(cu, config, monkeypatch):
    """The sm_90 Gluon candidate pass: the fused top-k with it selects what the Triton scorer selects (bf16; the
    products accumulate in another order, so near-ties may flip) and what the reference selects."""
    from moestack.ops.dsa import gluon_indexer_select
    from moestack.ops.dsa.triton_indexer_fused import indexer_topk_fused

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon scorer is sm_90 only")
    if config:
        monkeypatch.setattr(gluon_indexer_select, "DEFAULT_CONFIG", config)
    g = torch.Generator(device="cuda").manual_seed(3)
    B, T, Hi, Di = 1, 8192, 32, 128
    q = torch.randn(B, T, Hi, Di, generator=g, device="cuda").bfloat16()
    k = torch.randn(B, T, Di, generator=g, device="cuda").bfloat16()
    w = (torch.randn(B, T, Hi, generator=g, device="cuda") * Hi**-0.5).bfloat16()
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    stats = {}
    got = indexer_topk_fused(q, k, w, 2048, cu_seqlens=cu_t, scorer="gluon", stats=stats)
    tri = indexer_topk_fused(q, k, w, 2048, cu_seqlens=cu_t, scorer="triton")
    want = ref.indexer_topk_from_inputs(q.float(), k.float(), w.float(), 2048, cu_seqlens=cu_t)
    assert stats["fallback_rows"] < T // 100  # the candidate lists were complete for almost every row
    for other in (tri, want):
        assert torch.equal((got < 0).sum(-1), (other < 0).sum(-1))
        chosen = torch.zeros(T, T + 1, dtype=torch.bool, device="cuda")
        chosen.scatter_(1, other[0].long() % (T + 1), True)
        hits = chosen.gather(1, got[0].long() % (T + 1))[got[0] >= 0]
        assert hits.float().mean() > 0.99, float(hits.float().mean())


@pytest.mark.gpu
@pytest.mark.parametrize(("Hi", "Di"), [(6, 64), (4, 256)])
def test_gluon_indexer_scorer_head_dims_gpu(Hi, Di):
    """Head dims 64 / 256 (256: the launcher's smaller key tile and ring, shared memory) and a head count that is not
    a multiple of the default group of 4 (pairs): the same selection as the Triton scorer."""
    from moestack.ops.dsa.triton_indexer_fused import indexer_topk_fused

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon scorer is sm_90 only")
    g = torch.Generator(device="cuda").manual_seed(Di)
    T = 4096
    q = torch.randn(1, T, Hi, Di, generator=g, device="cuda").bfloat16()
    k = torch.randn(1, T, Di, generator=g, device="cuda").bfloat16()
    w = (torch.randn(1, T, Hi, generator=g, device="cuda") * Hi**-0.5).bfloat16()
    got = indexer_topk_fused(q, k, w, 512, scorer="gluon")
    tri = indexer_topk_fused(q, k, w, 512, scorer="triton")
    assert torch.equal((got < 0).sum(-1), (tri < 0).sum(-1))
    chosen = torch.zeros(T, T + 1, dtype=torch.bool, device="cuda")
    chosen.scatter_(1, tri[0].long() % (T + 1), True)
    hits = chosen.gather(1, got[0].long() % (T + 1))[got[0] >= 0]
    assert hits.float().mean() > 0.99, float(hits.float().mean())


def test_gluon_indexer_scorer_refuses_what_it_does_not_cover():
    from moestack.ops.dsa.triton_indexer_fused import indexer_topk_fused

    q, k, w = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 16), torch.randn(1, 64, 4)
    with pytest.raises(ValueError, match="scorer 'gluon' needs an sm_90 GPU"):
        indexer_topk_fused(q, k, w, 8, scorer="gluon")
    with pytest.raises(ValueError, match="not one of auto, triton, gluon"):
        indexer_topk_fused(q, k, w, 8, scorer="tensor")
