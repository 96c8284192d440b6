"""moestack.ops.graphed.GraphCache and the batch-scope solve through it (KernelSpec.moe.solve_graph).

CPU: the cache runs the function eagerly (nothing captured) and the build step sets the router's choice from the
KernelSpec. GPU: a replay gives bitwise the eager result, for fresh inputs on every call (the static inputs are
rewritten), and its outputs are copies (a later replay does not change an earlier result).
"""

from __future__ import annotations

import pytest
import torch

from moestack.config.kernel_spec import KernelSpec, with_fields
from moestack.ops.graphed import GraphCache
from moestack.ops.moe import quantile

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _several_kernels(x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.sigmoid(x) + b
    top = y.topk(3, dim=-1).values.sum(-1)
    return top, (y - y.mean()).cumsum(0)[-1]


def test_cpu_tensors_run_eagerly():
    cache = GraphCache()
    x, b = torch.randn(33, 7), torch.randn(7)
    got = cache("k", _several_kernels, x, b)
    for g, w in zip(got, _several_kernels(x, b), strict=True):
        assert torch.equal(g, w)
    assert len(cache) == 0


def test_solve_graph_on_cpu_is_the_eager_solve():
    g = torch.Generator().manual_seed(3)
    s = torch.sigmoid(torch.randn(300, 24, generator=g))
    b = 0.1 * torch.randn(24, generator=g)
    want = quantile.solve_batch_bias(s, b, 4, 100, 3, "best", momentum=0.5)
    got = quantile.solve_batch_bias(s, b, 4, 100, 3, "best", momentum=0.5, graph=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("on", [True, False])
def test_build_sets_the_routers_choice(on):
    from moestack.config.model_spec import load_model_spec
    from moestack.model.kernels import apply_kernels
    from moestack.model.moe import MoE
    from moestack.model.transformer import Transformer

    model = Transformer(load_model_spec("tiny"))
    apply_kernels(model, with_fields(KernelSpec(), {"moe.solve_graph": on}), "cpu")
    routers = [m.router for m in model.modules() if isinstance(m, MoE)]
    assert routers and all(r.solve_graph is on for r in routers)


@pytest.mark.gpu
def test_gpu_replay_is_the_eager_result_for_fresh_inputs():
    cache = GraphCache()
    earlier = None
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(4096, 64, device=DEV, generator=g)
        b = torch.randn(64, device=DEV, generator=g)
        got = cache("k", _several_kernels, x, b)
        for a, w in zip(got, _several_kernels(x, b), strict=True):
            assert torch.equal(a, w)
        if earlier is not None:
            assert not torch.equal(earlier[0], got[0])  # a copy: this replay left the earlier result alone
        earlier = got
    assert len(cache) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("start,momentum", [("best", 0.7), ("bias", 0.0)])
def test_gpu_solve_graph_is_bitwise_the_eager_solve(start, momentum):
    quantile._SOLVE_GRAPHS.clear()
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(seed)
        s = torch.sigmoid(torch.randn(4096, 128, device=DEV, generator=g) + torch.linspace(-2, 2, 128, device=DEV))
        b = 0.2 * torch.randn(128, device=DEV, generator=g)
        want = quantile.solve_batch_bias(s, b, 8, 1000, 8, start, momentum=momentum)
        got = quantile.solve_batch_bias(s, b, 8, 1000, 8, start, momentum=momentum, graph=True)
        assert torch.equal(got, want), (seed, (got - want).abs().max())
    assert len(quantile._SOLVE_GRAPHS) == 1
