"""The launch-fit rules (moestack/ops/launch.py) on CPU, with fake device limits: the configs a pruner keeps fit the
limits by their shared-memory estimate, at least one config always remains, autotuning off keeps one, fallback
configs appear only where nothing else fits; the DSA forward's value slice is clamped to the padded value width
(the tiny preset's 299 KB launch); the Gluon kernels' fit checks pick a smaller config or step aside.
(The estimates themselves are checked against the compiler by benchmarks/tools/launch_fit_check.py; on a GPU,
tests/ops/test_launch_fit.py.)"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from moestack.ops import launch  # noqa: E402
from moestack.ops.launch import DeviceLimits  # noqa: E402

BF16, FP32, FP8 = (torch.empty(0, dtype=d) for d in (torch.bfloat16, torch.float32, torch.float8_e4m3fn))
# smallest to largest shared memory per block (opt-in) of the GPUs the kernels target: sm_86 / sm_89, sm_80, sm_90
LIMITS = [DeviceLimits(101376), DeviceLimits(166912), DeviceLimits(232448), DeviceLimits(8192)]


def C(kw: dict, w: int = 4, s: int = 2, maxnreg=None):
    return triton.Config(kw, num_warps=w, num_stages=s, maxnreg=maxnreg)


# per family: the kernels' GPU config sets (as in their modules) and launch arguments at model widths
CASES = {
    "dsa": ([C({"BLOCK_H": h, "BLOCK_K": k, "BLOCK_V": v}, w, s) for h, k, v, w, s in
             [(64, 64, 512, 8, 2), (64, 32, 512, 8, 3), (64, 32, 512, 8, 2), (64, 32, 256, 8, 2), (64, 16, 512, 8, 3),
              (32, 64, 512, 8, 2), (16, 64, 512, 4, 2)]],
            [{"Q": BF16, "VP": 512, "RP": 64}, {"Q": FP32, "VP": 512, "RP": 64}, {"Q": FP32, "VP": 32, "RP": 16}]),
    "dsa_dkv": ([C({"BLOCK_H": h, "BLOCK_K": k, "BLOCK_C": c}, w, s, r) for h, k, c, w, s, r in
                 [(64, 128, 64, 8, 2, None), (64, 128, 64, 8, 2, 128), (64, 64, 64, 4, 3, None),
                  (64, 64, 64, 4, 2, 168), (32, 128, 64, 8, 2, None)]],
                [{"Q": BF16, "VP": 512, "RP": 64, "DKV_OUT": "atomic"}, {"Q": FP32, "VP": 32, "RP": 16,
                                                                           "DKV_OUT": "atomic"},
                 {"Q": FP32, "VP": 32, "RP": 16, "DKV_OUT": "rows"}]),
    "dsa_dq": ([C({"BLOCK_H": h, "BLOCK_K": k}, w, s)
                for h, k, w, s in [(64, 32, 8, 3), (64, 64, 8, 2), (32, 64, 4, 3)]],
               [{"KV": BF16, "VP": 512, "RP": 64}, {"KV": FP32, "VP": 512, "RP": 64}]),
    "dsa_target": ([C({"BLOCK_H": 64, "BLOCK_K": 64}, 8), C({"BLOCK_H": 32, "BLOCK_K": 64}, 4)],
                   [{"Q": BF16, "VP": 512, "RP": 64}, {"Q": FP32, "VP": 512, "RP": 64}]),
    "indexer": ([C({"BLOCK_T": t, "BLOCK_S": s_}, w, 3) for t, s_, w in [(64, 256, 8), (128, 128, 8), (64, 128, 4)]],
                [{"Q": BF16, "DP": 128}, {"Q": FP32, "DP": 256}]),
    "kda_recurrence": ([C({"BV": v}, w) for v, w in [(32, 4), (32, 8), (64, 8), (64, 4)]],
                       [{"w": BF16, "BK": bk, "BT": 64} for bk in (32, 128, 256)]),
    "gg_swap": ([C({"BF": 128, "BK": 64}, 4, 4), C({"BF": 128, "BK": 128}, 4, 3)],
                [{"x": BF16, "BT": bt} for bt in (16, 64, 128)]),
    "gg_tma_fwd": ([C({"BT": t, "BF": f, "BK": k}, w, s) for t, f, k, w, s in
                    [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (64, 128, 64, 4, 4)]],
                   [{"x": BF16}]),
    "gg_wgrad": ([C({"BA": 128, "BB": 128, "GB": 8}, 8, 3), C({"BA": 64, "BB": 128, "GB": 8}, 4, 3)],
                 [{"p": BF16, "out": FP32, "RMAX": 128}, {"p": BF16, "out": BF16, "BT": 64}]),
    "fp8_mm": ([C({"BM": m, "BN": n}, w, s) for m, n, w, s in [(64, 128, 4, 4), (128, 128, 8, 3), (64, 256, 8, 3)]],
               [{"qx": FP8, "BK": 128}]),
    "fp8_swap": ([C({"BF": 128}, w, 4) for w in (4, 8)], [{"qx": FP8, "BT": bt, "BK": 128} for bt in (16, 64)]),
    "fp8_wgrad": ([C({"BD": 128, "BF": 128}, 8, 3), C({"BD": 64, "BF": 128}, 4, 4)], [{"qxT": FP8, "G": 128}]),
    "tile": ([C({"BR": 32}, 4), C({"BR": 64}, 8)], [{"BV": 128}, {"BV": 4096}]),
}


def test_every_family_has_cases():
    assert set(CASES) == set(launch.SMEM)


@pytest.fixture
def autotune_on():
    before = launch.autotune_enabled()
    launch.set_autotune(True)
    yield
    launch.set_autotune(before)


@pytest.mark.parametrize("family", sorted(CASES))
def test_kept_configs_fit_and_one_remains(family, autotune_on):
    configs, arg_sets = CASES[family]
    for args in arg_sets:
        for limits in LIMITS:
            kept = launch.fit_configs(configs, args, family, limits)
            est = {id(c): launch.smem_estimate(family, c, args) for c in configs}
            assert kept, (family, args, limits)
            fitting = [c for c in configs if launch.config_fits(c, est[id(c)], limits)]
            if fitting:
                assert kept == fitting, (family, args, limits)  # every fitting config, in order
            else:  # none fits: the smallest estimate only (a shape no config takes fails at launch, loudly)
                assert kept == [min(configs, key=lambda c: est[id(c)])]
            launch.set_autotune(False)
            one = launch.fit_configs(configs, args, family, limits)
            launch.set_autotune(True)
            assert one == kept[:1]


def test_register_cap_counts():
    limits = DeviceLimits(232448, 1024, 65536)
    assert launch.config_fits(C({}, 8, 2, 128), 1000, limits)  # 256 threads x 128 registers
    assert not launch.config_fits(C({}, 16, 2, 255), 1000, limits)  # 512 x 255 > 64K
    assert not launch.config_fits(C({}, 64, 2), 1000, limits)  # 2048 threads
    assert not launch.config_fits(C({}, 4, 2), 232449, limits)


def test_interpreter_and_cpu_tensors_keep_the_configs(autotune_on):
    configs = CASES["gg_swap"][0]
    assert launch.fit_configs(configs, {"x": torch.empty(2, 2), "BT": 16}, "gg_swap") == configs
    launch.set_autotune(False)
    assert launch.fit_configs(configs, {"x": torch.empty(2, 2), "BT": 16}, "gg_swap") == configs[:1]


def test_recurrence_fallback_only_where_nothing_fits(autotune_on):
    """K = 128: the tuned two-stage set, no one-stage fallback; K = 256 on the H200: the fallback only (every
    two-stage config is over 232448 B), and it fits."""
    configs, _ = CASES["kda_recurrence"]
    fallback = launch._recurrence_fallback()
    h200 = DeviceLimits(232448)
    k128 = launch.fit_configs(configs, {"w": BF16, "BK": 128, "BT": 64}, "kda_recurrence", h200, fallback)
    assert k128 == configs
    args = {"w": BF16, "BK": 256, "BT": 64}
    k256 = launch.fit_configs(configs, args, "kda_recurrence", h200, fallback)
    assert k256 and all(c in fallback for c in k256)
    assert all(launch.smem_estimate("kda_recurrence", c, args) <= h200.smem for c in k256)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Launch-time queries answer as a CUDA device with the given limits (set .limits)."""
    state = {"limits": DeviceLimits(232448)}
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "_device_of", lambda args: torch.device("cuda", 0))
    monkeypatch.setattr(launch, "device_limits", lambda index: state["limits"])
    return state


def test_dsa_forward_value_slice_is_clamped(fake_gpu, monkeypatch, autotune_on):
    """The tiny preset (kv_lora_rank 32, rope 8: VP 32, RP 16) in fp32: no kept config asks for a 512-wide value
    slice (the fallback to the first config did: 299264 B against the H200's 232448) and all fit."""
    from moestack.ops.dsa import triton_attn_fwd as F

    monkeypatch.setattr(F, "INTERPRET", False)
    configs = F.fwd_configs()
    assert max(c.kwargs["BLOCK_V"] for c in configs) == 512
    for H in (4, 20, 128):
        args = {"Q": FP32, "H": H, "VP": 32, "RP": 16}
        kept = F.prune_head_blocks(configs, args)
        assert kept and all(c.kwargs["BLOCK_V"] <= 32 for c in kept)
        assert all(launch.smem_estimate("dsa", c, args) <= 232448 for c in kept)
        keys = [(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in kept]
        assert len(keys) == len(set(keys))  # clamped duplicates dropped
    # MLA's widths in bf16 on the H200: the tuned set is kept whole (the value slices are not touched)
    kept = F.prune_head_blocks(configs, {"Q": BF16, "H": 64, "VP": 512, "RP": 64})
    assert [c.kwargs for c in kept] == [c.kwargs for c in configs]


def test_fits_for_fixed_configs(fake_gpu):
    dev = torch.device("cuda", 0)
    assert launch.fits(200_000, dev, 8) and not launch.fits(240_000, dev, 8)
    assert launch.fits(10**9, torch.device("cpu"))  # off CUDA nothing is checked


def test_gluon_attention_forward_picks_a_config_that_fits(fake_gpu):
    ga = pytest.importorskip("moestack.ops.dsa.gluon_attn_fwd")
    dev = torch.device("cuda", 0)
    assert ga.fitting_config(dev) == ga.DEFAULT_CONFIG  # 227 KB: the default
    fake_gpu["limits"] = DeviceLimits(180_000)
    cfg = ga.fitting_config(dev)
    assert cfg in ga.CONFIGS and cfg != ga.DEFAULT_CONFIG and ga.smem_bytes(cfg) <= 180_000
    fake_gpu["limits"] = DeviceLimits(64_000)
    assert ga.fitting_config(dev) is None  # supported() is then False: the Triton forward runs


def test_gluon_wgrad_fit_config_steps_down():
    gw = pytest.importorskip("moestack.ops.moe.gluon_wgrad")
    for limit in (232448, 166912, 101376):
        for rmax, config in gw.CONFIGS.items():
            bb, q_rows, nw = gw.fit_config(config, rmax, 3584, 6144, 4, smem_limit=limit)
            assert gw.smem_bytes(rmax, bb, q_rows, nw, 4) <= limit - 1024 or (bb == 16 and q_rows <= 2 * rmax)


def test_dsa_dkv_fallback_where_the_tuned_set_cannot_fit(fake_gpu, monkeypatch, autotune_on):
    """Pass 1 of the DSA backward in fp32 at value widths below one column chunk (the H200 GPU sweep's V16 / V32
    cases: the smallest tuned config compiled to 271,360 B): the one-stage fallback is kept and fits; bf16 at MLA's
    widths keeps the tuned set and no fallback."""
    from moestack.ops.dsa import triton_attn_bwd as B

    monkeypatch.setattr(B, "INTERPRET", False)
    configs = B._dkv_ds_configs()
    fallback = B._dkv_ds_fallback()
    for V, R in ((16, 4), (32, 8)):
        args = {"Q": FP32, "H": 4, "VP": V, "RP": 16, "DKV_OUT": "atomic"}
        kept = B._prune_dkv_ds(configs, args)
        assert kept and all(c in fallback for c in kept)
        assert all(launch.smem_estimate("dsa_dkv", c, args) <= 232448 for c in kept)
    kept = B._prune_dkv_ds(configs, {"Q": BF16, "H": 64, "VP": 512, "RP": 64, "DKV_OUT": "atomic"})
    assert kept and not any(c in fallback for c in kept)
