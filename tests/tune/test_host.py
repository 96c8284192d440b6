"""Host-floor measurement (tune/host.py) and its path into the calibration (`moestack tune`)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from moestack.config.cluster import load_cluster_spec
from moestack.config.model_spec import load_model_spec
from moestack.config.plan import make_plan
from moestack.planner.calibration import HostCalibration, load_calibration, save_calibration
from moestack.planner.cost.step import CostModel
from moestack.planner.profile import profile_model
from moestack.tune import host as mh
from moestack.tune.calibrate import calibrate_host
from moestack.tune.host import HostTiming, measure_host, sampled_spec


def _with_mtp(name: str):
    # one MTP block: the cost model charges layer_s for it, the trainer does not run it (priced != trained layers)
    return load_model_spec(name).model_copy(update={"mtp_layers": 1})


def _host_seconds_per_micro_batch(spec, cal, seq=2048, host_profile="eager") -> float:
    """What the cost model's host floor charges one micro-batch's forward + backward on one device (pp=tp=ep=1)."""
    plan = make_plan(model=spec.name, cluster="h200-1gpu", devices=1, seq_len=seq, micro_batch_size=1,
                     global_batch_size=1, host_profile=host_profile)
    cm = CostModel(spec, load_cluster_spec("h200-1gpu").with_devices(1), cal, seq,
                   profile_model(spec, seq).train_flops_per_token)
    _, kind_layer, i_kind = cm.kind_costs(plan)
    host_f, host_b = cm.host_times(plan, [dict(Counter(i_kind))], kind_layer)
    return host_f[0] + host_b[0]


def test_measure_host_runs_the_whole_model_on_cpu():
    spec = _with_mtp("tiny")
    t = measure_host(spec, seq_len=16, device="cpu", warmup=0, reps=1)
    assert t.wall_s > 0 and t.wall_2x_s > 0 and t.tail_s >= 0
    assert (t.tokens, t.reps) == (16, 1)
    assert (t.layers_built, t.layers_trained, t.layers_priced) == (4, 4, 5)
    assert t.layer_s == pytest.approx(t.wall_s / 5)


@pytest.mark.parametrize("built", [16, 5])
def test_measured_layer_s_reproduces_the_measured_pass_in_the_cost_model(built):
    # the quantity divided must be what the cost model multiplies by: with layer_s from a measurement, the planner's
    # host time of one micro-batch is the measured wall time (scaled to the whole model when only `built` blocks ran)
    spec = _with_mtp("proxy")
    wall = 0.2
    t = HostTiming(wall_s=wall, wall_2x_s=wall, tail_s=0.0, tokens=256, reps=7, layers_built=built,
                   layers_trained=spec.num_layers, layers_priced=spec.num_layers + 1)
    cal = load_calibration()
    cal = cal.model_copy(update={"host": cal.host.model_copy(update={"layer_s": t.layer_s})})
    assert _host_seconds_per_micro_batch(spec, cal) == pytest.approx(wall * spec.num_layers / built, rel=1e-9)


def test_sampled_spec_keeps_the_layer_kinds():
    spec = load_model_spec("proxy")  # 16 layers: kda/dense x1, kda/moe x11, mla/moe x4
    small = sampled_spec(spec, 5)
    kinds = Counter((k.mixer, k.ffn) for k in small.layer_kinds())
    assert kinds == {("kda", "dense"): 1, ("kda", "moe"): 3, ("mla", "moe"): 1}
    assert sampled_spec(spec, 16) is spec


def test_calibrate_host_keeps_the_default_on_cpu_and_on_failure(monkeypatch):
    base = HostCalibration()
    host, line = calibrate_host(load_model_spec("tiny"), base, device="cpu")
    assert host == base and "not measured" in line and "default" in line

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(mh, "measure_host", fail)
    host, line = calibrate_host(load_model_spec("tiny"), base, device="cuda")
    assert host == base and "failed" in line and "OutOfMemoryError" in line


def test_calibrate_host_writes_layer_s_and_source_into_the_calibration(monkeypatch, tmp_path):
    t = HostTiming(wall_s=0.24, wall_2x_s=0.25, tail_s=0.001, tokens=256, reps=7, layers_built=4,
                   layers_trained=4, layers_priced=4)
    monkeypatch.setattr(mh, "measure_host", lambda spec, ep=1, device="cuda", precision="bf16": t)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    base = load_calibration()
    host, line = calibrate_host(load_model_spec("tiny"), base.host, device="cuda")
    assert host.layer_s == pytest.approx(0.06)
    assert (host.ep_moe_s, host.tp_layer_s) == (base.host.ep_moe_s, base.host.tp_layer_s)
    assert "Fake GPU" in host.source and "median of 7 fwd+bwd at 256 tokens" in host.source
    assert "host-bound" in host.source and "60.00 ms" in line
    path = tmp_path / "cal.json"
    save_calibration(base.model_copy(update={"host": host}), path)
    assert load_calibration(path).host == host
    # a wall time that grows with the tokens is flagged as an upper bound
    t.wall_2x_s = 0.36
    host, line = calibrate_host(load_model_spec("tiny"), base.host, device="cuda")
    assert "upper bound" in host.source and "upper bound" in line


def test_calibrate_host_measures_the_fp8_recipe_where_it_runs(monkeypatch):
    """Where FP8 runs, the same pass on the FP8 recipe: fp8_layer_s = its layer_s minus the bf16 one (>= 0)."""
    import moestack.ops.fp8 as fp8_ops

    timings = {prec: HostTiming(wall_s=wall, wall_2x_s=wall, tail_s=0.0, tokens=256, reps=7, layers_built=4,
                                layers_trained=4, layers_priced=4) for prec, wall in (("bf16", 0.24), ("fp8", 0.36))}
    asked = []

    def fake(spec, ep=1, device="cuda", precision="bf16"):
        asked.append(precision)
        return timings[precision]

    monkeypatch.setattr(mh, "measure_host", fake)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(fp8_ops, "fp8_unavailable_reason", lambda device=None: None)
    host, line = calibrate_host(load_model_spec("tiny"), HostCalibration(), device="cuda")
    assert asked == ["bf16", "fp8"]
    assert host.layer_s == pytest.approx(0.06) and host.fp8_layer_s == pytest.approx(0.03)
    assert "FP8 recipe +30.00 ms per layer" in line and "fp8 recipe 0.3600 s" in host.source
    timings["fp8"].wall_s = timings["fp8"].wall_2x_s = 0.2  # faster than bf16: no negative extra
    assert calibrate_host(load_model_spec("tiny"), HostCalibration(), device="cuda")[0].fp8_layer_s == 0.0
    timings["fp8"].wall_2x_s = 0.3  # device time leaks in (a wide model): the difference is not the host's
    host, line = calibrate_host(load_model_spec("tiny"), HostCalibration(), device="cuda")
    assert host.fp8_layer_s == HostCalibration().fp8_layer_s and "not host-bound" in line
    monkeypatch.setattr(fp8_ops, "fp8_unavailable_reason", lambda device=None: "sm_80 has no FP8")
    asked.clear()
    host, line = calibrate_host(load_model_spec("tiny"), HostCalibration(), device="cuda")
    assert asked == ["bf16"] and host.fp8_layer_s == HostCalibration().fp8_layer_s and "sm_80 has no FP8" in line


def test_calibration_files_without_host_source_still_load(tmp_path):
    data = load_calibration().model_dump(mode="json")
    del data["host"]["source"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_calibration(path).host.source == ""
    del data["host"]
    path.write_text(json.dumps(data))
    assert load_calibration(path).host == HostCalibration()


# -- compiled blocks (host profile "blocks") -------------------------------------------------------------------------


def test_measure_host_times_the_compiled_blocks(monkeypatch):
    """compile: the blocks are compiled before the warm-up (every block's forward runs through dynamo), and a mode
    that cannot run here is refused with the reason instead of timing the fallback."""
    from moestack.config.train_spec import CompileSpec
    from moestack.parallel import compile as pc

    applied = []
    real_apply = pc.CompiledBlocks.apply

    def spy(self, model):
        out = real_apply(self, model)
        applied.append(self.report.blocks)
        return out

    monkeypatch.setattr(pc.CompiledBlocks, "apply", spy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t = measure_host(load_model_spec("tiny"), seq_len=16, device="cpu", warmup=1, reps=1,
                     compile=CompileSpec(mode="blocks", backend="aot_eager"))
    assert applied == [4] and t.wall_s > 0 and t.layers_built == 4
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        measure_host(load_model_spec("tiny"), seq_len=16, device="cpu", warmup=0, reps=1,
                     compile=CompileSpec(mode="blocks+graphs"))
    torch._dynamo.reset()


def test_calibrate_host_modes_measures_compiled_blocks(monkeypatch):
    from moestack.tune.calibrate import calibrate_host_modes

    eager = HostCalibration(layer_s=0.05, ep_moe_s=0.007, tp_layer_s=0.009, fp8_layer_s=0.008, source="measured")
    asked = []

    def fake(spec, ep=1, device="cuda", precision="bf16", compile=None):
        asked.append(compile.mode)
        return HostTiming(wall_s=0.08, wall_2x_s=0.082, tail_s=0.0, tokens=256, reps=7, layers_built=4,
                          layers_trained=4, layers_priced=4)

    monkeypatch.setattr(mh, "measure_host", fake)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    modes, line = calibrate_host_modes(load_model_spec("tiny"), eager, device="cuda")
    assert asked == ["blocks"] and set(modes) == {"blocks"}
    blocks = modes["blocks"]
    assert blocks.layer_s == pytest.approx(0.02) and "20.00 ms" in line and "host-bound" in line
    assert (blocks.ep_moe_s, blocks.tp_layer_s, blocks.fp8_layer_s) == (0.007, 0.009, 0.008)
    assert "compile blocks" in blocks.source and "Fake GPU" in blocks.source
    assert calibrate_host_modes(load_model_spec("tiny"), eager, device="cpu")[0] == {}

    def fail(*args, **kwargs):
        raise ValueError("compile blocks cannot run here: no C++ compiler")

    monkeypatch.setattr(mh, "measure_host", fail)
    modes, line = calibrate_host_modes(load_model_spec("tiny"), eager, device="cuda")
    assert modes == {} and "no C++ compiler" in line


def test_the_blocks_host_profile_prices_the_measured_compiled_host(tmp_path):
    """A plan on host profile "blocks" is charged host_modes["blocks"]; without a measurement the problem is refused
    with the command that measures it, before any search."""
    from moestack.config.base import ConfigError
    from moestack.planner.search import load_problem

    spec = load_model_spec("proxy")
    cal = load_calibration()
    assert "blocks" not in cal.host_modes  # no default: only a measurement may claim a compiled host time
    with pytest.raises(ConfigError, match="moestack tune --measure-host"):
        load_problem("proxy", "h200-cluster", host_profile="blocks")
    fast = cal.host.model_copy(update={"layer_s": cal.host.layer_s / 4})
    measured = cal.model_copy(update={"host_modes": {"blocks": fast}})
    path = tmp_path / "cal.json"
    save_calibration(measured, path)
    assert load_problem("proxy", "h200-cluster", calibration=path, host_profile="blocks").host_profile == "blocks"
    eager_s = _host_seconds_per_micro_batch(spec, measured)
    blocks_s = _host_seconds_per_micro_batch(spec, measured, host_profile="blocks")
    assert blocks_s == pytest.approx(eager_s / 4, rel=1e-9)


def test_a_plan_priced_for_compiled_blocks_compiles_them():
    from moestack.config.base import ConfigError
    from moestack.config.plan import runtime_unsupported
    from moestack.config.train_spec import TrainSpec, load_train_spec
    from moestack.train.trainer import apply_plan_to_spec

    plan = make_plan(model="tiny", cluster="h200-1gpu", devices=1, seq_len=64, micro_batch_size=1,
                     global_batch_size=1, host_profile="blocks")
    assert runtime_unsupported(plan) == []
    assert apply_plan_to_spec(TrainSpec(), plan).compile.mode == "blocks"
    assert apply_plan_to_spec(TrainSpec(), plan.model_copy(update={"host_profile": "eager"})).compile.mode == "none"
    graphs = load_train_spec(None, {"compile.mode": "blocks+graphs"})  # asked for more: kept (it falls back itself)
    assert apply_plan_to_spec(graphs, plan).compile.mode == "blocks+graphs"
    with pytest.raises(ConfigError, match="host_profile blocks"):
        apply_plan_to_spec(load_train_spec(None, {"compile.mode": "none"}), plan)
