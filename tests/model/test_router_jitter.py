"""The selection jitter (RouterSpec.selection_jitter): a pure function of (token, expert, seed), added to the
choosing scores of training forwards only, reproducible across recompute and resume, and what lets the quantile
bias split a cluster of duplicate tokens (the byte-level corpus's spaces, issue #27)."""

from __future__ import annotations

import pytest
import torch

from moestack.config.model_spec import RouterSpec
from moestack.model.moe import Router, set_jitter_seeds
from moestack.ops.moe import quantile, routing
from moestack.ops.moe import reference as ref


def test_jitter_is_a_uniform_pure_function_of_slot_and_seed():
    T, E, eps = 1024, 96, 0.03
    u = ref.selection_jitter(T, E, torch.tensor(11), eps)
    assert u.shape == (T, E) and u.dtype == torch.float32
    assert torch.equal(u, ref.selection_jitter(T, E, 11, eps))  # tensor or int seed: the same draw
    assert torch.equal(u[:7, :], ref.selection_jitter(T, E, 11, eps)[:7])
    assert float(u.min()) >= 0.0 and float(u.max()) < eps
    n = u.numel()
    # U[0, eps): mean eps/2 with standard error eps / sqrt(12 n); 6 standard errors
    assert abs(float(u.double().mean()) - eps / 2) < 6 * eps / (12 * n) ** 0.5
    hist = torch.histc(u, 10, 0, eps) / (n / 10)
    assert float((hist - 1).abs().max()) < 0.05  # ~9.8k per bin: 5% is > 4 standard deviations
    v = ref.selection_jitter(T, E, 12, eps)
    assert float((u == v).float().mean()) < 1e-3
    corr = torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1]
    assert abs(float(corr)) < 0.02  # independent seeds; n ~ 1e5: 0.02 is ~6 standard errors
    nxt = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    assert abs(float(nxt)) < 0.02  # neighbouring tokens independent


def test_set_jitter_seeds_depends_on_name_and_step_only():
    spec = RouterSpec(bias_update="quantile", selection_jitter=0.01)
    a, b = Router(8, 4, 2, spec), Router(8, 4, 2, spec)
    set_jitter_seeds({"layers.1.ffn": a, "layers.2.ffn": b}, step=5)
    sa, sb = int(a.jitter_seed), int(b.jitter_seed)
    assert sa != sb
    c = Router(8, 4, 2, spec)  # a fresh router (a resumed run, another pipeline split) at the same step
    set_jitter_seeds({"layers.1.ffn": c}, step=5)
    assert int(c.jitter_seed) == sa
    set_jitter_seeds({"layers.1.ffn": c}, step=6)
    assert int(c.jitter_seed) != sa
    off = Router(8, 4, 2, RouterSpec())
    set_jitter_seeds({"layers.1.ffn": off}, step=5)
    assert int(off.jitter_seed) == 0  # no jitter: left alone


def _duplicate_router(jitter: float, scope: str) -> tuple[Router, torch.Tensor]:
    """A router whose batch is 40% one repeated token (the spaces of byte-level text) and 60% varied tokens."""
    torch.manual_seed(3)
    D, E, K, T = 32, 64, 8, 4096
    spec = RouterSpec(bias_update="quantile", quantile_scope=scope, selection_jitter=jitter, seq_aux_loss_coef=0.0)
    router = Router(D, E, K, spec)
    router.init_weights(0.3)
    x = torch.randn(T, D)
    x[: int(0.4 * T)] = torch.randn(D)
    return router, x[torch.randperm(T)]


@pytest.mark.parametrize("jitter", [0.0, 0.03])
def test_jitter_lets_the_batch_bias_split_duplicate_tokens(jitter):
    """Three optimizer steps on the same batch (each step's solves start from the last step's mean bias)."""
    router, x = _duplicate_router(jitter, "batch")
    router.train()
    max_mean = []
    for step in range(3):
        set_jitter_seeds({"r": router}, step)
        idx, _, _ = router(x)
        counts = torch.bincount(idx.reshape(-1), minlength=router.num_experts).double()
        max_mean.append(float(counts.max() / counts.mean()))
        router.update_selection_bias()
    # duplicates are 40% of the batch: without jitter the 8 experts they pick get >= 0.4 T each, 3.2x the mean
    # (measured 3.39 / 3.20 / 3.22); with it the bias splits them (measured 1.29 / 1.05 / 1.02)
    if jitter == 0:
        assert min(max_mean) > 3.0, max_mean
    else:
        assert max_mean[-1] < 1.1 and max_mean[0] < 1.5, max_mean


def test_jitter_routes_training_forwards_only_and_is_recompute_safe():
    router, x = _duplicate_router(0.03, "batch")
    with torch.no_grad():
        router.selection_bias.copy_(torch.randn(router.num_experts) * 0.01)
    set_jitter_seeds({"r": router}, step=3)
    logits = routing.router_logits(x, router.weight).detach()
    router.eval()
    idx_eval, _, _ = router(x)
    assert torch.equal(idx_eval, ref.route(logits, router.selection_bias, router.top_k)[0])  # no jitter in eval
    router.train()
    idx, _, scores = router(x)
    jitter = ref.selection_jitter(*scores.shape, router.jitter_seed, 0.03)
    solved = quantile.solve_batch_bias(scores + jitter, router.selection_bias, router.top_k,
                                       router.spec.quantile_bins, router.spec.quantile_iterations)
    assert torch.equal(router.batch_bias_sum[:-1], solved)  # the solver balanced the jittered choosing scores
    assert torch.equal(idx, ref.route(logits, solved + jitter, router.top_k)[0])
    again, _, _ = router(x)  # a recompute of the same forward (the step's seed unchanged)
    assert torch.equal(idx, again)
    set_jitter_seeds({"r": router}, step=4)
    assert not torch.equal(idx, router(x)[0])


def test_step_scope_histogram_counts_the_jittered_choice():
    router, x = _duplicate_router(0.03, "step")
    router.train()
    set_jitter_seeds({"r": router}, step=1)
    _, _, scores = router(x)
    jitter = ref.selection_jitter(*scores.shape, router.jitter_seed, 0.03)
    want = quantile.accumulate_histogram_(torch.zeros_like(router.quantile_hist), scores.detach() + jitter,
                                          router.selection_bias, router.top_k)
    assert torch.equal(router.quantile_hist, want)


def test_selection_jitter_spec_bounds():
    with pytest.raises(ValueError, match="selection_jitter"):
        RouterSpec(selection_jitter=-0.1)
    assert RouterSpec().selection_jitter == 0.0
    with pytest.raises(ValueError, match="selection_bias: true"):
        RouterSpec(selection_jitter=0.03, selection_bias=False)
