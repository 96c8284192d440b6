"""FP8 Linear (moestack/ops/fp8/linear.py): the expert GEMM with one expert, for the LatentMoE's down / up projections.

CPU: the Triton kernels in the interpreter, the cuBLAS path through test_fp8's emulated torch._scaled_mm (which
asserts torch's blockwise layout rules). Exact checks use unrounded fp32 "q" (the interpreter rounds fp8 casts
wrongly); the e4m3 checks compare with the recipe in torch (reference.py's *_ref) at a bound that allows for the
interpreter's rounding, and with the plain fp32 Linear at an fp8 bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from test_fp8 import DEV, emulated_scaled_mm, rel_err  # first: sets TRITON_INTERPRET

from moestack.ops.fp8 import linear as fl
from moestack.ops.fp8 import reference as fq
from moestack.ops.fp8 import scaled_mm as fsm
from moestack.ops.fp8 import weight_cache as wc

# numeric cases run the Triton kernels on CPU tensors: interpreter only (test_fp8's GPU tests cover the kernels)
interpreter_only = pytest.mark.skipif(DEV == "cuda", reason="interpreter / emulation case")

# path: (in, out, N rows). cuBLAS: both widths multiples of 512, forced by cublas_min_rows=0; Triton:
# widths that are not (192: a partial 128-group), N past one 128-token tile and not a multiple of 128
PATHS = {"cublas": (512, 512, 131), "triton": (192, 160, 150)}
# e4m3 on both operands: the torch recipe is 3.6-3.7% (relative RMS) from fp32 here. The interpreter's fp8 cast
# halves the ~2% of values that should round up to the next power of two (64 for 128: the carry is lost), about 5%
# relative RMS per operand, so the kernels' results sit 6.7-9.1% from the recipe and 7.4-9.5% from fp32 at these
# shapes (a wrong layout or scale is off by ~100%). On a GPU the quantisers match the recipe up to ties.
INTERP_VS_RECIPE = 0.12
FP8_VS_FP32 = 0.12
RECIPE_VS_FP32 = 0.05


@pytest.fixture
def gemm_path(request, monkeypatch):
    """Select the cuBLAS (emulated, one call per GEMM counted) or the Triton path; yields (in, out, N, calls,
    cublas_min_rows)."""
    calls: list[tuple[int, ...]] = []
    if request.param == "cublas":
        min_rows = 0
        monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
        monkeypatch.setattr(fsm, "_scaled_mm_into", lambda *a: (calls.append(tuple(a[0].shape)), emulated_scaled_mm(
            *a[:4], a[4].dtype, a[4]))[1])
    else:
        min_rows = 10**9
        monkeypatch.setattr(fsm, "rows_mm", lambda *a, **k: pytest.fail("the Triton case took the cuBLAS path"))
    wc.clear()
    yield (*PATHS[request.param], calls, min_rows)
    wc.clear()


def make_linear(n_in: int, n_out: int, N: int, seed: int, lead: tuple[int, ...] = ()):
    """An nn.Linear without bias (init std 0.02 as the model's), x [*lead, N, in] and dy of the output's shape."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * 0.02)
    x = torch.randn(*lead, N, n_in, generator=g)
    dy = torch.randn(*lead, N, n_out, generator=g)
    return lin, x, dy


def forward_backward(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """(y, dx, dw) of fn(x, w) with the output gradient dy."""
    xg = x.clone().requires_grad_(True)
    y = fn(xg, w)
    dx, dw = torch.autograd.grad(y, (xg, w), dy)
    return y, dx, dw


def recipe_reference(x: torch.Tensor, W: torch.Tensor, dy: torch.Tensor, q_dtype: torch.dtype):
    """The FP8 recipe in torch (reference.py's *_ref), fp64: y = deq(x rows) deq(W^T blocks), dx = deq(dy rows)
    deq(W blocks), dW = deq(dy token tiles)^T deq(x token tiles)."""
    N = x.shape[0]
    offs = torch.tensor([N], dtype=torch.int32)
    wT = fq.dequantize_blocks(*fq.quantize_blocks_ref(W.t().unsqueeze(0), q_dtype))[0].double()  # [in, out]
    w = fq.dequantize_blocks(*fq.quantize_blocks_ref(W.unsqueeze(0), q_dtype))[0].double()  # [out, in]
    y = fq.dequantize_rows(*fq.quantize_rows_ref(x, q_dtype)).double() @ wT
    dx = fq.dequantize_rows(*fq.quantize_rows_ref(dy, q_dtype)).double() @ w

    def token_tiles(t: torch.Tensor) -> torch.Tensor:  # [N, width], dequantised from its 128x1 tiles
        qT, s = fq.quantize_token_tiles_ref(t, offs, q_dtype)
        return (qT.double() * s.double().repeat_interleave(fq.GROUP, 0).t())[:, :N].t()

    dW = token_tiles(dy).t() @ token_tiles(x)
    return y, dx, dW


@interpreter_only
@pytest.mark.parametrize("gemm_path", ["cublas", "triton"], indirect=True)
def test_fp8_linear_exact_with_unrounded_q(gemm_path):
    """Unrounded fp32 "q": forward, dX and dW equal x W^T and its gradients in fp64 (scales, tiling and layouts
    exact); the cuBLAS case makes one call per GEMM, the Triton case none."""
    n_in, n_out, N, calls, min_rows = gemm_path
    lin, x, dy = make_linear(n_in, n_out, N, seed=1)
    y, dx, dw = forward_backward(lambda a, w: fl.fp8_linear(a, w, q_dtype=torch.float32, cublas_min_rows=min_rows),
                                 x, lin.weight, dy)
    y_ref, dx_ref, dw_ref = recipe_reference(x, lin.weight.detach(), dy, torch.float32)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(dx, dx_ref) < 1e-5 and rel_err(dw, dw_ref) < 1e-5
    assert rel_err(y_ref, x.double() @ lin.weight.detach().double().t()) < 1e-6  # fp32 "q" quantises nothing
    assert dw.shape == lin.weight.shape and dw.is_contiguous() and y.dtype == dx.dtype == dw.dtype == torch.float32
    assert len(calls) == (3 if n_in % 512 == 0 else 0)


@interpreter_only
@pytest.mark.parametrize("gemm_path", ["cublas", "triton"], indirect=True)
def test_fp8_linear_e4m3_vs_recipe_and_fp32(gemm_path):
    """Real e4m3: forward and both gradients near the torch recipe and within an fp8 bound of the fp32 Linear."""
    n_in, n_out, N, _, min_rows = gemm_path
    lin, x, dy = make_linear(n_in, n_out, N, seed=2)
    got = forward_backward(lambda a, w: fl.fp8_linear(a, w, cublas_min_rows=min_rows), x, lin.weight, dy)
    recipe = recipe_reference(x, lin.weight.detach(), dy, fq.FP8)
    exact = forward_backward(lambda a, w: a @ w.t(), x, lin.weight, dy)
    for name, g, r, e in zip(("y", "dx", "dW"), got, recipe, exact):
        assert rel_err(r, e) < RECIPE_VS_FP32, (name, rel_err(r, e))
        assert rel_err(g, r) < INTERP_VS_RECIPE, (name, rel_err(g, r))
        assert rel_err(g, e) < FP8_VS_FP32, (name, rel_err(g, e))


@interpreter_only
def test_fp8_linear_leading_dims_and_autocast():
    """x [B, T, in] -> [B, T, out]; inside autocast the output is in the autocast dtype, the gradients in the
    input's and the parameter's dtypes (Triton path at these widths, 40 rows: swap-AB)."""
    wc.clear()
    lin, x, dy = make_linear(192, 160, 20, seed=3, lead=(2,))
    y, dx, dw = forward_backward(lambda a, w: fl.fp8_linear(a, w, q_dtype=torch.float32), x, lin.weight, dy)
    y_ref, dx_ref, dw_ref = recipe_reference(x.view(40, 192), lin.weight.detach(), dy.view(40, 160), torch.float32)
    assert y.shape == (2, 20, 160) and dx.shape == x.shape
    assert rel_err(y.view(40, 160), y_ref) < 1e-5 and rel_err(dx.view(40, 192), dx_ref) < 1e-5
    assert rel_err(dw, dw_ref) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16, dx16, dw16 = forward_backward(lambda a, w: fl.fp8_linear(a, w, q_dtype=torch.float32), x, lin.weight,
                                           dy.bfloat16())
    assert y16.dtype == torch.bfloat16 and dx16.dtype == torch.float32 and dw16.dtype == torch.float32
    assert rel_err(y16, y) < 1e-2 and rel_err(dw16, dw) < 1e-2  # bf16 inputs: bf16 rounding only
    wc.clear()


def test_bias_is_refused():
    with pytest.raises(ValueError, match="bias is not supported"):
        fl.Fp8Linear(8, 8, bias=True)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=True))
    with pytest.raises(ValueError, match=r"convert_to_fp8_linear: 1 has a bias"):
        fl.convert_to_fp8_linear(model, ["0", "1"])
    assert type(model[0]) is nn.Linear  # checked before anything changed
    lin = fl.Fp8Linear(8, 8)
    lin.bias = nn.Parameter(torch.zeros(8))  # added after construction: refused when run
    with pytest.raises(ValueError, match="bias is not supported"):
        lin(torch.randn(2, 8))


def test_forward_is_one_compile_boundary(monkeypatch):
    """Under torch.compile the FP8 Linear is a graph break as a whole: its forward frame is never compiled (it held
    only the opaque op, and per input dtype and shape dynamo recompiled it up to its recompile limit, then checked
    those guards on every call: the K3 slice's FP8 blocks hit it). The GEMM itself is replaced by a plain one here:
    this is about the frames, the numbers are the other tests'."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries

    from moestack.ops.opaque import activate

    monkeypatch.setattr(fl, "fp8_linear", lambda x, w, **kw: x.to(w.dtype) @ w.t())
    layers = [fl.Fp8Linear(8 + i, 8) for i in range(10)]

    def block(x, layer):
        return layer(x.sin()).cos()

    activate()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager")
    for dtype in (torch.float32, torch.bfloat16):
        for layer in layers:
            x = torch.randn(3, layer.in_features, dtype=dtype)
            assert torch.equal(compiled(x, layer), block(x, layer))
    forward = fl.Fp8Linear.forward
    assert cache_entries(forward.__wrapped__.__code__) == [] and cache_entries(forward.__code__) == []
    torch._dynamo.reset()


def test_convert_keeps_parameters_and_state_dict():
    """In place: the same module and Parameter objects, the same state_dict keys; the count; idempotent; by names
    or by a filter; revert; errors for missing names and non-Linear modules."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(8, 4, bias=False), "b": nn.Sequential(nn.Linear(4, 8, bias=False)),
                           "c": nn.Linear(8, 8, bias=False), "norm": nn.LayerNorm(8)})
    modules, params, keys = list(model.modules()), list(model.parameters()), list(model.state_dict())
    assert fl.convert_to_fp8_linear(model, ["a", "b.0"]) == 2
    assert type(model["a"]) is fl.Fp8Linear and type(model["b"][0]) is fl.Fp8Linear and type(model["c"]) is nn.Linear
    assert fl.convert_to_fp8_linear(model, ["a"]) == 0  # already FP8
    assert fl.convert_to_fp8_linear(model, ["c"], torch.float32, 64, "step") == 1
    assert (model["c"].fp8_q_dtype, model["c"].fp8_cublas_min_rows, model["c"].fp8_cache_mode) == (
        torch.float32, 64, "step")
    assert all(a is b for a, b in zip(model.modules(), modules)) and len(list(model.modules())) == len(modules)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert list(model.state_dict()) == keys
    assert fl.revert_fp8_linear(model) == 3 and all(type(m) is not fl.Fp8Linear for m in model.modules())
    with pytest.raises(AttributeError):
        fl.convert_to_fp8_linear(model, ["missing"])
    with pytest.raises(ValueError, match="norm is LayerNorm"):
        fl.convert_to_fp8_linear(model, ["norm"])


def _fp8_names(module: nn.Module) -> set[str]:
    return {n for n, m in module.named_modules() if isinstance(m, fl.Fp8Linear)}


@interpreter_only
def test_latent_projections_moe_and_tiny_model():
    """The recipe's Linear list for a LatentMoE is exactly its down / up projections; the tiny preset's model with
    those converted runs forward and backward with gradients on the converted weights."""
    from moestack.config import load_model_spec
    from moestack.config.model_spec import MoESpec
    from moestack.model.moe import MoE
    from moestack.model.transformer import build_model
    from moestack.ops.fp8.convert import fp8_linear_names

    wc.clear()
    moe = MoE(32, MoESpec(num_experts=4, top_k=2, expert_intermediate_size=16, latent_size=16), "situ_glu")
    assert fp8_linear_names(moe) == (["down_proj", "up_proj"], [])
    assert fl.convert_to_fp8_linear(moe, ["down_proj", "up_proj"]) == 2 and _fp8_names(moe) == {"down_proj", "up_proj"}
    plain = MoE(32, MoESpec(num_experts=4, top_k=2, expert_intermediate_size=16), "situ_glu")
    assert fp8_linear_names(plain) == ([], [])

    model = build_model(load_model_spec("tiny"), "cpu", seed=0)
    moe_names = list(model.moe_layers())
    assert moe_names and all(model.layers[n].ffn.down_proj is not None for n in moe_names)
    keys = list(model.state_dict())
    latent = [f"layers.{n}.ffn.{p}" for n in moe_names for p in ("down_proj", "up_proj")]
    assert set(latent) <= set(fp8_linear_names(model)[0])
    assert fl.convert_to_fp8_linear(model, latent, cublas_min_rows=10**9) == 2 * len(moe_names)
    assert _fp8_names(model) == set(latent)
    assert list(model.state_dict()) == keys
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, tokens)
    loss.backward()
    assert torch.isfinite(loss)
    for n in moe_names:
        for p in ("down_proj", "up_proj"):
            grad = model.layers[n].ffn.get_submodule(p).weight.grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    wc.clear()


@interpreter_only
def test_host_ends_skip_host_offsets(monkeypatch):
    """On the cuBLAS path (forward, dX, dW) the Linear passes its row count as host offsets: fsm.host_offsets is
    never called and its one cached entry (the experts' offsets) survives."""
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    wc.clear()
    expert_offs = torch.tensor([5, 9, 20], dtype=torch.int32)
    expert_ends = fsm.host_offsets(expert_offs)  # the expert layer's cached read
    real_host_offsets = fsm.host_offsets

    def no_host_read(offs):
        raise AssertionError(f"fsm.host_offsets called with {offs}")

    monkeypatch.setattr(fsm, "host_offsets", no_host_read)
    lin, x, dy = make_linear(512, 512, 131, seed=4)
    y, dx, dw = forward_backward(lambda a, w: fl.fp8_linear(a, w, q_dtype=torch.float32, cublas_min_rows=0), x,
                                 lin.weight, dy)
    W = lin.weight.detach().double()
    assert rel_err(y, x.double() @ W.t()) < 1e-5 and rel_err(dx, dy.double() @ W) < 1e-5
    assert rel_err(dw, dy.double().t() @ x.double()) < 1e-5
    monkeypatch.setattr(fsm, "host_offsets", real_host_offsets)
    assert fsm._state["host"][0]() is expert_offs and fsm.host_offsets(expert_offs) is expert_ends  # a cache hit
    wc.clear()


@interpreter_only
def test_weight_cache_follows_the_linear_weight(monkeypatch):
    """The fp8 weight cache keys on the parameter behind W.t().unsqueeze(0): the second call hits, another view
    of the same parameter is its own entry, an in-place update and an optimizer step each make the next call miss
    and the output follow the new weight."""
    monkeypatch.setattr(fsm, "SCALED_MM", emulated_scaled_mm)
    wc.clear()
    lin, x, _ = make_linear(512, 512, 131, seed=5)
    lin.__class__ = fl.Fp8Linear  # what convert_to_fp8_linear does

    def run() -> torch.Tensor:
        with torch.no_grad():
            return fl.fp8_linear(x, lin.weight, q_dtype=torch.float32, cublas_min_rows=0)

    def counts() -> tuple[int, int]:
        return wc.stats["hits"], wc.stats["misses"]

    h, m = counts()
    y1 = run()
    assert counts() == (h, m + 1)
    y2 = run()
    assert counts() == (h + 1, m + 1) and torch.equal(y1, y2)
    other = lin.weight.unsqueeze(0)  # [1, out, in]: another view of the same parameter, another entry
    (q_other, s_other), _ = wc.pair(other, torch.float32)
    assert counts() == (h + 1, m + 2)  # a miss: its own entry, the Linear's are left in place
    assert rel_err(fq.dequantize_blocks(q_other, s_other), other.detach()) < 1e-6
    run()
    assert counts() == (h + 2, m + 2)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # an in-place update bumps the version counter
    y3 = run()
    assert counts() == (h + 2, m + 3) and rel_err(y3, 2 * y1) < 1e-6
    lin.weight.grad = torch.randn_like(lin.weight)
    torch.optim.SGD([lin.weight], lr=1.0).step()  # the optimizer-step hook empties the cache
    y4 = run()
    assert counts() == (h + 2, m + 4)
    assert rel_err(y4, x.double() @ lin.weight.detach().double().t()) < 1e-5
    wc.clear()
