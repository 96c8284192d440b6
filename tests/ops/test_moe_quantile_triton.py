"""The Triton batch-scope quantile solver (moestack/ops/moe/triton_quantile.py) against the torch reference
(quantile.batch_bias_reference): one coordinate step bit for bit (required biases, ends, both histograms, the fine
range, the uncentred read), whole solves to the mean-centring's rounding, fused == staged == two ranks (the fused
solve's radix select against the staged solve's B-bin histograms, one step bit for bit).

CPU: kernels under TRITON_INTERPRET=1 at small shapes. GPU (`-m gpu`): the K3 (E=896, k=16, T=8192) and proxy
(E=128, k=16, T=4096) shapes. Fresh seeded inputs; kernel buffers start NaN-poisoned (int ones -7).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated
pytest.importorskip("triton")

from moestack.config.model_spec import RouterSpec
from moestack.model.moe import Router
from moestack.ops.moe import quantile
from moestack.ops.moe import triton_quantile as tq

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = torch.finfo(torch.float32).eps


pytestmark = pytest.mark.usefixtures("nan_poisoned_outputs")  # tests/ops/conftest.py


def _inputs(kind: str, T: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, E], bias [E]) fp32 on DEV.
    skewed: sigmoid scores with per-expert offsets; saturated: clusters of tokens with logits near +-10 (scores
    within 1e-4 of 0 or 1); tied: scores on a grid of 1/8 and a zero bias (many equal choices per token); jitter:
    probabilities plus N(0, 0.05) (outside (0, 1)); far: skewed scores and a bias near 40."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.linspace(-2.0, 2.0, E)[torch.randperm(E, generator=g)]
    b = torch.randn(E, generator=g) * 0.2
    if kind == "saturated":
        clusters = max(2, T // 16)
        prefer = torch.randn(clusters, E, generator=g).sign() * 10.0
        s = torch.sigmoid(prefer[torch.randint(0, clusters, (T,), generator=g)] + torch.randn(T, E, generator=g))
    else:
        s = torch.sigmoid(torch.randn(T, E, generator=g) + offsets)
    if kind == "tied":
        s, b = (s * 8).round() / 8, torch.zeros(E)
    if kind == "jitter":
        s = s + 0.05 * torch.randn(T, E, generator=g)
    if kind == "far":
        b = b + 40.0
    return s.to(DEV), b.to(DEV)


def _reference_trace(monkeypatch, s, b, k, num_bins, iterations, momentum=0.0):
    """The reference's result and, per step, its two _bin_counts calls: [(lo_E, width_E, cum_EB), ...]."""
    calls = []
    bin_counts = quantile._bin_counts

    def record(r_TE, lo_E, width_E, *args):
        cum_EB = bin_counts(r_TE, lo_E, width_E, *args)
        calls.append((lo_E.clone(), width_E.clone(), cum_EB.clone()))
        return cum_EB

    monkeypatch.setattr(quantile, "_bin_counts", record)
    out = quantile.batch_bias_reference(s, b, k, num_bins, iterations, momentum=momentum)
    monkeypatch.setattr(quantile, "_bin_counts", bin_counts)
    return out, calls


def _check_one_step(monkeypatch, s, b, k, num_bins):
    """One coordinate step: every intermediate bit for bit, the centred result to the mean's rounding."""
    ref, calls = _reference_trace(monkeypatch, s, b, k, num_bins, 1)
    (lo_c, width_c, cum_c), (lo_f, width_f, cum_f) = calls
    T, E = s.shape
    ws = tq.Workspace(T, E, num_bins, s.device, staged=True)
    tq.launch_required(s, b, k, False, ws)
    r_TE = quantile.required_bias(s, b, k)
    assert torch.equal(ws.r_ET.T, r_TE)
    assert torch.equal(ws.ends_2E, torch.stack([r_TE.amin(0), r_TE.amax(0).neg()]))
    tq.launch_solve(tq.STAGE_COARSE, ws, k, num_bins, None)
    assert torch.equal(ws.coarse_EB.long().cumsum(-1), cum_c)
    assert torch.equal(ws.ends_2E[0], lo_c)  # the reference's coarse range from the same ends
    tq.launch_solve(tq.STAGE_FINE, ws, k, num_bins, None)
    assert torch.equal(ws.range_2E[0], lo_f) and torch.equal(ws.range_2E[1], width_f)
    assert torch.equal(ws.fine_EB.long().cumsum(-1), cum_f)
    tq.launch_solve(tq.STAGE_READ, ws, k, num_bins, None)
    assert torch.all(ws.ends_2E == float("inf"))  # reset for the next step
    # the uncentred read b_E is the reference's (its formula on the same counts; exact ops): centring differs only
    # in the fp32 sum's order, |d mean| <= E eps max|b| (the sum's worst case), plus one rounding of b - mean
    got = tq.batch_bias_triton(s, b, k, num_bins, 1)
    scale = float(ws.b_E.abs().max())
    assert float((got - ref).abs().max()) <= (E + 2) * EPS32 * scale
    assert abs(float(got.double().mean())) <= 2 * EPS32 * scale


CASES = [
    # T, E, k, bins, kind
    (100, 8, 2, 16, "skewed"),
    (257, 56, 6, 100, "saturated"),
    (130, 100, 16, 1000, "skewed"),
    (61, 17, 16, 8, "tied"),  # k + 1 = E: every expert in the top-(k+1)
    (300, 12, 3, 1024, "jitter"),  # B a power of two: no padding bins
    (97, 24, 4, 1500, "far"),
    (1, 10, 3, 64, "skewed"),  # one token
]


@pytest.mark.parametrize("T,E,k,num_bins,kind", CASES)
def test_one_step_counts_match_reference(monkeypatch, T, E, k, num_bins, kind):
    s, b = _inputs(kind, T, E, seed=T + E + k)
    _check_one_step(monkeypatch, s, b, k, num_bins)


SELECT_CASES = [
    # T, E, k, bins, kind, BLOCK_T_SELECT; n_scale: the group's token count over T (None: this T), below every
    # expert's first count (the target in the first non-empty bin) or above its total (none reaches it: the last bin)
    (37, 130, 16, 1000, "skewed", 4096, None),  # many experts, one chunk wider than T (E 896: the GPU test)
    *[(T, E, k, bins, kind, block, n_scale) for n_scale in (None, 1e-3, 1e3) for T, E, k, bins, kind, block in [
        (300, 12, 3, 1024, "saturated", 64),  # several chunks, T not a multiple of them
        (257, 56, 6, 1500, "tied", 128),  # 64 high digits; ties: many tokens in one bin
        (130, 100, 16, 100, "far", 32),  # 4 high digits, in 32-token chunks
        (61, 17, 16, 8, "tied", 16),  # B < 32: one digit
    ]],
]


def _check_select(T, E, k, num_bins, kind, n_scale):
    """The fused solve's radix select reads the same bins and counts as the staged solve's B-bin histograms: one
    step's uncentred b_E bit for bit."""
    s, b = _inputs(kind, T, E, seed=3 * T + E)
    n = None if n_scale is None else torch.full((1,), T * n_scale, dtype=torch.float64, device=DEV)
    ws = tq.Workspace(T, E, num_bins, s.device, staged=True)
    tq.launch_required(s, b, k, False, ws)
    tq.launch_solve(tq.STAGE_FUSED, ws, k, num_bins, n)
    fused_E = ws.b_E.clone()
    assert torch.all(ws.ends_2E == float("inf"))  # reset for the next step
    tq.launch_required(s, b, k, False, ws)
    for stage in (tq.STAGE_COARSE, tq.STAGE_FINE, tq.STAGE_READ):
        tq.launch_solve(stage, ws, k, num_bins, n)
    assert torch.equal(fused_E, ws.b_E)


@pytest.mark.parametrize("T,E,k,num_bins,kind,block,n_scale", SELECT_CASES)
def test_fused_select_matches_staged_counts(monkeypatch, T, E, k, num_bins, kind, block, n_scale):
    monkeypatch.setattr(tq, "BLOCK_T_SELECT", block)
    _check_select(T, E, k, num_bins, kind, n_scale)


def _load(s: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    return torch.bincount((s + b).topk(k, -1).indices.flatten(), minlength=s.shape[1])


def _check_solve(monkeypatch, s, b, k, num_bins, iterations, momentum=0.0):
    """A whole solve: fused == staged bit for bit; against the reference within two fine bins of the last step (a
    step after a centring that rounded differently may count a token at a bin edge in the neighbouring bin, and
    the read stays in the fine bin that holds the target) plus the rounding above; the same balance."""
    ref, calls = _reference_trace(monkeypatch, s, b, k, num_bins, iterations, momentum)
    got = tq.batch_bias_triton(s, b, k, num_bins, iterations, momentum=momentum)
    assert torch.equal(got, tq.batch_bias_triton(s, b, k, num_bins, iterations, staged=True, momentum=momentum))
    fine = float(calls[-1][1].max())
    scale = float(ref.abs().max()) + float(b.abs().max())
    err = float((got - ref).abs().max())
    assert err <= 2 * fine + (s.shape[1] + 2) * EPS32 * scale, (err, fine)
    mean = s.shape[0] * k / s.shape[1]
    got_load, ref_load = _load(s, got, k), _load(s, ref, k)
    assert abs(float(got_load.max() - ref_load.max())) <= max(2.0, 0.02 * mean), (got_load, ref_load)
    return err


@pytest.mark.parametrize("T,E,k,num_bins,kind", [c for c in CASES if c[0] > 1])
def test_solve_matches_reference(monkeypatch, T, E, k, num_bins, kind):
    s, b = _inputs(kind, T, E, seed=2 * T + E)
    _check_solve(monkeypatch, s, b, k, num_bins, 3)


@pytest.mark.parametrize("T,E,k,num_bins,kind", [CASES[0], CASES[1], CASES[4]])
def test_momentum_solve_matches_reference(monkeypatch, T, E, k, num_bins, kind):
    s, b = _inputs(kind, T, E, seed=5 * T + E)
    _check_solve(monkeypatch, s, b, k, num_bins, 4, momentum=0.7)


def test_extrapolate_kernel_matches_reference():
    """The extrapolation launch against quantile.extrapolate on the same reads: the first change kept, then one
    kept and one reversed change (the dot product's sign), y_prev / d_prev carried."""
    E = 37
    g = torch.Generator().manual_seed(11)
    reads = [torch.randn(E, generator=g).to(DEV) for _ in range(2)]
    reads.append(reads[1] + 0.8 * (reads[1] - reads[0]) + 0.1 * torch.randn(E, generator=g).to(DEV))  # kept
    reads.append(reads[2] - 0.5 * (reads[2] - reads[1]))  # step 3 reverses step 2's change
    ws = tq.Workspace(1, E, 8, torch.device(DEV), staged=False)
    y_prev = d_prev = None
    for step, raw in enumerate(reads):
        ws.b_E.copy_(raw)
        tq.launch_extrapolate(ws, step, 0.7)
        y = raw - raw.mean()
        if step == 0:
            want = y
        else:
            want, d_prev = quantile.extrapolate(y, y_prev, d_prev, 0.7)
            if step == 2:
                assert not torch.allclose(want, y)  # the change was kept
            assert torch.allclose(ws.momentum_3E[1], d_prev, rtol=0, atol=4 * EPS32 * 8)
        assert torch.allclose(ws.momentum_3E[2], want, rtol=0, atol=8 * EPS32 * 8), step
        assert torch.allclose(ws.momentum_3E[0], y, rtol=0, atol=4 * EPS32 * 8)
        y_prev = y
    assert torch.allclose(ws.momentum_3E[2], reads[3] - reads[3].mean(), rtol=0, atol=8 * EPS32 * 8)  # reversed


def test_dispatch_follows_the_routing_backend(monkeypatch):
    s, b = _inputs("skewed", 64, 12, seed=1)
    want = tq.batch_bias_triton(s, b, 2, 32, 2)
    assert torch.equal(quantile.batch_bias(s, b, 2, 32, 2, backend="triton"), want)
    auto = "triton" if DEV == "cuda" else "reference"  # auto: the Triton kernels on CUDA only
    expect = want if auto == "triton" else quantile.batch_bias_reference(s, b, 2, 32, 2)
    assert torch.equal(quantile.batch_bias(s, b, 2, 32, 2), expect)
    with pytest.raises(ValueError, match="backend"):
        quantile.batch_bias(s, b, 2, 32, 2, backend="cuda")
    # the router passes its routing backend
    seen = []

    def fake(scores_TE, bias_E, top_k, num_bins, iterations, group, backend, momentum):
        seen.append(backend)
        return torch.zeros_like(bias_E)

    monkeypatch.setattr(quantile, "batch_bias", fake)
    router = Router(8, 12, 2, RouterSpec(bias_update="quantile", quantile_scope="batch")).to(DEV)
    router.init_weights(0.5)
    router.backend = "reference"
    router.train()
    router(torch.randn(16, 8, device=DEV))
    assert seen == ["reference", "reference"]  # quantile_start "best": one solve from the bias, one from zero


def _two_rank_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    s_all, b = _inputs("skewed", 2 * 150, 20, seed=7)
    got = tq.batch_bias_triton(s_all[rank * 150:(rank + 1) * 150], b, 3, 200, 3, dist.group.WORLD)
    return {"got": got, "want": tq.batch_bias_triton(s_all, b, 3, 200, 3)}


@pytest.mark.slow
@pytest.mark.skipif(DEV == "cuda", reason="gloo ranks on CPU tensors (the interpreter)")
def test_two_ranks_match_one_process_bit_for_bit():
    """The staged solve over two ranks (all-reduced ends, counts, token count) is the single process's fused solve
    of the whole batch bit for bit: integer counts and min add exactly, and the centring sums the same values."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from _dist import run_ranks

    for r in run_ranks(__file__, "_two_rank_worker", world_size=2, timeout=300):
        assert torch.equal(r["got"], r["want"]), r


@pytest.mark.gpu
@pytest.mark.parametrize("n_scale", [None, 1e-3, 1e3])
@pytest.mark.parametrize("T,E,kind", [(8192 + 37, 896, "saturated"), (32768, 896, "skewed"), (4096, 128, "tied")])
def test_gpu_fused_select_matches_staged_counts(T, E, kind, n_scale):
    _check_select(T, E, 16, 1000, kind, n_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(8192, 896, 16), (4096, 128, 16)])
@pytest.mark.parametrize("kind", ["skewed", "saturated"])
def test_gpu_shapes_match_reference(monkeypatch, T, E, k, kind):
    s, b = _inputs(kind, T, E, seed=E + (kind == "saturated"))
    _check_one_step(monkeypatch, s, b, k, 1000)
    err = _check_solve(monkeypatch, s, b, k, 1000, 4)
    err_momentum = _check_solve(monkeypatch, s, b, k, 1000, 8, momentum=0.7)
    print(f"T={T} E={E} k={k} {kind}: max |triton - reference| after 4 steps {err:.3g}, "
          f"8 with momentum 0.7 {err_momentum:.3g}")
