"""Planner inputs the published runs need (issue #29, item 3): each term against its closed form.

Sliding-window attention, GeLU / LayerNorm / learned positions / biases (GPT-2/3), TP without sequence parallelism,
routing imbalance and capacity factors, the FP8 / FP4 recipes, bf16 gradients, quantised parameters, Megatron's
pipeline split and saved-tensor convention, context parallelism in the ZeRO shards, host profiles, and the rule that
the trainer refuses what it cannot run.
"""

from __future__ import annotations

import pytest

from moestack.config.base import ConfigError
from moestack.config.cluster import load_cluster_spec
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import RecomputePolicy, make_plan, runtime_unsupported
from moestack.planner.calibration import load_calibration
from moestack.planner.cost.comm import cp_attention_times, tp_comm_times
from moestack.planner.cost.compute import GEMM_RECIPES, gemm_recipe, gemm_time, moe_time_imbalance, recipe_cast_bytes
from moestack.planner.cost.context import Ctx
from moestack.planner.cost.memory import megatron_saved_delta
from moestack.planner.cost.parts import part_cost
from moestack.planner.cost.pipeline import uniform_chunks
from moestack.planner.cost.step import CostModel
from moestack.planner.cost.work import Gemm, model_work
from moestack.planner.host_profile import HOST_PROFILES
from moestack.planner.profile import load_any_model_spec, profile_model
from moestack.planner.search import Planner, load_problem, parse_fix

GIB = 2**30


def _model(spec, cluster="h200-cluster", devices=8, seq=4096):
    cl = load_cluster_spec(cluster).with_devices(devices)
    return CostModel(spec, cl, load_calibration(), seq, profile_model(spec, seq).train_flops_per_token)


def _plan(name="proxy", cluster="h200-cluster", devices=8, **kw):
    base = dict(model=name, cluster=cluster, devices=devices, seq_len=4096, global_batch_size=64)
    base.update(kw)
    return make_plan(**base)


def _gqa_spec(**kw):
    base = dict(name="g", vocab_size=1000, hidden_size=512, num_layers=4, max_seq_len=4096,
                full_attention_layers=[1, 2, 3, 4], attention="gqa",
                gqa={"num_heads": 8, "num_kv_heads": 2, "head_dim": 64}, dense_mlp={"intermediate_size": 1536},
                activation="swiglu")
    base.update(kw)
    return ModelSpec.model_validate(base)


# -- model features --------------------------------------------------------------------------------------------


def test_sliding_window_attention_flops():
    """Window w: sum_t min(t, w) / s keys per query, in the profile (model FLOPs, Megatron's S/2 convention capped
    as DSA's top-k) and in the cost model's hardware term; the other layers stay causal-dense."""
    s, w = 4096, 128
    spec = _gqa_spec(sliding_window=w, sliding_window_layers=[1, 3])
    kinds = spec.layer_kinds()
    assert [k.window for k in kinds] == [w, None, w, None]
    prof = profile_model(spec, s)
    H, E = 8, 64
    assert prof.layers[0].fwd_attn_flops_per_token == pytest.approx(4 * H * E * (w - w * w / (2 * s)))
    assert prof.layers[1].fwd_attn_flops_per_token == pytest.approx(4 * H * E * s / 2)
    work = model_work(spec, s)
    brute = sum(min(t, w) for t in range(1, s + 1)) / s
    assert work.layers[0].parts[0].attn_flops == pytest.approx(4 * H * E * brute)
    assert work.layers[1].parts[0].attn_flops == pytest.approx(4 * H * E * (s + 1) / 2)
    # under context parallelism a window's keys come from the previous shard only: less traffic than the all-gather
    cm = _model(spec, devices=2, seq=s)
    plan = _plan(name="g", devices=2, cp=2, dp_shard=1, zero_stage=0, global_batch_size=2)
    swa, full = (cp_attention_times(lw.parts[0], Ctx(plan, spec, cm.cluster, cm.cal, s / 2), 0.0, 0.0)
                 for lw in cm.work.layers[:2])
    assert 0 < swa[0] < full[0]
    with pytest.raises(ValueError, match="sliding_window"):
        _gqa_spec(sliding_window_layers=[1])
    assert "sliding-window" in " ".join(spec.build_support_errors())


def test_gpt3_parameters_closed_form():
    """GPT-3 175B with GeLU MLPs, LayerNorms, learned positions and biases: L (12 h^2 + 13 h) + (V + S) h + 2 h
    (Brown et al. 2020; Narayanan et al. 2021, Sec. 5.1 without the biases), in the profile and the cost model."""
    spec = load_any_model_spec("tests/data/planner/gpt3-175b.yaml")
    h, L, V, S = 12288, 96, 51200, 2048
    expected = L * (12 * h * h + 13 * h) + (V + S) * h + 2 * h
    assert profile_model(spec, S).total_params == expected
    assert model_work(spec, S).total_params + 2 * h == expected  # ModelWork leaves the final norm out
    errors = " ".join(spec.build_support_errors())
    assert not spec.gated_mlp and all(w in errors for w in ("gelu", "layernorm", "learned position", "linear_bias"))


def test_published_model_sizes():
    """Totals the publications give: gpt-oss-120b 116.8B / 5.1B active (model card), Qwen3-235B-A22B 235B / 22B,
    Llama 3 70B 70.6B."""
    sizes = {"gpt-oss-120b": (116.8e9, 5.13e9), "qwen3-235b-a22b": (235.1e9, 21.6e9), "llama3-70b": (70.55e9, 69.5e9)}
    for name, (total, active) in sizes.items():
        prof = profile_model(load_any_model_spec(f"tests/data/planner/{name}.yaml"), 4096)
        assert prof.total_params == pytest.approx(total, rel=0.005), name
        assert prof.activated_params == pytest.approx(active, rel=0.01), name


# -- tensor parallelism without sequence parallelism -------------------------------------------------------------


def test_tp_without_sequence_parallelism():
    """Plain TP keeps the norm inputs and outputs whole on every rank (Korthikanti et al. Eq. 2 vs 4): T (1 - 1/tp)
    x 4 h bytes more per part without recompute, the whole layer input under full recompute; all-reduces (2 + 2
    collectives) instead of all-gather / reduce-scatter + re-gather (2 + 3)."""
    spec = load_any_model_spec("tests/data/planner/llama3-70b.yaml")
    cm = _model(spec)
    kw = dict(name="llama3-70b", tp=8, global_batch_size=8)
    sp, nosp = cm.evaluate(_plan(**kw)), cm.evaluate(_plan(sequence_parallel=False, **kw))
    T, h, tp, layers = 4096, 8192, 8, 80
    extra = layers * 2 * T * (2 * h * 2) * (1 - 1 / tp)  # 2 parts per layer, norm input + output, bf16
    assert nosp.forward_activations - sp.forward_activations == pytest.approx(extra, rel=1e-6)
    assert tp_comm_times(_plan(**kw), 1.0, 0.0) == (2.0, 3.0)
    assert tp_comm_times(_plan(sequence_parallel=False, **kw), 1.0, 0.0) == (2.0, 2.0)
    assert nosp.time["tp_comm"] < sp.time["tp_comm"]
    full = RecomputePolicy.uniform("full")
    f_sp = cm.evaluate(_plan(recompute=full, **kw))
    f_nosp = cm.evaluate(_plan(recompute=full, sequence_parallel=False, **kw))
    assert f_nosp.forward_activations == pytest.approx(f_sp.forward_activations * tp, rel=1e-6)
    assert any("sequence_parallel" in r for r in runtime_unsupported(_plan(sequence_parallel=False, **kw)))


# -- MoE routing --------------------------------------------------------------------------------------------------


def test_routing_imbalance_and_capacity_factor():
    """The busiest EP rank's rows scale the expert GEMMs and the all-to-all: forced balance (1.0) is faster than the
    default 1.1; a capacity factor caps the factor (dropped tokens)."""
    spec = load_any_model_spec("proxy")
    plan = _plan(ep=8, dp_shard=8, zero_stage=1)
    assert plan.moe_load_imbalance == 1.1 and moe_time_imbalance(plan, spec) == 1.1
    balanced = plan.model_copy(update={"moe_load_imbalance": 1.0})
    cm = _model(spec)
    moe = next(p for lw in cm.work.layers for p in lw.parts if p.kind == "moe")
    ctx = Ctx(plan, spec, cm.cluster, cm.cal, 4096.0)
    ctx1 = Ctx(balanced, spec, cm.cluster, cm.cal, 4096.0)
    assert part_cost(moe, ctx1).parts["gemm"] < part_cost(moe, ctx).parts["gemm"]
    dropping = spec.model_copy(update={"moe": spec.moe.model_copy(update={"capacity_factor": 1.05})})
    assert moe_time_imbalance(plan.model_copy(update={"moe_load_imbalance": 1.5}), dropping) == 1.05
    assert moe_time_imbalance(balanced, dropping) == 1.0
    a2a_1, a2a_11 = part_cost(moe, ctx1).a2a, part_cost(moe, ctx).a2a
    assert a2a_11 / a2a_1 == pytest.approx(1.1, rel=0.02)  # bandwidth term; the per-call latency does not scale


# -- low-precision recipes ------------------------------------------------------------------------------------------


def test_recipes_peaks_and_casts():
    """NVFP4 GEMMs run at the fp4 peak (2x fp8 on Blackwell), MXFP8 / per-tensor FP8 at the fp8 one; a device
    without the recipe's units prices it in bf16; per-tensor scaling pays an amax read before each cast."""
    gb = load_cluster_spec("gb300-nvl72")
    cal = load_calibration()
    g = Gemm("x", n=8192, k=8192)
    t_mx = gemm_time(g, 8192, 8192, 1, 1, "mxfp8", gb, cal)
    t_fp4 = gemm_time(g, 8192, 8192, 1, 1, "nvfp4", gb, cal)
    t_bf16 = gemm_time(g, 8192, 8192, 1, 1, "bf16", gb, cal)
    assert t_mx / t_fp4 == pytest.approx(15000 / 5000)
    assert t_bf16 / t_mx == pytest.approx(5000 / 2500 * cal.lowp_native_gemm_factor)
    h100 = load_cluster_spec("h100-cluster")
    assert gemm_recipe("nvfp4", h100) is None
    assert gemm_time(g, 8192, 8192, 1, 1, "nvfp4", h100, cal) == gemm_time(g, 8192, 8192, 1, 1, "bf16", h100, cal)
    rows = 1000.0
    f_t, b_t = recipe_cast_bytes(g, rows, 1, 1, GEMM_RECIPES["fp8_tensorwise"], 4)
    f_m, b_m = recipe_cast_bytes(g, rows, 1, 1, GEMM_RECIPES["mxfp8"], 4)
    assert b_t == pytest.approx(rows * 8192 * (4 + 2))  # amax read + read + two 1-byte layouts
    assert b_m == pytest.approx(rows * 8192 * (2 + 2 * (1 + 1 / 32)))
    with pytest.raises(ConfigError, match="fp4"):
        load_problem("proxy", "h100-cluster", precision="nvfp4")


def test_grad_dtype_quantized_params_and_fp8_weights():
    """bf16 gradients halve the gradient buffers and the DP reduction; quantised parameters drop the bf16 copy of the
    recipe's GEMM weights (their GEMM-format copies are the fp8_weights term: two layouts x (1 + 1/32) bytes under
    MXFP8)."""
    spec = load_any_model_spec("proxy")
    cm = _model(spec, "gb200-nvl72", 8)
    kw = dict(cluster="gb200-nvl72", dp_shard=8, zero_stage=1, precision="mxfp8")
    base = cm.evaluate(_plan(**kw))
    half = cm.evaluate(_plan(grad_dtype="bf16", **kw))
    assert half.memory["gradients"] == pytest.approx(base.memory["gradients"] / 2)
    assert half.time.get("dp_comm", 0.0) <= base.time.get("dp_comm", 0.0)
    q = cm.evaluate(_plan(quantized_params=True, **kw))
    plan = _plan(**kw)
    gemm = sum(sum(cm._part_params_local(p, plan)) for lw in cm.work.layers for p in lw.parts)
    assert base.memory["weights"] - q.memory["weights"] == pytest.approx(2 * gemm, rel=0.02)
    assert base.memory["fp8_weights"] == pytest.approx(2 * (1 + 1 / 32) * gemm, rel=0.02)


def test_context_parallel_ranks_shard_zero():
    """FSDP2 (and Megatron's distributed optimizer) shard over dp x cp: cp 2 halves the optimizer state of dp 4."""
    spec = load_any_model_spec("tests/data/planner/llama3-70b.yaml")
    cm = _model(spec)
    a = cm.evaluate(_plan(name="llama3-70b", tp=2, dp_shard=4, zero_stage=1, global_batch_size=8))
    b = cm.evaluate(_plan(name="llama3-70b", tp=2, cp=2, dp_shard=2, zero_stage=1, global_batch_size=8))
    assert b.memory["optimizer"] == pytest.approx(a.memory["optimizer"], rel=1e-6)


# -- Megatron conventions ---------------------------------------------------------------------------------------------


def test_uniform_pipeline_split():
    """Megatron's even split, and with account_for_embedding / loss the first and last chunk one layer short."""
    assert [len(c) for c in uniform_chunks(80, 40, False)] == [2] * 40
    assert [len(c) for c in uniform_chunks(126, 64, True)] == [1] + [2] * 62 + [1]
    assert [len(c) for c in uniform_chunks(10, 4, False)] == [3, 3, 2, 2]
    chunks = uniform_chunks(94, 32, True)
    assert [i for c in chunks for i in c] == list(range(94)) and len(chunks[0]) == len(chunks[-1]) == 2


def test_megatron_saved_tensors():
    """Megatron applies the routing probabilities in the experts (no expert outputs kept for the combine) and, under a
    low-precision recipe, saves every linear layer's input quantised."""
    spec = load_any_model_spec("tests/data/hf_configs/deepseek-v3.config.json")
    cm = _model(spec, "gb200-nvl72", 64)
    moe = next(p for lw in cm.work.layers for p in lw.parts if p.kind == "moe")
    bf16 = _plan(cluster="gb200-nvl72", devices=64, ep=64, dp_shard=64, zero_stage=1, host_profile="megatron")
    assert megatron_saved_delta(moe, "none", bf16, cm.cluster) == pytest.approx(8 * 4 - 8 * 7168 * 2)
    mx = bf16.model_copy(update={"precision": "mxfp8"})
    q = 1 + 1 / 32
    quantised = moe.expert_fp8_saved + moe.expert_act_selective + moe.fc2_in + moe.sp_sel
    want = 8 * 4 - 8 * 7168 * 2 - quantised * (1 - q / 2)
    assert megatron_saved_delta(moe, "none", mx, cm.cluster) == pytest.approx(want)
    eager = cm.evaluate(bf16.model_copy(update={"host_profile": "eager"}))
    assert cm.evaluate(bf16).forward_activations < eager.forward_activations


# -- host profiles ---------------------------------------------------------------------------------------------------


def test_host_profiles():
    """The eager profile is the calibration's host; Megatron's are their own, recorded in the plan; a dropless MoE
    layer under EP adds its sync's idle time to each forward, not under max(device, host)."""
    problem = load_problem("proxy", "h200-cluster", precision="bf16", host_profile="megatron")
    result = Planner(problem).search(parse_fix("tp=1,pp=1,ep=8,zero=1,mbs=1,recompute=none,offload=none"),
                                     require_fit=False)
    plan = result.best.plan
    assert plan.host_profile == "megatron"
    cm = problem.cost
    kinds = cm._kinds
    f, b = cm.sync_times(plan, [{i: 1 for i in range(len(kinds))}], kinds)
    n_moe = sum(1 for k in kinds if k.kind.ffn == "moe")
    assert f == [pytest.approx(n_moe * HOST_PROFILES["megatron"].moe_sync_s)] and b == [0.0]
    eager = cm.evaluate(plan.model_copy(update={"host_profile": "eager"}))
    assert eager.step_time_s != result.best.step_time_s
    with pytest.raises(ConfigError, match="host-profile"):
        load_problem("proxy", "h200-cluster", host_profile="compiled")


def test_trainer_refuses_what_it_cannot_run():
    """Every planner-only input is named by runtime_unsupported (the trainer raises it as one line)."""
    plan = _plan(name="proxy", tp=2, dp_shard=4, zero_stage=1, precision="nvfp4", sequence_parallel=False,
                 grad_dtype="bf16", quantized_params=True, fp8_activation_input=True, tp_comm_overlap=True,
                 host_profile="megatron-graphs", pp=1)
    reasons = " ".join(runtime_unsupported(plan))
    for word in ("nvfp4", "sequence_parallel", "grad_dtype", "quantized_params", "fp8_activation_input",
                 "tp_comm_overlap", "host_profile"):
        assert word in reasons
    assert runtime_unsupported(_plan(name="proxy", devices=1)) == []
