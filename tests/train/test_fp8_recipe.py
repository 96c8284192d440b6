"""precision fp8 (moestack/ops/fp8/convert.py): which layers the recipe puts in FP8, how a plan turns it on, the
one-line errors where it cannot run, and a short training run on it (CPU: the FP8 kernels in the Triton interpreter)
that tracks the bf16 run. The FP8 numerics themselves are tests/ops/test_fp8*.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moestack.config import load_model_spec
from moestack.config.base import ConfigError
from moestack.config.plan import make_plan
from moestack.config.train_spec import TrainSpec
from moestack.model.transformer import build_model
from moestack.ops.fp8.convert import FP8_LINEARS, apply_fp8_recipe, convert_precision
from moestack.train.trainer import Trainer, apply_plan_to_spec

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _dist import small_model_spec  # noqa: E402

BF16_LINEARS = {"lm_head", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "wq", "wk", "weights_proj"}


def _fp8_names(model):
    return {n for n, m in model.named_modules() if type(m).__name__ == "Fp8Linear"}


def test_recipe_layers(monkeypatch):
    """Experts on the FP8 GEMM strategy; exactly the projections the cost model prices in FP8 become Fp8Linear, every
    other Linear (head, indexer, KDA beta and low-rank gates) stays; the memory policy adds no second FP8 copy of
    the expert inputs."""
    from moestack.memory import apply_memory_policies

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = load_model_spec("tiny").model_dump()
    spec["kda"].update(gate_rank=16)  # low-rank KDA gates (f_a / f_b), which stay bf16
    model = build_model(type(load_model_spec("tiny")).model_validate(spec), "cpu", seed=0)
    report = apply_fp8_recipe(model, torch.device("cpu"))
    moes = model.moe_layers()
    assert report.moe_layers == len(moes) > 0 and all(
        type(m.experts.gemm).__name__ == "Fp8GroupedGemm" for m in moes.values())
    converted = _fp8_names(model)
    assert converted == set(report.linears) and not report.kept_bf16
    kinds = {type(model.get_submodule(n.rsplit(".", 1)[0])).__name__ for n in converted}
    assert kinds == {"KDAAttention", "GatedMLA", "GLUMLP", "MoE"}, kinds
    for name in converted:
        parent, attr = name.rsplit(".", 1)
        assert attr in FP8_LINEARS[type(model.get_submodule(parent)).__name__]
    rest = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is nn.Linear}
    assert "f_a_proj" in rest and "lm_head" in rest and rest <= BF16_LINEARS, rest
    assert "Linear layers in FP8" in report.summary()
    plan = make_plan(model="tiny", cluster="cpu", devices=1, seq_len=64, global_batch_size=2, micro_batch_size=2,
                     precision="fp8")
    apply_memory_policies(model, plan, "cpu")
    assert all(not hasattr(m.experts, "_moestack_seam") for m in moes.values())


def test_recipe_errors_and_plan(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = build_model(load_model_spec("tiny"), "cpu", seed=0)
    with pytest.raises(ConfigError, match="precision: fp8 cannot run here: the device is cpu.*use precision bf16"):
        apply_fp8_recipe(model, torch.device("cpu"))
    assert not _fp8_names(model)
    assert convert_precision(model, "bf16", torch.device("cpu")) is None and not _fp8_names(model)
    plan = make_plan(model="tiny", cluster="cpu", devices=1, seq_len=64, global_batch_size=2, micro_batch_size=2,
                     precision="fp8")
    assert apply_plan_to_spec(TrainSpec(), plan).precision == "fp8"
    assert apply_plan_to_spec(TrainSpec(), plan.model_copy(update={"precision": "bf16"})).precision == "auto"
    with pytest.raises(ConfigError, match="the plan says fp8 but the train spec says fp32"):
        apply_plan_to_spec(TrainSpec(precision="fp32"), plan)


def test_fp8_training_tracks_bf16(tmp_path, monkeypatch):
    """Two optimizer steps of a two-layer model (KDA + dense MLP, KDA + LatentMoE) on the FP8 recipe (interpreter)
    against the same run in bf16: losses within a few percent of bf16's, and the FP8 layers trained."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model_spec = small_model_spec().model_dump()
    model_spec.update(num_layers=2, full_attention_layers=[], dense_layers=[1])
    model_spec = type(small_model_spec()).model_validate(model_spec)
    losses = {}
    for precision in ("bf16", "fp8"):
        spec = TrainSpec(model="tiny", out_dir=str(tmp_path / precision), steps=2, micro_batch_size=2, seq_len=8,
                         eval_every=0, precision=precision, device="cpu",
                         logging={"progress": False, "tensorboard": False},
                         checkpoint={"every": 0})
        trainer = Trainer(spec, model_spec, log=lambda *a, **k: None)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        losses[precision] = [trainer.train_step().loss for _ in range(2)]
        if precision == "fp8":
            fp8 = _fp8_names(trainer.model)
            assert fp8 and trainer.model.moe_layers()
            for name in fp8:
                assert not torch.equal(before[f"{name}.weight"], trainer.model.get_submodule(name).weight)
        trainer.close()
    for a, b in zip(losses["fp8"], losses["bf16"]):
        assert abs(a - b) < 0.03 * abs(b), losses
    assert losses["fp8"] != losses["bf16"]  # the FP8 GEMMs did run
