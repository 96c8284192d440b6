"""Measured part calibration (tune -> Calibration.parts) as the cost model uses it."""

from __future__ import annotations

import pytest

from moestack.config.cluster import load_cluster_spec
from moestack.config.model_spec import load_model_spec
from moestack.config.plan import make_plan
from moestack.planner.calibration import HostCalibration, PartCalibration, load_calibration
from moestack.planner.cost.step import CostModel
from moestack.planner.profile import profile_model
from moestack.tune.parts import local_expert_spec


def _evaluate(cal, devices=1, recompute="none", mbs=1, seq=2048):
    spec = load_model_spec("proxy")
    mode = {"kda": recompute, "attention": recompute, "moe": recompute, "mlp": recompute}
    plan = make_plan(model="proxy", cluster="h200-1gpu", devices=1, seq_len=seq, micro_batch_size=mbs,
                     global_batch_size=mbs, recompute=mode)
    cluster = load_cluster_spec("h200-1gpu").with_devices(devices)
    flops = profile_model(spec, seq).train_flops_per_token
    return CostModel(spec, cluster, cal, seq, flops).evaluate(plan)


def test_measured_parts_add_time_and_replace_activation_bytes():
    # device terms only: at one 2048-token sequence the proxy is host-bound, and the host floor would hide them
    base = load_calibration().model_copy(update={"host": HostCalibration(layer_s=0.0, ep_moe_s=0.0, tp_layer_s=0.0)})
    extra_s, act = 2e-5, 300_000.0
    parts = {k: PartCalibration(tokens=2048, fwd_extra_s_per_token=extra_s, bwd_extra_s_per_token=2 * extra_s,
                                act_bytes_per_token=act) for k in ("kda", "mla", "moe", "dense")}
    cal = base.model_copy(update={"parts": parts})
    plain, measured = _evaluate(base), _evaluate(cal)
    layers = 16  # every layer has one mixer and one ffn part: 2 parts per layer
    expected_extra = 2 * layers * 3 * extra_s * 2048
    assert measured.step_time_s - plain.step_time_s == pytest.approx(expected_extra, rel=1e-6)
    # activations: the measured bytes per token for every part, plus autocast weight copies on one device
    copies = measured.memory["activations"] - 2 * layers * act * 2048
    # bf16 copies of the layers' GEMM weights: 2 bytes for nearly every layer parameter (not norms, convs, router)
    prof = profile_model(load_model_spec("proxy"), 2048)
    spec = load_model_spec("proxy")
    layer_params = prof.total_params - 2 * spec.vocab_size * spec.hidden_size  # minus embedding and LM head
    assert 0.95 < copies / (2 * layer_params) <= 1.0
    # full recompute keeps only part inputs: the measured factors do not apply
    assert _evaluate(cal, recompute="full").memory["activations"] == _evaluate(base, recompute="full").memory[
        "activations"]
    # activations scale with tokens per micro-batch
    two = _evaluate(cal, mbs=2)
    assert two.memory["activations"] - copies == pytest.approx(2 * (measured.memory["activations"] - copies))


def test_selective_keeps_the_analytic_fraction_of_measured_bytes():
    base = load_calibration()
    parts = {"moe": PartCalibration(tokens=2048, fwd_extra_s_per_token=0.0, bwd_extra_s_per_token=0.0,
                                    act_bytes_per_token=1e6)}
    cal = base.model_copy(update={"parts": parts})
    none, sel = _evaluate(cal), _evaluate(cal, recompute="selective")
    assert 0 < sel.memory["activations"] < none.memory["activations"]


def test_local_expert_spec_keeps_rows_per_expert():
    spec = load_model_spec("kimi-k3")
    local = local_expert_spec(spec, 16)
    assert local.moe.num_experts == spec.moe.num_experts // 16
    assert local.moe.top_k == spec.moe.top_k
    # rows per expert under balanced EP routing (T*k*ep/E) equal the local model's T*k/E_local
    T = 8192
    assert T * spec.moe.top_k * 16 / spec.moe.num_experts == T * local.moe.top_k / local.moe.num_experts
    assert local_expert_spec(spec, 1) is spec


def test_measure_parts_runs_every_part_kind_on_cpu():
    from moestack.tune.parts import measure_parts

    spec = load_model_spec("tiny")
    timings = measure_parts(spec, 1, 32, device="cpu", reps=1)
    kinds = {k.mixer for k in spec.layer_kinds()} | {k.ffn for k in spec.layer_kinds()}
    assert set(timings) == kinds - {"none"}
    for t in timings.values():
        assert t.fwd_s > 0 and t.bwd_s > 0 and t.saved_bytes > 0 and t.tokens == 32


def test_fixed_and_per_token_fit():
    from moestack.tune.calibrate import _fixed_and_per_token

    fixed, per = _fixed_and_per_token([(100, 1.0), (50, 0.6)])
    assert fixed == pytest.approx(0.2) and per == pytest.approx(0.008)
    assert _fixed_and_per_token([(100, 1.0), (50, 0.4)]) == (0.0, 0.01)  # negative fixed -> all per token
    assert _fixed_and_per_token([(100, 1.0), (50, 1.2)]) == (1.0, 0.0)  # smaller run slower -> all fixed
    assert _fixed_and_per_token([(100, -1.0)]) == (0.0, 0.0)


def test_single_device_peak_is_one_end_of_backward():
    """One device, one micro-batch: gradients build up while activations are freed, so the peak holds either
    the activations (+ the LM head's gradient) or all gradients, never both in full."""
    base = load_calibration()
    none, full = _evaluate(base), _evaluate(base, recompute="full")
    weights = none.memory["weights"]
    assert none.memory["gradients"] < 0.2 * weights  # only the LM head's gradient at the start of backward
    embedding = 163840 * 1536 * 4  # the proxy's fp32 embedding gradient: produced after the first layer's backward
    assert full.memory["gradients"] == pytest.approx(weights - embedding)  # fp32 grads of fp32 weights at the end
    assert full.memory["activations"] == 0.0
    assert _evaluate(base, devices=1).memory_total <= _evaluate(base, mbs=2).memory_total
