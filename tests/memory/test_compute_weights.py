"""bf16 compute copies of the weights (moestack/memory/compute_weights.py): bitwise the numbers of autocast's
per-forward casts (losses, every gradient, the weights after optimizer steps), one cast per optimizer step, and
the layers the copies must leave alone."""

from __future__ import annotations

import functools

import torch
from torch import nn

from moestack.config.train_spec import TrainSpec
from moestack.memory.compute_weights import ComputeWeights
from moestack.model.transformer import build_model
from moestack.model.weights import CachedLinear, compute_weight

STEPS, ACCUM, B, T = 2, 2, 2, 32


def _batches(vocab: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (B, T), generator=gen), torch.randint(0, vocab, (B, T), generator=gen))
            for _ in range(STEPS * ACCUM)]


def _train(spec, cache: bool, optimizer=torch.optim.AdamW, check_copies: bool = False, steps: int = STEPS):
    """STEPS AdamW steps of ACCUM micro-batches under CPU bf16 autocast; (losses, per-step grads, params, cache)."""
    model = build_model(spec, "cpu", seed=0)
    opt = optimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    cw = ComputeWeights(model, opt) if cache else None
    batches = iter(_batches(spec.vocab_size))
    losses, grads = [], []
    for _ in range(steps):
        if cw is not None:
            cw.refresh_if_stale()
            if check_copies:  # what the forwards read: the bf16 rounding of the current weights, bit for bit
                for m, n in cw.targets:
                    assert torch.equal(compute_weight(m, n), getattr(m, n).detach().to(torch.bfloat16)), n
        for _ in range(ACCUM):
            x, y = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
            (loss / ACCUM).backward()
            losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, cw


def test_bitwise_autocast(small_spec):
    """Losses of every micro-batch, the accumulated gradients of every step and the weights after them: equal bit for
    bit with and without the copies (gradient accumulation over 2 micro-batches, 2 optimizer steps)."""
    ref_losses, ref_grads, ref_params, _ = _train(small_spec, cache=False)
    losses, grads, params, cw = _train(small_spec, cache=True)
    for a, b in zip(ref_losses, losses, strict=True):
        assert torch.equal(a, b), (a, b)
    for step, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), (step, name, (ga[name] - gb[name]).abs().max())
    for name in ref_params:
        assert torch.equal(ref_params[name], params[name]), name
    assert cw.casts == STEPS  # once per optimizer step, not per micro-batch
    assert ref_losses[0].dtype == torch.float32 and len({float(x) for x in losses}) > 1


def test_streaming_adamw_writes_the_copies(small_spec):
    """With StreamingAdamW (moestack/ops/adamw, here under the interpreter) the optimizer writes every copy: one cast
    for the whole run, the copies each step's exact bf16 rounding of the weights; the losses within fp32 rounding of
    torch's AdamW with the recast, and the weights after one step too (after two, elements whose gradient is near
    zero take AdamW's ~lr-sized steps in either direction: no bound there says anything)."""
    import os

    import pytest

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton AdamW needs a GPU or TRITON_INTERPRET=1")
    from moestack.train.optim import StreamingAdamW

    ref_losses, _, ref_params, ref_cw = _train(small_spec, cache=True, check_copies=True)
    every = functools.partial(StreamingAdamW, min_numel=0)  # every parameter in the Triton pass
    losses, _, params, cw = _train(small_spec, cache=True, optimizer=every, check_copies=True)
    assert ref_cw.casts == STEPS and cw.casts == 1
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=0)
    _, _, ref_params, _ = _train(small_spec, cache=True, steps=1)
    _, _, params, _ = _train(small_spec, cache=True, optimizer=every, steps=1)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-7)


def test_targets_and_exclusions(small_spec):
    """Every Linear (LM head included) and the routed experts get copies; FP8 experts, MXFP4 fake-quantised experts and
    the router do not; the parameters, their names and the state_dict are unchanged."""
    model = build_model(small_spec, "cpu", seed=0)
    keys = list(model.state_dict())
    moe = next(iter(model.moe_layers().values()))
    cw = ComputeWeights(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(type(m) is CachedLinear for m in linears)
    names = {(id(m), n) for m, n in cw.targets}
    assert (id(model.lm_head), "weight") in names
    assert {(id(moe.experts), "w_gate_up"), (id(moe.experts), "w_down")} <= names
    assert not any(m is moe.router for m, _ in cw.targets)
    assert list(model.state_dict()) == keys
    cw.refresh()
    w = compute_weight(moe.experts, "w_down")
    assert w.dtype == torch.bfloat16 and torch.equal(w, moe.experts.w_down.detach().to(torch.bfloat16))
    assert w.is_leaf and w.requires_grad  # its gradient goes on to the fp32 parameter (test_copies_keep_their_address)
    assert compute_weight(moe.router) is moe.router.weight
    assert cw.num_bytes == 2 * sum(getattr(m, n).numel() for m, n in cw.targets)
    cw.remove()
    assert compute_weight(moe.experts, "w_down") is moe.experts.w_down

    fresh = build_model(small_spec, "cpu", seed=0)
    fresh_moe = next(iter(fresh.moe_layers().values()))
    from moestack.ops.fp8.grouped_gemm import Fp8GroupedGemm

    fresh_moe.experts.gemm = Fp8GroupedGemm()  # quantises from the fp32 parameter: a bf16 copy would round twice
    assert not any(m is fresh_moe.experts for m, _ in ComputeWeights(fresh).targets)
    qat = build_model(small_spec, "cpu", seed=0)
    qat_moe = next(iter(qat.moe_layers().values()))
    qat_moe.experts.fake_quant = "mxfp4"
    assert not any(m is qat_moe.experts for m, _ in ComputeWeights(qat).targets)


def test_refresh_follows_writes(small_spec):
    """A copy is made again after an optimizer step (fused AdamW does not bump version counters: the step hook) and
    after a load (version counters), and not otherwise."""
    model = build_model(small_spec, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cw = ComputeWeights(model, opt)
    assert cw.refresh_if_stale() and not cw.refresh_if_stale()
    head = model.lm_head
    (compute_weight(head).float().sum()).backward()
    opt.step()
    assert cw.refresh_if_stale()
    assert torch.equal(compute_weight(head), head.weight.detach().to(torch.bfloat16))
    state = {k: v + 1 if k == "lm_head.weight" else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert cw.refresh_if_stale()
    assert torch.equal(compute_weight(head), head.weight.detach().to(torch.bfloat16))


def test_copies_keep_their_address(small_spec):
    """A refresh rewrites each copy in place (CUDA graphs record its address as a static input): the same storage
    after optimizer steps and a load, with the new values; a forward's weight aliases it and its gradient reaches
    the fp32 parameter as the cast's would."""
    model = build_model(small_spec, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cw = ComputeWeights(model, opt)
    cw.refresh()
    moe = next(iter(model.moe_layers().values()))
    watched = [(model.lm_head, "weight"), (moe.experts, "w_down")]
    ptrs = [m._compute_weights[n].data_ptr() for m, n in watched]
    for _ in range(2):
        compute_weight(model.lm_head).float().square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert cw.refresh_if_stale()
        for (m, n), ptr in zip(watched, ptrs, strict=True):
            w = compute_weight(m, n)
            assert w.data_ptr() == ptr and torch.equal(w, getattr(m, n).detach().to(torch.bfloat16))
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    assert cw.refresh_if_stale() and model.lm_head._compute_weights["weight"].data_ptr() == ptrs[0]
    g = torch.randn(model.lm_head.weight.shape, dtype=torch.bfloat16)
    compute_weight(model.lm_head).backward(g)
    assert model.lm_head.weight.grad.dtype == torch.float32 and torch.equal(model.lm_head.weight.grad, g.float())
    with torch.no_grad():
        assert compute_weight(model.lm_head) is model.lm_head._compute_weights["weight"]


def test_trainer_bitwise(small_spec, tmp_path):
    """The trainer (precision bf16 on CPU, 2 micro-batches per step): the same losses, gradient norms and weights with
    weight_cache on and off."""
    from moestack.train.trainer import Trainer

    out = {}
    for cache in (False, True):
        spec = TrainSpec(out_dir=str(tmp_path / str(cache)), steps=2, micro_batch_size=2, grad_accum_steps=2,
                         seq_len=T, precision="bf16", device="cpu", weight_cache=cache,
                         logging={"tensorboard": False, "progress": False})
        trainer = Trainer(spec, small_spec, log=lambda *a, **k: None)
        assert (trainer.compute_weights is not None) == cache
        stats = [trainer.train_step() for _ in range(2)]
        out[cache] = ([(s.loss, s.grad_norm) for s in stats],
                      {n: p.detach() for n, p in trainer.model.named_parameters()})
    assert out[False][0] == out[True][0]
    for name, p in out[False][1].items():
        assert torch.equal(p, out[True][1][name]), name


def test_cached_parameters_get_no_autograd_gradient(small_spec):
    """Every forward reads a cached weight through its copy: the fp32 parameter is never in the autograd graph (a
    read of it would have AccumulateGrad fill .grad beside the copy's hook, with blocks+graphs a CUDA graph's output
    that the next micro-batch's replay rewrites)."""
    model = build_model(small_spec, "cpu", seed=0)
    cw = ComputeWeights(model)
    cw.refresh()
    read = []
    for m, n in cw.targets:
        getattr(m, n).register_hook(lambda g, name=f"{type(m).__name__}.{n}": read.append(name))
    x, y = _batches(small_spec.vocab_size)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, y).backward()
    assert read == [], f"parameters read past their compute copy: {read}"
    assert all(getattr(m, n).grad is not None for m, n in cw.targets)
