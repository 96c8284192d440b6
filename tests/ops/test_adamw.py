"""moestack/ops/adamw and StreamingAdamW (moestack/train/optim.py): the reference is torch's AdamW, the Triton pass is
the reference within fp32 rounding (the bias corrections' exp2 against pow), the bf16 copy is bit for bit
`copy_(p)`, a found_inf step moves nothing, and the optimizer keeps torch's fused AdamW's state and skip.

CPU: the kernel under TRITON_INTERPRET=1 (fp32 math as on the GPU); GPU: against torch's fused AdamW at K3 size.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernel is decorated
pytest.importorskip("triton")

from moestack.ops.adamw import adamw_reference, triton_takes  # noqa: E402
from moestack.ops.adamw.triton_adamw import BLOCK, adamw_triton  # noqa: E402
from moestack.train.optim import StreamingAdamW  # noqa: E402
from moestack.train.step_update import fused_skip_supported, step_optimizer  # noqa: E402

HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(n: int, seed: int, device: str = "cpu", grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    g = (torch.randn(n, generator=gen) * 0.1).to(grad_dtype)
    return [t.to(device) for t in (p, g, m, v)]


def test_reference_is_torch_adamw():
    """fp64, 4 steps with fresh gradients: the reference's numbers are torch.optim.AdamW's (single-tensor path)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(37, 5, dtype=torch.float64, generator=gen))
    opt = torch.optim.AdamW([w], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False)
    p, m, v = w.detach().clone(), torch.zeros_like(w), torch.zeros_like(w)
    for step in range(1, 5):
        g = torch.randn(w.shape, dtype=torch.float64, generator=gen)
        w.grad = g.clone()
        opt.step()
        adamw_reference(p, g, m, v, step, **HP)
        torch.testing.assert_close(p, w.detach(), rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(m, opt.state[w]["exp_avg"], rtol=1e-14, atol=0)
        torch.testing.assert_close(v, opt.state[w]["exp_avg_sq"], rtol=1e-14, atol=0)


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 5])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(n, grad_dtype):
    """3 steps, the clip folded in (grad_scale) and a copy written: p, m, v within a few fp32 ulp of the reference
    (torch's pow against exp2 in the bias corrections), the copy bit for bit p's bf16 rounding over a NaN-filled
    buffer."""
    p, g, m, v = _tensors(n, n, grad_dtype=grad_dtype)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    step = torch.zeros((), dtype=torch.float32)
    copy = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    for k in range(1, 4):
        g = (g.float() * 0.7 + 0.01 * k).to(grad_dtype)
        scale = torch.tensor(1.25 + k)
        step += 1
        adamw_triton(p, g, m, v, step, copy=copy, grad_scale=scale, **HP)
        adamw_reference(rp, g, rm, rv, k, grad_scale=float(scale), **HP)
        torch.testing.assert_close(m, rm, rtol=2e-6, atol=1e-12)
        torch.testing.assert_close(v, rv, rtol=2e-6, atol=1e-14)
        torch.testing.assert_close(p, rp, rtol=2e-6, atol=1e-7)
        assert torch.equal(copy, p.to(torch.bfloat16))
    assert (p != _tensors(n, n)[0]).float().mean() > 0.99  # every element moved


def test_found_inf_moves_nothing_and_nan_propagates():
    n = BLOCK + 7
    p, g, m, v = _tensors(n, 3)
    copy = torch.zeros(n, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, copy)]
    step = torch.ones(())
    adamw_triton(p, g, m, v, step, copy=copy, found_inf=torch.ones(()), **HP)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v, copy), strict=True))
    g[5] = float("nan")
    adamw_triton(p, g, m, v, step, copy=copy, found_inf=torch.zeros(()), **HP)
    assert torch.isnan(p[5]) and torch.isnan(copy[5]) and int(torch.isnan(p).sum()) == 1


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on inf * 0
def test_bf16_rounding_edges():
    """Round to nearest even on the bits: ties, the largest finite values rounding to inf, signed zeros, subnormals,
    inf and NaN, as torch's cast."""
    vals = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.3895e38, -3.3895e38, 0.0, -0.0,
                         1e-40, -1e-40, float("inf"), float("-inf"), float("nan"), 65504.0, 1.00390625])
    n = vals.numel()
    p, m, v = vals.clone(), torch.zeros(n), torch.zeros(n)
    copy = torch.empty(n, dtype=torch.bfloat16)
    # lr 0, no decay, a zero gradient: p - 0 * p, which keeps the finite values (-0.0 becomes +0.0, +-inf NaN, as in
    # the reference)
    hp = dict(lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    adamw_triton(p, torch.zeros(n), m, v, torch.ones(()), copy=copy, **hp)
    ref = vals.clone()
    adamw_reference(ref, torch.zeros(n), torch.zeros(n), torch.zeros(n), 1, **hp)
    assert torch.equal(ref[:6], vals[:6]) and torch.equal(ref[7:9], vals[7:9])
    want = ref.to(torch.bfloat16)
    same = (copy.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(copy) & torch.isnan(want))
    assert bool(same.all()), (copy, want)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 7))


def _run(opt_cls, steps: int = 4, clip: float = 0.5, **kw):
    model = _model()
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = opt_cls([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95),
                  weight_decay=0.1, **kw)
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        x = torch.randn(16, 24, generator=gen)
        loss = model(x).square().mean() * (1e30 if step == 2 else 1.0)  # step 2: inf norm, skipped on the device
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]).float()
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        assert step_optimizer(opt, params, norm, finite, clip, clipped=False) is None  # decided on the device
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("min_numel", [0, 500])
def test_optimizer_is_torch_fused_adamw(min_numel):
    """4 steps with the clip folded in and one non-finite step skipped, every parameter in the Triton pass (0) or
    the 960-element weight there and the rest in torch's multi-tensor step (500): the weights within fp32 rounding of
    torch's fused AdamW, the same state layout (steps 3, not 4), the state dict loads into torch's optimizer."""
    ref_model, ref_opt = _run(torch.optim.AdamW, fused=True)
    model, opt = _run(StreamingAdamW, min_numel=min_numel)
    assert fused_skip_supported(opt) and opt.copies_written
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        sa, sb = ref_opt.state[a], opt.state[b]
        assert sa.keys() == sb.keys() and float(sb["step"]) == float(sa["step"]) == 3.0
        assert sb["step"].dtype == sa["step"].dtype and sb["step"].device == sa["step"].device
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    ref_opt.load_state_dict(opt.state_dict())  # the same format both ways


def test_writes_attached_copies_and_falls_back():
    """Copies of parameters in the Triton pass (the 960-element weight) and in torch's step (the 280-element one)
    are both written; a step torch's fused kernel has to take writes none."""
    model = _model()
    opt = StreamingAdamW(model.parameters(), lr=1e-2, min_numel=500)
    pairs = [(m.weight, torch.full_like(m.weight, float("nan"), dtype=torch.bfloat16)) for m in (model[0], model[2])]
    opt.attach_compute_copies(pairs)
    model(torch.randn(3, 24)).sum().backward()
    opt.step()
    assert opt.copies_written
    assert all(torch.equal(c, w.detach().to(torch.bfloat16)) for w, c in pairs)
    amsgrad = StreamingAdamW(_model().parameters(), lr=1e-2, amsgrad=True)  # not the pass's: torch's fused step
    m = next(iter(amsgrad.param_groups[0]["params"]))
    m.grad = torch.ones_like(m)
    amsgrad.step()
    assert not amsgrad.copies_written and "max_exp_avg_sq" in amsgrad.state[m]
    assert not triton_takes(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), None)
    assert not triton_takes(torch.zeros(4, 3).t(), torch.zeros(3, 4), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_against_torch_fused_at_k3_size():
    """8 experts' gate-up weight at K3 width, a dense one and a vector, 5 steps with a skipped one: within fp32
    rounding of torch's fused AdamW; the copies bit for bit. (~7 GB: the suite runs 6 GPU tests at once.)"""
    shapes = [(8, 6144, 3584), (7168, 1536), (7168,)]
    refs = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    mine = [torch.nn.Parameter(r.detach().clone()) for r in refs]
    ref_opt = torch.optim.AdamW(refs, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    opt = StreamingAdamW(mine, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)  # the vector: torch's step
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in mine]
    opt.attach_compute_copies(list(zip(mine, copies, strict=True)))
    for step in range(5):
        for r, p in zip(refs, mine, strict=True):
            r.grad = torch.randn_like(r) * 1e-3
            p.grad = r.grad.clone()
        for o in (ref_opt, opt):
            o.found_inf = torch.tensor(float(step == 3), device="cuda")
            o.grad_scale = torch.tensor(1.5, device="cuda")
            o.step()
        for r, p, c in zip(refs, mine, copies, strict=True):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7)
            assert torch.equal(c, p.detach().to(torch.bfloat16))
    assert float(opt.state[mine[0]]["step"]) == 4.0


def test_resume_reproduces_the_uninterrupted_run():
    """4 steps in one go against 2 steps, the state dict into a fresh optimizer (and fresh weights loaded), 2 more:
    the same bits (the step counts, moments and weights are the whole state)."""
    def batches():
        gen = torch.Generator().manual_seed(9)
        return [torch.randn(8, 24, generator=gen) for _ in range(4)]

    def train(model, opt, xs):
        for x in xs:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    xs = batches()
    whole = _model()
    train(whole, StreamingAdamW(whole.parameters(), lr=1e-2, min_numel=0), xs)
    first = _model()
    opt = StreamingAdamW(first.parameters(), lr=1e-2, min_numel=0)
    train(first, opt, xs[:2])
    resumed = _model(seed=1)
    resumed.load_state_dict(first.state_dict())
    opt2 = StreamingAdamW(resumed.parameters(), lr=1e-2, min_numel=0)
    opt2.load_state_dict(opt.state_dict())
    train(resumed, opt2, xs[2:])
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
