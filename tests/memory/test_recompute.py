"""Recompute policies: same loss and gradients as no recompute (bitwise on CPU), router counters not doubled, aux
losses exact, and "selective" reruns exactly the ops it claims to (elementwise yes, GEMMs only MLA up-projections)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moestack.config.plan import RecomputePolicy
from moestack.memory.recompute import apply_recompute, block_modes, checkpoint_module, remove_recompute
from moestack.model.aux_loss import set_aux_loss_scale
from moestack.model.transformer import build_model

B, T = 1, 32  # two KDA chunks of the tiny preset; more than the DSA top-k (16)


@pytest.fixture(scope="module")
def setup(small_spec):
    spec = small_spec
    model = build_model(spec, "cpu", seed=0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    return model, tokens, targets


@pytest.fixture(scope="module")
def reference(setup):
    model, tokens, targets = setup
    return _step(copy.deepcopy(model), tokens, targets)


def _step(model, tokens, targets, autocast: bool = False):
    """loss, grads by name, router counters, aux losses after one forward + backward."""
    set_aux_loss_scale(1.0)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(tokens, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = {n: m.router.tokens_per_expert.clone() for n, m in model.moe_layers().items()}
    aux = {n: m.last_aux_loss for n, m in model.moe_layers().items()}
    return loss.detach(), grads, counts, aux


def _assert_same(ref, out):
    loss0, grads0, counts0, aux0 = ref
    loss, grads, counts, aux = out
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys()
    for name in grads0:
        assert torch.equal(grads[name], grads0[name]), name
    for name in counts0:  # recompute reruns the router: the counters must not double
        assert torch.equal(counts[name], counts0[name]), name
        assert torch.equal(aux[name], aux0[name]), name


POLICIES = [
    RecomputePolicy.uniform("full"),
    RecomputePolicy.uniform("selective"),
    RecomputePolicy(kda="full", attention="selective", moe="selective", mlp="none"),
    RecomputePolicy(kda="none", attention="full", moe="full", mlp="selective"),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.short())
def test_recompute_is_exact(setup, reference, policy):
    model, tokens, targets = setup
    m = copy.deepcopy(model)
    wrapped = apply_recompute(m, policy)
    assert wrapped, "something must be wrapped"
    for name, block in m.layers.items():
        mix, ffn = block_modes(block, policy)
        if mix == ffn and mix != "none":
            assert wrapped[f"layers.{name}"] == mix
        else:
            assert wrapped.get(f"layers.{name}.attn", "none") == mix
            assert wrapped.get(f"layers.{name}.ffn", "none") == ffn
    _assert_same(reference, _step(m, tokens, targets))


def test_selective_under_autocast(setup):
    model, tokens, targets = setup
    ref = _step(copy.deepcopy(model), tokens, targets, autocast=True)
    m = copy.deepcopy(model)
    apply_recompute(m, RecomputePolicy.uniform("selective"))
    _assert_same(ref, _step(m, tokens, targets, autocast=True))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(model, tokens, targets) -> Counter:
    loss = model(tokens, targets)
    with _CountOps() as mode:
        loss.backward()
    return mode.counts


def test_selective_reruns_elementwise_and_mla_up_projections_only(setup):
    model, tokens, targets = setup
    base = copy.deepcopy(model)
    calls = Counter()
    for block in base.layers.values():
        for name in ("q_b_proj", "kv_b_proj"):
            sub = getattr(block.attn, name, None)
            if sub is not None:
                sub.register_forward_hook(lambda *a, name=name: calls.update([name]))
    counts, up_proj_calls = {}, 0
    for mode in ("none", "selective", "full"):
        m = copy.deepcopy(base)
        apply_recompute(m, RecomputePolicy.uniform(mode))
        calls.clear()
        counts[mode] = _backward_ops(m, tokens, targets)
        if mode == "none":  # without recompute: the up-projection calls of one forward
            up_proj_calls = calls["q_b_proj"] + calls["kv_b_proj"]
    assert up_proj_calls >= 1
    none, sel, full = counts["none"], counts["selective"], counts["full"]
    # the only GEMMs selective reruns are the MLA up-projections (one mm each: 2-D input after flattening)
    assert sel["aten.mm"] - none["aten.mm"] == up_proj_calls
    assert sel["aten.bmm"] == none["aten.bmm"]
    assert full["aten.mm"] > sel["aten.mm"] and full["aten.bmm"] > sel["aten.bmm"]
    # norms and activation functions are recomputed (their forward ops run in backward), and not without recompute
    for op in ("aten.rsqrt", "aten.tanh", "aten.sigmoid"):
        assert none[op] == 0 and sel[op] > 0 and full[op] == sel[op], op
    # selections are kept: top-k / sort are not rerun under selective
    assert sel["aten.topk"] == none["aten.topk"] and sel["aten.sort"] == none["aten.sort"]


def test_checkpoint_module_contract(setup):
    model, tokens, targets = setup
    m = copy.deepcopy(model)
    block = m.layers["1"]  # (mla, moe)
    with pytest.raises(ValueError, match="recompute mode"):
        checkpoint_module(block.ffn, "sometimes")
    assert checkpoint_module(block.ffn, "none") is block.ffn and "forward" not in block.ffn.__dict__
    checkpoint_module(block.ffn, "full")
    with pytest.raises(RuntimeError, match="already wrapped"):
        checkpoint_module(block.ffn, "selective")
    names = [n for n, _ in m.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]  # parameter names unchanged
    with torch.no_grad():  # no autograd: the plain forward runs
        out = m(tokens)
    assert torch.equal(out, copy.deepcopy(model)(tokens).detach())
    remove_recompute(m)
    assert "forward" not in block.ffn.__dict__ and block.ffn._moestack_recompute is None
