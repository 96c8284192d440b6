"""quantize_dual's Gluon kernel (moestack/ops/fp8/gluon_quant.py, the default on sm_90) against its Triton kernel:
bitwise.

Both kernels compute the same fp32 numbers and casts, so every written byte and scale must match. GPU only (Gluon
does not run in the interpreter); test_fp8.py's quantize_dual GPU tests check the default path against the torch
spec.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moestack.ops.fp8 import quant as fq  # noqa: E402
from moestack.ops.fp8.reference import GROUP  # noqa: E402


def _run(x, offs, em, tiles, gluon: bool, monkeypatch):
    if not gluon:
        monkeypatch.setattr(fq, "gluon_module", lambda name, device: None)  # the Triton kernel
    out = fq.quantize_dual(x, offs, expert_major=em, tiles=tiles)
    monkeypatch.undo()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("K", [3584, 200])
@pytest.mark.parametrize("counts", [[0, 1, 127, 128, 129, 0, 300], [2341] * 6 + [0, 5], list(range(0, 70 * 9, 9))])
def test_gluon_quant_dual_gpu(K, counts, monkeypatch):
    from moestack.ops.fp8 import gluon_quant

    if not gluon_quant.supported(torch.cuda.current_device()):
        pytest.skip("sm_90 only")
    assert fq.gluon_module("gluon_quant", torch.device("cuda")) is not None
    g = torch.Generator().manual_seed(K + len(counts))
    used = sum(counts)
    x = torch.randn(used + 7, K, generator=g) * torch.rand(used + 7, 1, generator=g).pow(3) * 50  # rows of all scales
    x = x.to("cuda", torch.bfloat16)
    x[3] = 0  # an all-zero row: scale 1
    x[:, 5] = 0  # an all-zero column: token-tile scale 1
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
    n_tiles = sum((c + 127) // 128 for c in counts)
    for em in (False, True):
        for tiles in (True, False):
            want = _run(x, offs, em, tiles, False, monkeypatch)
            got = _run(x, offs, em, tiles, True, monkeypatch)
            assert torch.equal(got[0].view(torch.uint8)[:used], want[0].view(torch.uint8)[:used]), (em, tiles)
            s_got, s_want = (got[1], want[1]) if em else (got[1][:used], want[1][:used])
            assert torch.equal(s_got, s_want), (em, tiles)
            if tiles:
                cols = n_tiles * GROUP
                assert torch.equal(got[2].view(torch.uint8)[:, :cols], want[2].view(torch.uint8)[:, :cols])
                assert torch.equal(got[3][:n_tiles], want[3][:n_tiles])
            else:
                assert got[2] is None and got[3] is None
    # not a vacuous comparison: the values are fp8 of the data, not zeros
    assert got[0][:used].float().abs().max() == 448.0
