"""No launch config that cannot run (issue #26.2), on the GPU: the DSA, KDA and MoE kernels at the head counts and
widths of every preset (moestack/config/presets) and every tests/data/hf_configs config (through
moestack/config/hf.py), at a small token count, against their references; then every kernel binary this session
compiled fits the device (a config the pruners kept that could not run would show here even where the autotuner
swallowed its OutOfResources).

Autotuning is on (KernelSpec.autotune true, the training default): the autotuner compiles every config its pruner
kept for the shape, the first of which is the one a fixed-config run (autotune false) launches, so the last test
sees each kept config's binary; the autotuner itself skips a config that raises OutOfResources, so only that check
(not the launches) would show one that cannot run. The CPU test tests/ops/test_launch.py checks the pruners'
choices against fake device limits, benchmarks/tools/launch_fit_check.py the shared-memory estimates against the
compiler. The tiny preset's DSA forward (BLOCK_V 512 at a padded value width of 32: 299 KB on the H200) was the
failing case. One process for the whole file (a "serial" file in scripts/gpu_durations.json): the last test reads
the kernels the sweep compiled in this process.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(Path(__file__).parent))


def _specs():
    from moestack.config import load_model_spec
    from moestack.config.hf import load_hf_config

    out = {n: load_model_spec(n) for n in ("tiny", "proxy", "kimi-k3", "kimi-k3.1-pro")}
    for p in sorted(glob.glob(str(ROOT / "tests/data/hf_configs/*.json"))):
        out[Path(p).name] = load_hf_config(p).spec
    return out


def _shapes():
    kda, mla, idx, moe = set(), set(), set(), set()
    for s in _specs().values():
        if s.linear_attention == "kda" and s.kda is not None:
            kda.add((s.kda.num_heads, s.kda.head_dim, s.kda.conv_kernel_size))
        if s.attention == "mla" and s.mla is not None:
            m = s.mla
            mla.add((m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim))
            if m.indexer is not None:
                idx.add((m.indexer.num_heads, m.indexer.head_dim, m.indexer.top_k))
        if s.moe is not None:
            moe.add((s.moe.latent_size or s.hidden_size, s.moe.expert_intermediate_size))
    return sorted(kda), sorted(mla), sorted(idx), sorted(moe)


KDA, MLA, INDEXER, MOE = _shapes() if torch.cuda.is_available() else ([], [], [], [])


@pytest.fixture(scope="module", autouse=True)
def every_kept_config():
    from moestack.ops import launch

    before = launch.autotune_enabled()
    launch.set_autotune(True)
    yield
    launch.set_autotune(before)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert not torch.isnan(a).any(), "NaN (an unwritten element?)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("H,K,W", KDA)
def test_kda_kernels_at_model_widths(H, K, W):
    """The chunked KDA (fused gate, forward and backward), its gated output norm and short conv + SiLU."""
    from test_kda_triton import GPU_TOL_GRAD, GPU_TOL_OUT, check, make_inputs

    from moestack.ops.kda.gated_norm import gated_rmsnorm, gated_rmsnorm_reference
    from moestack.ops.kda.short_conv import short_conv_silu, short_conv_silu_reference

    x = make_inputs(1, 128, H, K, K, h0=False, gate="k3", dtype=torch.bfloat16, device="cuda", seed=H + K)
    check(x, gate="k3", tol_out=GPU_TOL_OUT, tol_grad=GPU_TOL_GRAD)

    g = torch.Generator(device="cuda").manual_seed(K)
    o, z = (torch.randn(128, H, K, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_() for _ in "oz")
    w = torch.randn(K, device="cuda", generator=g).requires_grad_()
    y = gated_rmsnorm(o, z, w, 1e-5)
    y_ref = gated_rmsnorm_reference(o.float(), z.float(), w, 1e-5)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (o, z, w), dy)
    want = torch.autograd.grad(y_ref, (o, z, w), dy.float())
    assert rel(y, y_ref) < 1e-2 and all(rel(a, b) < 2e-2 for a, b in zip(got, want))

    C = H * K
    xc = torch.randn(1, 128, C, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    wc = (torch.randn(C, W, device="cuda", generator=g) * 0.5).requires_grad_()
    y = short_conv_silu(xc, wc)
    y_ref = short_conv_silu_reference(xc.float(), wc)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (xc, wc), dy)
    want = torch.autograd.grad(y_ref, (xc, wc), dy.float())
    assert rel(y, y_ref) < 1e-2 and all(rel(a, b) < 2e-2 for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H,V,R", MLA)
def test_dsa_attention_at_model_widths(H, V, R, dtype):
    """Sparse MQA attention forward and backward, and the sparse-stage KL target, in bf16 (autocast) and fp32 (a
    model trained without autocast: the tiny preset's failing case was an fp32 launch)."""
    from test_dsa_triton import GPU_TOL_GRAD, GPU_TOL_OUT, _check_attention

    from moestack.ops.dsa import reference as ref
    from moestack.ops.dsa.triton_indexer import attention_probs_target_triton

    T, K = 128, 64
    g = torch.Generator().manual_seed(H + V)
    idx = torch.stack([torch.cat((torch.randperm(t + 1, generator=g)[:K], torch.full((max(0, K - t - 1),), -1)))
                       for t in range(T)]).to(torch.int32)[None].cuda()  # fmt: skip
    _check_attention(1, T, H, V, R, K, idx, "kmajor_ds", dtype, "cuda", GPU_TOL_OUT, GPU_TOL_GRAD)
    q = torch.randn(1, T, H, V + R, device="cuda", dtype=dtype)
    kv = torch.randn(1, T, V + R, device="cuda", dtype=dtype)
    scale = (V + R) ** -0.5
    _, lse = ref.sparse_mqa_attention_blockwise(q.float(), kv.float(), idx, V, scale)
    got = attention_probs_target_triton(q, kv, scale, lse=lse, idx=idx)
    want = ref.attention_probs_target(q.float(), kv.float(), scale, lse=lse, idx=idx)
    assert rel(got, want) < 2e-2


@pytest.mark.parametrize("mode", ["fused", "chunked"])
@pytest.mark.parametrize("Hi,Di,top_k", INDEXER)
def test_dsa_indexer_at_model_widths(Hi, Di, top_k, mode):
    """The lightning indexer's top-k (the fused default and the chunked path) in bf16 against the reference."""
    from moestack.ops.dsa import reference as ref
    from moestack.ops.dsa.triton_indexer import indexer_topk_triton

    T = 256
    g = torch.Generator(device="cuda").manual_seed(Hi + Di)
    q = torch.randn(1, T, Hi, Di, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Di, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, T, Hi, generator=g, device="cuda") * Hi**-0.5
    top = min(top_k, T // 2)
    got = indexer_topk_triton(q, k, w, top, mode=mode)
    want = ref.indexer_topk_from_inputs(q.float(), k.float(), w, top)
    assert torch.equal((got < 0).sum(-1), (want < 0).sum(-1))
    chosen = torch.zeros(T, T + 1, dtype=torch.bool, device="cuda")
    chosen.scatter_(1, want[0].long() % (T + 1), True)
    hits = chosen.gather(1, got[0].long() % (T + 1))[got[0] >= 0]
    assert hits.float().mean() > 0.97, float(hits.float().mean())  # bf16 near-ties flip a few


# rows per expert: the swap-AB token tiles 16..128 and the Gluon weight gradient's small / large experts
COUNTS = {"few": [5, 40, 0, 17], "many": [200, 130, 0, 300]}


@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("L,I", MOE)
def test_moe_expert_gemms_at_model_widths(L, I, counts):
    """The experts' gate / up and down GEMMs, forward and backward: bf16 Triton (the swap-AB TMA family, the Gluon
    weight gradient) and the FP8 recipe's (Triton at these row counts), against the fp32 per-expert loop."""
    from moestack.ops import moe as moe_ops
    from moestack.ops.fp8 import fp8_unavailable_reason
    from moestack.ops.fp8.grouped_gemm import Fp8GroupedGemm
    from moestack.ops.moe.reference import grouped_mm_loop

    c = COUNTS[counts]
    E, N = len(c), sum(c)
    offs = torch.tensor(c, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(L + I)
    gemms = {"bf16": (moe_ops.GroupedGemm("triton"), 2e-2)}
    if fp8_unavailable_reason(torch.device("cuda")) is None:
        gemms["fp8"] = (Fp8GroupedGemm(cublas_min_rows=10**9), 0.1)
    for D, F in ((L, 2 * I), (I, L)):  # gate / up, down
        x = torch.randn(N, D, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(E, F, D, device="cuda", generator=g) * D**-0.5).to(torch.bfloat16)  # Experts' layout
        dy = torch.randn(N, F, device="cuda", generator=g, dtype=torch.bfloat16)
        xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
        yr = grouped_mm_loop(xr, wr.transpose(1, 2), offs)
        want = (yr, *torch.autograd.grad(yr, (xr, wr), dy.float()))
        for name, (gemm, tol) in gemms.items():
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = gemm(xg, wg.transpose(1, 2), offs)
            got = (y, *torch.autograd.grad(y, (xg, wg), dy))
            errs = [rel(a, b) for a, b in zip(got, want)]
            assert max(errs) < tol, (name, D, F, errs)


def _jit_functions():
    """Every Triton / Gluon JIT function of moestack.ops (autotuners and heuristics unwrapped)."""
    import pkgutil

    import triton

    import moestack.ops

    seen = {}
    for info in pkgutil.walk_packages(moestack.ops.__path__, "moestack.ops."):
        module = sys.modules.get(info.name)
        if module is None:
            continue
        for obj in vars(module).values():
            while hasattr(obj, "fn") and not isinstance(obj, triton.runtime.JITFunction):
                obj = obj.fn
            if isinstance(obj, triton.runtime.JITFunction):
                seen[id(obj)] = obj
    return list(seen.values())


def test_every_compiled_kernel_fits_the_device():
    """Run last (file order): no binary compiled in this session (this file's launches and whatever ran before it)
    needs more shared memory or threads than the device has."""
    from moestack.ops.launch import device_limits

    limits = device_limits(torch.cuda.current_device())
    over, count = [], 0
    for jf in _jit_functions():
        for caches in jf.device_caches.values():
            for kernel in caches[0].values():
                count += 1
                md = kernel.metadata
                if md.shared > limits.smem or 32 * md.num_warps > limits.threads:
                    over.append((jf.__name__, md.shared, md.num_warps))
    assert count > 0, "no compiled kernels found (did the sweep run?)"
    assert not over, f"kernels over the device's limits ({limits}): {over}"
