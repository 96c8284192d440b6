"""moestack.model.wrappers: the one ordered registry of forward wrappers (parallelism, memory policies)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moestack.memory.recompute import checkpoint_module, remove_recompute
from moestack.model.wrappers import ORDER, unwrap_forward, wrap_forward, wrapped_kinds


def _scale(factor: float):
    def make(inner):
        def forward(x):
            return inner(x) * factor

        return forward

    return make


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4, dtype=torch.float64)


def test_layers_stack_in_order_and_come_off_from_the_outside():
    m, x = _linear(), torch.randn(3, 4, dtype=torch.float64)
    plain = m(x)
    wrap_forward(m, "tp", _scale(2.0))
    wrap_forward(m, "tp", _scale(3.0))  # several layers of one kind stack
    wrap_forward(m, "offload", _scale(5.0))
    assert wrapped_kinds(m) == ("tp", "tp", "offload")
    assert torch.equal(m(x), plain * 2 * 3 * 5)
    with pytest.raises(RuntimeError, match="outermost forward wrapper is offload, not tp"):
        unwrap_forward(m, "tp")
    unwrap_forward(m, "offload")
    assert torch.equal(m(x), plain * 2 * 3) and wrapped_kinds(m) == ("tp", "tp")
    unwrap_forward(m, "tp")
    unwrap_forward(m, "tp")
    assert "forward" not in m.__dict__ and torch.equal(m(x), plain)  # the class's forward again


def test_an_earlier_kind_after_a_later_one_is_refused():
    m = _linear()
    wrap_forward(m, "recompute", _scale(1.0))
    with pytest.raises(RuntimeError, match="the tp wrapper must be applied before recompute"):
        wrap_forward(m, "tp", _scale(1.0))
    with pytest.raises(ValueError, match="unknown forward wrapper kind 'fsdp'"):
        wrap_forward(m, "fsdp", _scale(1.0))
    assert ORDER.index("tp") < ORDER.index("cp") < ORDER.index("recompute") < ORDER.index("offload")


def test_remove_recompute_keeps_the_tensor_parallel_layer_below_it():
    """remove_recompute once deleted the instance forward, and with it a tensor-parallel swap wrapped below."""
    m, x = _linear(), torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    plain = m(x)
    wrap_forward(m, "tp", _scale(2.0))
    checkpoint_module(m, "full")
    assert wrapped_kinds(m) == ("tp", "recompute") and torch.equal(m(x), plain * 2)
    remove_recompute(m)
    assert wrapped_kinds(m) == ("tp",) and m._moestack_recompute is None and torch.equal(m(x), plain * 2)
