"""Router balancing across data-parallel ranks (gloo, fp64) against one process on the whole batch: the global-batch
loss counts the load of every rank (its gradient, averaged over the ranks as data parallelism does, is the
single-process one), and the quantile-balancing histogram summed over the ranks (the trainer's
reduce_router_state) is the single-process histogram, so every rank solves the same bias; the "batch" scope's
per-micro-batch bias solved over the ranks is the single-process one of the whole batch."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from moestack.config.model_spec import MoESpec, RouterSpec

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks  # noqa: E402

D, E, K, I, B, T = 12, 8, 2, 10, 2, 7


def _moe():
    from moestack.model.moe import MoE

    router = RouterSpec(seq_aux_loss_coef=0.0, global_aux_loss_coef=0.3, z_loss_coef=0.05, bias_update="quantile",
                        quantile_bins=512)
    torch.manual_seed(0)
    m = MoE(D, MoESpec(num_experts=E, top_k=K, expert_intermediate_size=I, router=router), "situ_glu").double()
    m.init_weights(0.4)
    with torch.no_grad():
        m.router.selection_bias.copy_(torch.linspace(-0.2, 0.2, E, dtype=torch.float32))
    return m


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moestack.model.aux_loss import set_aux_loss_scale
    from moestack.train.expert_load import finish_microbatch, reduce_router_state

    torch.set_num_threads(1)
    set_aux_loss_scale(1.0)
    g = torch.Generator().manual_seed(1)
    x_mb = [torch.randn(world * B, T, D, generator=g, dtype=torch.float64) for _ in range(2)]  # two micro-batches
    base = _moe()
    base.train()

    ref = copy.deepcopy(base)
    for x in x_mb:
        ref(x).sum().backward()
        ref.router.finish_microbatch()
    ref_grad, ref_hist = ref.router.weight.grad.clone(), ref.router.quantile_hist.clone()
    ref.router.update_selection_bias()

    m = copy.deepcopy(base)
    m.balance_group = dist.group.WORLD
    rows = slice(rank * B, (rank + 1) * B)
    for x in x_mb:
        (m(x[rows]).sum() * world).backward()  # loss share scaled so the rank sum reproduces the global sum
        finish_microbatch({"m": m})
    grad = m.router.weight.grad.clone()
    dist.all_reduce(grad)
    grad /= world  # data parallelism averages gradients over the ranks
    reduce_router_state({"m": m}, None)
    hist_equal = torch.equal(m.router.quantile_hist, ref_hist)
    m.router.update_selection_bias()
    # "batch" scope: the bias each micro-batch solves over the ranks is the single-process one of the whole batch
    from moestack.ops.moe import quantile

    s_all = torch.sigmoid(torch.randn(world * 300, E, generator=torch.Generator().manual_seed(3))
                          + torch.linspace(-1, 1, E))
    b0 = torch.linspace(0.1, -0.1, E)
    want = quantile.batch_bias(s_all, b0, K, 256, 3)
    got = quantile.batch_bias(s_all[rank * 300:(rank + 1) * 300], b0, K, 256, 3, dist.group.WORLD)
    return {"grad": float((grad - ref_grad).norm() / ref_grad.norm()), "hist_equal": hist_equal,
            "batch_bias_equal": torch.equal(got, want),
            "bias_equal": torch.equal(m.router.selection_bias, ref.router.selection_bias),
            "bias_moved": float((ref.router.selection_bias - base.router.selection_bias).abs().max())}


def test_balancing_across_ranks_matches_single_process():
    results = run_ranks(__file__, "_worker", world_size=2, timeout=120)
    for rank, r in enumerate(results):
        assert r["hist_equal"] and r["bias_equal"] and r["batch_bias_equal"], (rank, r)
        assert r["bias_moved"] > 1e-3
        # output grads include the token's own path: compare the router weight, where the loss terms meet
        assert r["grad"] < 1e-12, (rank, r)
