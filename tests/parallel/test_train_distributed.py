"""The distributed trainer end to end: `torchrun -m moestack train --plan` on 2 gloo ranks (EP2 x ZeRO-3, two
micro-batches per step) reproduces the single-process run of the same global batches (loss and clip norm per
step), and its mid-run checkpoint resumes at other layouts -- one process without a plan (EP1); 4 ranks as EP4 with
hierarchical dispatch x ZeRO-2; 4 ranks as PP2 (interleaved 1F1B, 2 chunks per rank) x EP2 x ZeRO-3 -- with the
following losses of the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moestack.config.base import dump_yaml
from moestack.config.plan import make_plan, save_plan
from moestack.config.train_spec import load_train_spec
from moestack.train.trainer import Trainer, adapt_sampler_state

sys.path.insert(0, str(Path(__file__).parent))
from _dist import _REPO, run_ranks, small_model_spec  # noqa: E402

SEQ, GLOBAL_BATCH, MICRO_STEPS, STEPS, SAVED_AT = 16, 8, 2, 4, 2
OPTIONS = {"seq_len": SEQ, "logging.every": 1, "logging.tensorboard": False, "logging.progress": False,
           "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1, "optimizer.lr": 3e-3,
           "optimizer.grad_clip": 0.5, "checkpoint.every": SAVED_AT, "precision": "fp64"}
RTOL = 1e-10  # float64: the layouts differ from the single process by summation order only (measured <= 1.8e-15)


def _plan(devices: int, model_path: Path, **layout):
    return make_plan(model=str(model_path), cluster="cpu", devices=devices, seq_len=SEQ,
                     global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH // (MICRO_STEPS * devices),
                     **layout)


def _metrics(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/loss" in r}


def _resume_worker(rank: int, world: int, runs: dict[str, tuple[str, str]], model_path: str) -> dict:
    """Resume each (run dir, plan) in turn on these ranks; per layout the following losses and the router biases
    of the MoE layers this rank holds (name -> bias)."""
    from moestack.config.base import read_yaml
    from moestack.config.model_spec import ModelSpec
    from moestack.config.plan import load_plan

    out = {}
    for name, (run, plan_path) in runs.items():
        spec = load_train_spec(None, {**OPTIONS, "out_dir": run, "steps": STEPS})
        trainer = Trainer(spec, ModelSpec.model_validate(read_yaml(model_path)), log=lambda *a: None,
                          plan=load_plan(plan_path))
        assert trainer.resume() and trainer.step == SAVED_AT
        assert (trainer.pipeline is not None) == (trainer.plan.pp > 1)
        losses = trainer.fit()["losses"]
        biases = {k: m.router.selection_bias.clone() for k, m in trainer.model.moe_layers().items()}
        out[name] = {"losses": losses, "biases": biases}
    return out


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """The single-process reference run and the 2-rank torchrun EP2 run of the same global batches."""
    tmp = tmp_path_factory.mktemp("train_distributed")
    model_spec = small_model_spec()
    # batch-scope quantile balancing (the default) solves a bias per micro-batch, and the PP layout splits a step into
    # twice the reference's micro-batches: the layouts compare at step scope, whose bias depends on the step's tokens
    # only (batch scope across layouts at equal micro-batches: test_balance_dist.py, test_tensor.py)
    router = model_spec.moe.router.model_copy(update={"quantile_scope": "step"})
    model_spec = model_spec.model_copy(update={"moe": model_spec.moe.model_copy(update={"router": router})})
    model_path = tmp / "model.yaml"
    dump_yaml(model_spec, model_path)

    # the reference: one process, the whole global batch as MICRO_STEPS micro-batches per step
    ref_trainer = Trainer(_single_spec(tmp / "ref"), model_spec, log=lambda *a: None)
    ref = ref_trainer.fit()["losses"]
    ref_norms = [_metrics(tmp / "ref")[s]["train/grad_norm"] for s in range(1, STEPS + 1)]
    bias = {k: m.router.selection_bias.clone() for k, m in ref_trainer.model.moe_layers().items()}

    # 2 ranks through the real launcher; its step-SAVED_AT checkpoint is what the other layouts resume from
    plan_path = tmp / "plan_ep2.yaml"
    save_plan(_plan(2, model_path, dp_shard=2, zero_stage=3, ep=2), plan_path)
    run = tmp / "ep2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moestack", "train", "--plan", str(plan_path), "--out", str(run), "--steps", str(STEPS),
           "-q", *[f"--set={k}={v}" for k, v in OPTIONS.items() if k != "seq_len"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
    proc = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=240)
    return {"tmp": tmp, "model_spec": model_spec, "model_path": model_path, "ref": ref, "ref_norms": ref_norms,
            "ref_bias": bias, "run": run, "proc": proc, "saved": run / "checkpoints" / f"step_{SAVED_AT:08d}"}


def _single_spec(out: Path):
    return load_train_spec(None, {**OPTIONS, "out_dir": str(out), "steps": STEPS,
                                  "micro_batch_size": GLOBAL_BATCH // MICRO_STEPS, "grad_accum_steps": MICRO_STEPS})


@pytest.mark.slow
def test_torchrun_plan_matches_single_process(ep2_run):
    proc, ref, ref_norms = ep2_run["proc"], ep2_run["ref"], ep2_run["ref_norms"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("moestack train") == 1, "only rank 0 prints"
    assert min(ref_norms) > OPTIONS["optimizer.grad_clip"]  # clipping is active: the global norm matters
    got = _metrics(ep2_run["run"])
    for step in range(1, STEPS + 1):
        loss, norm = got[step]["train/loss"], got[step]["train/grad_norm"]
        assert abs(loss - ref[step - 1]) < RTOL * abs(ref[step - 1]), (step, loss, ref[step - 1])
        assert abs(norm - ref_norms[step - 1]) < RTOL * ref_norms[step - 1], (step, norm, ref_norms[step - 1])
    assert (ep2_run["saved"] / "COMPLETE").is_file()


@pytest.mark.slow
def test_resume_at_ep1_single_process(ep2_run):
    assert ep2_run["proc"].returncode == 0, ep2_run["proc"].stderr[-3000:]
    one = ep2_run["tmp"] / "ep1"
    saved = ep2_run["saved"]
    shutil.copytree(saved, one / "checkpoints" / saved.name)
    trainer = Trainer(_single_spec(one), ep2_run["model_spec"], log=lambda *a: None)
    assert trainer.resume() and trainer.step == SAVED_AT
    rest = trainer.fit()["losses"]
    ref = ep2_run["ref"][SAVED_AT:]
    for a, b in zip(rest, ref, strict=True):
        assert abs(a - b) < RTOL * abs(b), (rest, ref)
    for layer, m in trainer.model.moe_layers().items():
        assert torch.equal(m.router.selection_bias, ep2_run["ref_bias"][layer]), layer


@pytest.mark.slow
def test_resume_at_ep4_and_pp2_on_four_ranks(ep2_run):
    """EP4 with the hierarchical dispatcher (2 domains of 2) x ZeRO-2, then PP2 (interleaved 1F1B, 2 chunks per
    rank) x EP2 x ZeRO-3, both from the EP2 checkpoint."""
    assert ep2_run["proc"].returncode == 0, ep2_run["proc"].stderr[-3000:]
    tmp, saved = ep2_run["tmp"], ep2_run["saved"]
    layouts = {"ep4_hier": dict(dp_shard=4, zero_stage=2, ep=4, dispatcher="hierarchical", ep_domain_size=2),
               "pp2_ep2": dict(pp=2, vpp=2, schedule="interleaved_1f1b", dp_shard=2, zero_stage=3, ep=2)}
    runs = {}
    for name, layout in layouts.items():
        shutil.copytree(saved, tmp / name / "checkpoints" / saved.name)
        save_plan(_plan(4, ep2_run["model_path"], **layout), tmp / f"plan_{name}.yaml")
        runs[name] = (str(tmp / name), str(tmp / f"plan_{name}.yaml"))
    results = run_ranks(__file__, "_resume_worker", world_size=4, timeout=300, runs=runs,
                        model_path=str(ep2_run["model_path"]))
    ref, ref_bias = ep2_run["ref"][SAVED_AT:], ep2_run["ref_bias"]
    for name in layouts:
        seen = set()
        for rank, per_layout in enumerate(results):
            res = per_layout[name]
            for a, b in zip(res["losses"], ref, strict=True):
                assert abs(a - b) < RTOL * abs(b), (name, rank, res["losses"], ref)
            for layer, bias in res["biases"].items():  # every rank holding a layer has the reference's biases
                assert torch.equal(bias, ref_bias[layer]), f"{name} rank {rank} layer {layer}: router biases differ"
                seen.add(layer)
        assert seen == set(ref_bias), (name, seen)


def test_sampler_position_converts_between_layouts():
    state = {"epoch": 3, "position": 6, "seed": 0, "seq_len": 16, "batch_size": 2, "world_size": 2,
             "num_windows": 100}
    assert adapt_sampler_state(state, 4, 1)["position"] == 6  # same global batch: same position
    assert adapt_sampler_state(state, 1, 1)["position"] == 24  # 24 sequences consumed
    assert adapt_sampler_state(state, 1, 4) | {"position": 0} == {**state, "batch_size": 1, "world_size": 4,
                                                                   "position": 0}
    with pytest.raises(ValueError, match="not a multiple"):
        adapt_sampler_state(state, 5, 1)
