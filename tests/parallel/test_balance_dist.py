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


def _moe(scope: str):
    from moestack.model.moe import MoE

    router = RouterSpec(seq_aux_loss_coef=0.0, global_aux_loss_coef=0.3, z_loss_coef=0.05, bias_update="quantile",
                        quantile_bins=512, quantile_scope=scope)
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
    out = {}
    for scope in ("step", "batch"):  # step: the histogram adds over ranks; batch: the solved biases' mean
        g = torch.Generator().manual_seed(1)
        x_mb = [torch.randn(world * B, T, D, generator=g, dtype=torch.float64) for _ in range(2)]  # 2 micro-batches
        base = _moe(scope)
        base.train()
        acc = "quantile_hist" if scope == "step" else "batch_bias_sum"

        ref = copy.deepcopy(base)
        for x in x_mb:
            ref(x).sum().backward()
            ref.router.finish_microbatch()
        ref_grad, ref_acc = ref.router.weight.grad.clone(), getattr(ref.router, acc).clone()
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
        # the histogram sums to the single process's; the biases' sum and count are `world` times its, exactly (each
        # rank adds the same fp32 bias into the fp64 buffer; world = 2 scales by a power of two)
        got_acc = getattr(m.router, acc)
        acc_equal = torch.equal(got_acc, ref_acc) if scope == "step" else torch.equal(got_acc, ref_acc * world)
        m.router.update_selection_bias()
        out[scope] = {"grad": float((grad - ref_grad).norm() / ref_grad.norm()), "acc_equal": acc_equal,
                      "bias_close": float((m.router.selection_bias - ref.router.selection_bias).abs().max()),
                      "bias_moved": float((ref.router.selection_bias - base.router.selection_bias).abs().max())}
    # "batch" scope: the bias each micro-batch solves over the ranks is the single-process one of the whole batch
    from moestack.ops.moe import quantile

    s_all = torch.sigmoid(torch.randn(world * 300, E, generator=torch.Generator().manual_seed(3))
                          + torch.linspace(-1, 1, E))
    b0 = torch.linspace(0.1, -0.1, E)
    want = quantile.batch_bias(s_all, b0, K, 256, 3)
    got = quantile.batch_bias(s_all[rank * 300:(rank + 1) * 300], b0, K, 256, 3, dist.group.WORLD)
    out["batch_bias_equal"] = torch.equal(got, want)
    return out


def test_balancing_across_ranks_matches_single_process():
    results = run_ranks(__file__, "_worker", world_size=2, timeout=120)
    for rank, r in enumerate(results):
        assert r["batch_bias_equal"], (rank, r)
        for scope in ("step", "batch"):
            got = r[scope]
            # step scope: integer histograms; batch scope: (2 sum) / (2 count) rounds as sum / count: the same bias
            # bit for bit either way
            assert got["acc_equal"] and got["bias_close"] == 0.0, (rank, scope, got)
            assert got["bias_moved"] > 1e-3, (rank, scope, got)
            # output grads include the token's own path: compare the router weight, where the loss terms meet
            assert got["grad"] < 1e-12, (rank, scope, got)
