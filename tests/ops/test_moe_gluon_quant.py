"""quantize_dual's Gluon kernel (gluon_quant.py, the default on sm_90) against its Triton kernel: bitwise.

Both kernels compute the same fp32 numbers and casts, so every written byte and scale must match. GPU only (Gluon
does not run in the interpreter); test_moe_fp8.py's quantize_dual GPU tests check the default path against the
torch spec. CPU: the kernel switch's error message.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moestack.ops.moe import fp8_quant as fq


def test_quant_env_rejects_unknown(monkeypatch):
    monkeypatch.setenv(fq.QUANT_ENV, "cuda")
    with pytest.raises(ValueError, match="MOESTACK_FP8_QUANT='cuda'"):
        fq._gluon_dual(torch.device("cuda", 0))


def test_quant_config_env(monkeypatch):
    from moestack.ops.moe import gluon_quant

    monkeypatch.setenv(gluon_quant.CONFIG_ENV, str(len(gluon_quant.CONFIGS)))
    with pytest.raises(ValueError, match="MOESTACK_FP8_QUANT_CONFIG"):
        gluon_quant.config_index()
    monkeypatch.setenv(gluon_quant.CONFIG_ENV, "1")
    assert gluon_quant.config_index() == 1


def _run(x, offs, em, tiles, kind, monkeypatch):
    monkeypatch.setenv(fq.QUANT_ENV, kind)
    return fq.quantize_dual(x, offs, expert_major=em, tiles=tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [3584, 200])
@pytest.mark.parametrize("counts", [[0, 1, 127, 128, 129, 0, 300], [2341] * 6 + [0, 5], list(range(0, 70 * 9, 9))])
def test_gluon_quant_dual_gpu(K, counts, monkeypatch):
    from moestack.ops.moe import gluon_quant

    if not gluon_quant.supported(torch.cuda.current_device()):
        pytest.skip("sm_90 only")
    g = torch.Generator().manual_seed(K + len(counts))
    used = sum(counts)
    x = torch.randn(used + 7, K, generator=g) * torch.rand(used + 7, 1, generator=g).pow(3) * 50  # rows of all scales
    x = x.to("cuda", torch.bfloat16)
    x[3] = 0  # an all-zero row: scale 1
    x[:, 5] = 0  # an all-zero column: token-tile scale 1
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
    n_tiles = sum((c + 127) // 128 for c in counts)
    cases = [(em, tiles, gluon_quant.CONFIGS[0]) for em in (False, True) for tiles in (True, False)]
    cases += [(True, True, c) for c in gluon_quant.CONFIGS[1:]]  # every launch config on the v3 call
    for em, tiles, config in cases:
        want = _run(x, offs, em, tiles, "triton", monkeypatch)
        monkeypatch.setattr(gluon_quant, "CONFIGS", (config,) + gluon_quant.CONFIGS)
        got = _run(x, offs, em, tiles, "gluon", monkeypatch)
        monkeypatch.undo()
        assert torch.equal(got[0].view(torch.uint8)[:used], want[0].view(torch.uint8)[:used]), (em, tiles, config)
        s_got, s_want = (got[1], want[1]) if em else (got[1][:used], want[1][:used])
        assert torch.equal(s_got, s_want), (em, tiles, config)
        if tiles:
            cols = n_tiles * fq.GROUP
            assert torch.equal(got[2].view(torch.uint8)[:, :cols], want[2].view(torch.uint8)[:, :cols])
            assert torch.equal(got[3][:n_tiles], want[3][:n_tiles])
        else:
            assert got[2] is None and got[3] is None
    # not a vacuous comparison: the values are fp8 of the data, not zeros
    assert got[0][:used].float().abs().max() == 448.0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
@pytest.mark.parametrize("inter,counts", [(3072, [2341] * 3 + [0, 130]), (256, [0, 1, 127, 128, 129, 0, 300])])
def test_fused_glu_source_gpu(kind, inter, counts, monkeypatch):
    """quantize_glu_dual (the activation inside the quantiser): Gluon (every config) and Triton kernels bitwise equal
    to quantize_dual of triton_activation's bf16 output, in every layout."""
    from moestack.ops.moe import gluon_quant
    from moestack.ops.moe.triton_activation import fused_glu

    if not gluon_quant.supported(torch.cuda.current_device()):
        pytest.skip("sm_90 only")
    g = torch.Generator().manual_seed(inter + len(counts))
    used = sum(counts)
    gu = (torch.randn(used + 5, 2 * inter, generator=g) * 4).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
    act = fused_glu(gu, kind, 4.0, 25.0)
    n_tiles = sum((c + 127) // 128 for c in counts)
    cols = n_tiles * fq.GROUP
    cases = [(em, tiles, "triton", None) for em, tiles in ((True, True), (False, True), (True, False))]
    cases += [(True, True, "gluon", c) for c in gluon_quant.SOURCE_CONFIGS[1]] + [(False, False, "gluon", None)]
    for em, tiles, quant, config in cases:
        want = _run(act, offs, em, tiles, "triton", monkeypatch)
        monkeypatch.setenv(fq.QUANT_ENV, quant)
        if config is not None:
            monkeypatch.setitem(gluon_quant.SOURCE_CONFIGS, 1, (config,))
        got = fq.quantize_glu_dual(gu, offs, kind, 4.0, 25.0, expert_major=em, tiles=tiles)
        monkeypatch.undo()
        assert torch.equal(got[0].view(torch.uint8)[:used], want[0].view(torch.uint8)[:used]), (quant, em, config)
        assert torch.equal(got[1] if em else got[1][:used], want[1] if em else want[1][:used]), (quant, em, config)
        if tiles:
            assert torch.equal(got[2].view(torch.uint8)[:, :cols], want[2].view(torch.uint8)[:, :cols])
            assert torch.equal(got[3][:n_tiles], want[3][:n_tiles])
        assert got[0][:used].float().abs().max() == 448.0  # fp8 of the data, not zeros
