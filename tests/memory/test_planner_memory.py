"""The planner's memory terms for each memory technique (moestack/planner/cost/), on the proxy on one H200 at a
long sequence: each technique moves the term it should, by the amount the implementation in moestack.memory /
moestack.train.optimizers implies. Measured factors come from benchmarks/memory.py on the GPU ("fit x")."""

from __future__ import annotations

from pathlib import Path

import pytest

from moestack.config.cluster import GIB
from moestack.config.model_spec import load_model_spec
from moestack.memory.report import predicted_memory
from moestack.planner.adapt import LOSS_BYTES_PER_LOGIT, LOSS_CHUNK_TOKENS
from moestack.planner.calibration import load_calibration

ROOT = Path(__file__).resolve().parents[2]
SEQ = 16384


@pytest.fixture(scope="module", params=["built-in", "tuned"])
def predicted(request, bench):
    """technique -> the planner's breakdown (bytes) for the proxy at SEQ, under either calibration (the tuned one
    has measured saved bytes per part, which take another code path)."""
    cal = load_calibration(None if request.param == "built-in" else ROOT / "benchmarks" / "calibration-proxy-h200.json")
    base = load_model_spec("proxy")
    spec = bench.variant_spec(base, SEQ, None)
    out = {}
    for name, fields in bench.TECHNIQUES.items():
        plan = bench.make_plan("proxy", SEQ, 1, fields, "h200-1gpu")
        out[name] = predicted_memory(spec, plan, cal)
    return out


def _alloc(mem: dict) -> float:
    return sum(mem.values()) - mem["reserved"]


def _params():
    spec = load_model_spec("proxy")
    from moestack.planner.profile import profile_model

    prof = profile_model(spec, 2)
    m = spec.moe
    expert = m.num_experts * 3 * m.expert_intermediate_size * m.latent_size
    expert *= sum(1 for k in spec.layer_kinds() if k.ffn == "moe")
    return spec, prof.total_params, expert


def test_every_technique_saves_and_all_combined_saves_most(predicted):
    base = _alloc(predicted["baseline"])
    for name, mem in predicted.items():
        if name != "baseline":
            assert _alloc(mem) < base, name
    combined = _alloc(predicted["all combined"])
    assert all(combined <= _alloc(m) for m in predicted.values())
    full, sel = predicted["recompute full"], predicted["recompute selective"]
    assert full["activations"] < sel["activations"] < predicted["baseline"]["activations"]


def test_optimizer_terms(predicted):
    spec, total, _ = _params()
    base, bf16, muon = predicted["baseline"], predicted["adamw bf16 states"], predicted["muon"]
    assert base["optimizer"] == pytest.approx(8 * total, rel=1e-6)
    assert bf16["optimizer"] == pytest.approx(4 * total, rel=1e-6)
    # Muon: momentum (4 B) on matrices, AdamW (8 B) on the embedding and the untied LM head
    vocab = spec.vocab_size * spec.hidden_size
    assert muon["optimizer"] == pytest.approx(4 * total + 2 * 4 * vocab, rel=1e-6)
    off = predicted["optimizer offload"]
    assert off["optimizer"] == 0
    assert off["weights"] == base["weights"]  # one device: CPUOffloadAdamW leaves the fp32 parameters in place


def test_expert_offload_moves_expert_state_and_copies_off_the_device(predicted):
    _, total, expert = _params()
    base, off = predicted["baseline"], predicted["expert offload"]
    assert off["weights"] == pytest.approx(4 * (total - expert), rel=1e-5)
    assert off["optimizer"] == pytest.approx(8 * (total - expert), rel=1e-5)
    # no autocast bf16 copies of the experts are kept (the seam casts inside its Function): 2 B per expert param
    assert base["activations"] - off["activations"] == pytest.approx(2 * expert, rel=1e-3)
    # per-layer device buffers for the fetched experts: a few GiB at most, and a transient of a MoE layer's
    # backward (one device: the max with the loss phase, not a sum: cost/step.py `_one_end_of_backward`)
    assert 0 <= off["buffers"] - base["buffers"] < 4 * GIB


def test_activation_offload_keeps_layers_in_flight_and_weight_copies(predicted):
    base, off = predicted["baseline"], predicted["activation offload"]
    layers = load_model_spec("proxy").num_layers
    assert off["activations"] < base["activations"] / 2
    # more than the 3 layers in flight alone: the autocast weight copies stay on the device
    assert off["activations"] > 3 * (base["activations"] / layers) * 0.5


def test_fp8_saved_inputs_shrink_activations_under_either_calibration(predicted):
    base, fp8 = predicted["baseline"], predicted["fp8 saved expert inputs"]
    spec = load_model_spec("proxy")
    m = spec.moe
    moe_layers = sum(1 for k in spec.layer_kinds() if k.ffn == "moe")
    # expert GEMM inputs (dispatched latent + activation output, top-k copies) in 1 byte instead of 2, plus the
    # expert autocast copies the seam does not keep
    expected = SEQ * m.top_k * (m.latent_size + m.expert_intermediate_size) * moe_layers
    expected += 2 * m.num_experts * 3 * m.expert_intermediate_size * m.latent_size * moe_layers
    saved = base["activations"] - fp8["activations"]
    assert saved == pytest.approx(expected, rel=0.1)


def test_loss_buffer_is_one_chunk(bench):
    """The chunked loss holds one chunk of logits: the logits buffer stops growing past LOSS_CHUNK_TOKENS."""
    base = load_model_spec("proxy")
    bufs = []
    for seq in (LOSS_CHUNK_TOKENS, 4 * LOSS_CHUNK_TOKENS):
        spec = bench.variant_spec(base, seq, None)
        plan = bench.make_plan("proxy", seq, 1, {"recompute": "selective"}, "h200-1gpu")
        bufs.append(predicted_memory(spec, plan)["buffers"])
    logits = LOSS_CHUNK_TOKENS * base.vocab_size * LOSS_BYTES_PER_LOGIT
    assert bufs[0] >= logits and bufs[1] >= logits
    assert bufs[1] - bufs[0] < 0.5 * logits  # what grows is the MoE dispatch buffers, not the logits


def test_act_factors_scale_their_technique_only(bench):
    """Calibration.act_factors (fed back from benchmarks/memory.py) multiply the activation term of their technique
    and leave the others alone; PlanCost.forward_activations is what forward leaves (the report's term)."""
    from moestack.memory.report import planner_cost

    base_cal = load_calibration(ROOT / "benchmarks" / "calibration-proxy-h200.json").model_copy(
        update={"act_factors": {}})  # the committed file carries measured factors: start from none
    scaled = base_cal.model_copy(update={"act_factors": {"selective": 0.5, "full": 2.0, "activation_offload": 0.25,
                                                         "fp8": 0.75}})
    spec = bench.variant_spec(load_model_spec("proxy"), SEQ, None)

    def fwd_act(name, cal):
        plan = bench.make_plan("proxy", SEQ, 1, bench.TECHNIQUES[name], "h200-1gpu")
        return planner_cost(spec, plan, cal).forward_activations

    for name, f in (("recompute selective", 0.5), ("fp8 saved expert inputs", 0.75)):
        assert fwd_act(name, scaled) == pytest.approx(f * fwd_act(name, base_cal), rel=1e-3), name
    assert fwd_act("baseline", scaled) == fwd_act("baseline", base_cal)
    assert fwd_act("recompute full", scaled) == pytest.approx(2 * fwd_act("recompute full", base_cal), rel=1e-3)
    off, off_scaled = fwd_act("activation offload", base_cal), fwd_act("activation offload", scaled)
    assert off_scaled < off
    # rows -> suggested factors: measured / planner activations times the factor already in the calibration
    rows = [{"technique": "recompute selective", "report": {"measured_gib": {"activations": 30.0},
                                                            "device_total_gib": 80.0},
             "predicted": {"forward_activations_gib": 20.0}},
            {"technique": "muon", "report": {"measured_gib": {"activations": 1.0}, "device_total_gib": 80.0},
             "predicted": {"forward_activations_gib": 2.0}}]
    assert bench.suggested_act_factors(rows, scaled) == {"selective": 0.75}
    assert bench.suggested_act_factors(rows, base_cal) == {"selective": 1.5}


def test_memory_lower_bound_stays_below_the_evaluated_peak(bench):
    """The search prunes on memory_lower_bound: it must not exceed what evaluate says, for every technique."""
    from moestack.config.cluster import load_cluster_spec
    from moestack.planner.cost.step import CostModel
    from moestack.planner.profile import profile_model

    for seq in (4096, SEQ):
        spec = bench.variant_spec(load_model_spec("proxy"), seq, None)
        prof = profile_model(spec, seq)
        cm = CostModel(spec, load_cluster_spec("h200-1gpu"), load_calibration(), seq, prof.train_flops_per_token)
        for name, fields in bench.TECHNIQUES.items():
            plan = bench.make_plan("proxy", seq, 1, fields, "h200-1gpu")
            hbm, host = cm.memory_lower_bound(plan)
            cost = cm.evaluate(plan)
            assert hbm <= cost.memory_total * (1 + 1e-9), (seq, name, hbm / GIB, cost.memory_total / GIB)
            assert host <= cost.host_bytes * (1 + 1e-9) or host == 0, (seq, name)
