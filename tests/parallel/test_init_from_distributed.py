"""--init-from under a plan: 2 gloo ranks as EP2 x ZeRO-3 (FSDP2), as PP2 and as TP2 x EP2 built on the meta device
(meta_init on: drawn shard by shard, then loaded) start from a moestack checkpoint and from an HF directory with
exactly the weights the single process starts from (gathered full state dict, bitwise), and the first steps' losses
match the single-process run of the same global batches. Everything in float64 (precision fp64; the HF export too):
the layouts then differ from the single process by summation order only, and the losses must agree to
RTOL = 1e-10."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moestack.config.base import ConfigError, dump_yaml
from moestack.config.plan import make_plan, save_plan
from moestack.config.train_spec import load_train_spec
from moestack.train.convert import export_hf
from moestack.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec  # noqa: E402

SEQ, GLOBAL_BATCH, MICRO_STEPS, STEPS = 16, 8, 2, 2
OPTS = {"seq_len": SEQ, "logging.every": 1, "logging.tensorboard": False, "logging.progress": False,
        "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1, "optimizer.lr": 3e-3,
        "checkpoint.every": 0, "checkpoint.save_final": False, "device": "cpu", "precision": "fp64"}
RTOL = 1e-10


def _model():
    return small_model_spec().model_copy(update={"family": "kimi_k3"})


def _worker(rank: int, world: int, model_path: str, plans: dict[str, str], sources: dict[str, str], out: str):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from moestack.config.base import read_yaml
    from moestack.config.model_spec import ModelSpec
    from moestack.config.plan import load_plan

    spec_m = ModelSpec.model_validate(read_yaml(model_path))
    res = {}
    for layout, plan_path in plans.items():
        for kind, src in sources.items():
            meta = {"meta_init": "on"} if layout.endswith("_meta") else {}  # built on meta, drawn, then loaded
            spec = load_train_spec(None, {**OPTS, "out_dir": f"{out}/{layout}_{kind}", "steps": STEPS,
                                          "init_from": src, **meta})
            if meta and kind == "hf":  # a sharded build loads moestack checkpoints only (init_from.py)
                with pytest.raises(ConfigError, match="moestack convert"):
                    Trainer(spec, spec_m, log=lambda *a: None, plan=load_plan(plan_path))
                continue
            trainer = Trainer(spec, spec_m, log=lambda *a: None, plan=load_plan(plan_path))
            sd = {}
            if trainer.pipeline is None:  # the whole model, gathered from the shards
                sd = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
                sd = {k: v.clone() for k, v in sd.items()} if rank == 0 else {}  # before training moves them
            losses = trainer.fit()["losses"]
            res[(layout, kind)] = {"sd": sd, "losses": losses}
    return res


@pytest.mark.slow
def test_init_from_under_fsdp_ep_and_pp(tmp_path):
    spec_m = _model()
    model_path = tmp_path / "model.yaml"
    dump_yaml(spec_m, model_path)
    single = {"micro_batch_size": GLOBAL_BATCH // MICRO_STEPS, "grad_accum_steps": MICRO_STEPS}
    src = Trainer(load_train_spec(None, {**OPTS, **single, "out_dir": str(tmp_path / "src"), "steps": 2,
                                         "checkpoint.save_final": True}), spec_m, log=lambda *a: None)
    src.fit()
    weights = {k: v.detach().clone() for k, v in src.model.state_dict().items()}
    assert all(v.dtype == torch.float64 for v in weights.values() if v.is_floating_point())
    export_hf(weights, spec_m, tmp_path / "hf", dtype=torch.float64)  # fp64: the same weights exactly
    sources = {"ckpt": str(tmp_path / "src"), "hf": str(tmp_path / "hf")}
    ref = {}
    for kind, path in sources.items():
        tr = Trainer(load_train_spec(None, {**OPTS, **single, "out_dir": str(tmp_path / f"ref_{kind}"),
                                            "steps": STEPS, "init_from": path}), spec_m, log=lambda *a: None)
        for k, v in tr.model.state_dict().items():
            assert torch.equal(v, weights[k]), (kind, k)
        ref[kind] = tr.fit()["losses"]
    assert ref["ckpt"] == ref["hf"]
    plans = {}
    for name, layout in {"fsdp_ep2": dict(dp_shard=2, zero_stage=3, ep=2),
                         "pp2": dict(pp=2, vpp=1, schedule="1f1b"),
                         "tp2_ep2_meta": dict(tp=2, ep=2)}.items():
        mbs = GLOBAL_BATCH // (MICRO_STEPS * (2 if name == "fsdp_ep2" else 1))
        plan = make_plan(model=str(model_path), cluster="cpu", devices=2, seq_len=SEQ,
                         global_batch_size=GLOBAL_BATCH, micro_batch_size=mbs, **layout)
        save_plan(plan, tmp_path / f"{name}.yaml")
        plans[name] = str(tmp_path / f"{name}.yaml")
    results = run_ranks(__file__, "_worker", world_size=2, timeout=300, model_path=str(model_path), plans=plans,
                        sources=sources, out=str(tmp_path / "runs"))
    for (layout, kind), res in results[0].items():
        for k, v in res["sd"].items():
            assert torch.equal(v, weights[k]), (layout, kind, k)
        assert layout == "pp2" or res["sd"].keys() == weights.keys()
        for rank_res in results:
            got = rank_res[(layout, kind)]["losses"]
            for a, b in zip(got, ref[kind], strict=True):
                assert abs(a - b) < RTOL * abs(b), (layout, kind, got, ref[kind])
