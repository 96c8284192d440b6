"""The trainer under the split-backward V schedules (zbv, dualpipev) with tensor parallelism: PP2 x TP2 (sequence
parallel) on 4 gloo ranks reproduces the single-process run of the same global batches -- the losses of every
step, the first step's gradient of every parameter and its global norm.

The trainer always shards the stages with FSDP2 (a data-parallel mesh of one rank here). Behind the pipeline's
plain stage wrapper FSDP resharded each stage after the input half of a split backward, and torch's weight half
(`stage_backward_weight`) then failed with `KeyError: <AccumulateGrad ...>`: it looks up the AccumulateGrad nodes
the input half recorded (those of the gathered parameters) among the stage module's parameters, by then the
sharded ones (moestack.parallel.pipeline.stage_module). The runner-level PP x TP tests (test_pipeline.py) apply
no FSDP and never saw it. Untied models (tied ones under PP x TP: test_pipeline.py), with ZeRO-3's
reshard-after-forward in the plan, which silently dropped the last stage's gradients (the V schedules now keep
the stages gathered during the step).

Both runs train in float64 (precision fp64): the layouts then differ from the single process by summation order
only, measured <= 3.3e-14 (gradients; losses and norm less) on x86 / torch 2.13 CPU; the bound RTOL is
1e-10.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moestack.config.base import dump_yaml
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import make_plan, save_plan
from moestack.config.train_spec import load_train_spec
from moestack.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec

SEQ, GLOBAL_BATCH, STEPS = 16, 4, 2
OPTIONS = {"seq_len": SEQ, "logging.every": 1, "logging.tensorboard": False, "logging.progress": False,
           "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1, "optimizer.lr": 3e-3,
           "optimizer.grad_clip": 0.5, "checkpoint.every": 0, "precision": "fp64"}
CASES = ("zbv", "dualpipev")
RTOL = 1e-10  # float64 (module docstring)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _record_first_step(trainer: Trainer, out: dict) -> None:
    """Wrap trainer._grad_norm: the first call records every parameter's (whole, unclipped) gradient and the global
    norm."""
    grad_norm = trainer._grad_norm

    def recording(params):
        if "grads" not in out:  # collective on multi-rank: every rank records, in named_parameters() order
            out["grads"] = {n: _full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
            norm, clipped = grad_norm(params)
            out["norm"] = float(norm)
            return norm, clipped
        return grad_norm(params)

    trainer._grad_norm = recording


def _worker(rank: int, world: int, runs: dict[str, tuple[str, str, str]]) -> dict:
    """Each (model, plan, out dir) of `runs` through the trainer: losses, first-step gradients and norm."""
    from moestack.config.base import read_yaml
    from moestack.config.plan import load_plan

    torch.manual_seed(0)
    results = {}
    for name, (model_path, plan_path, out_dir) in runs.items():
        trainer = Trainer(load_train_spec(None, {**OPTIONS, "out_dir": out_dir, "steps": STEPS}),
                          ModelSpec.model_validate(read_yaml(model_path)), log=lambda *a: None,
                          plan=load_plan(plan_path))
        assert trainer.pipeline is not None and trainer.plan.schedule == name and trainer.plan.tp == 2
        out: dict = {}
        _record_first_step(trainer, out)
        out["losses"] = trainer.fit()["losses"]
        results[name] = out
    return results


@pytest.mark.slow
def test_v_schedules_tp2_trainer_match_single_process(tmp_path, one_thread):
    spec = small_model_spec()
    model_path = tmp_path / "model.yaml"
    dump_yaml(spec, model_path)
    # the reference: one process, the whole global batch in one micro-batch
    ref_trainer = Trainer(load_train_spec(None, {**OPTIONS, "out_dir": str(tmp_path / "ref"), "steps": STEPS,
                                                 "micro_batch_size": GLOBAL_BATCH, "grad_accum_steps": 1}),
                          spec, log=lambda *a: None)
    ref: dict = {}
    _record_first_step(ref_trainer, ref)
    ref["losses"] = ref_trainer.fit()["losses"]
    assert ref["norm"] > OPTIONS["optimizer.grad_clip"]  # clipping is active: the global norm matters

    runs = {}
    for name in CASES:
        plan_path = tmp_path / f"plan_{name}.yaml"
        # zero_stage 3 with dp 1: the blocks would reshard after forward (the V schedules keep them gathered)
        save_plan(make_plan(model=str(model_path), cluster="cpu", devices=4, seq_len=SEQ,
                            global_batch_size=GLOBAL_BATCH, micro_batch_size=1, pp=2, vpp=2, tp=2,
                            schedule=name, zero_stage=3), plan_path)
        runs[name] = (str(model_path), str(plan_path), str(tmp_path / f"pp2_tp2_{name}"))

    results = run_ranks(__file__, "_worker", world_size=4, timeout=300, runs=runs)

    for name in CASES:
        per_rank = [r[name] for r in results]
        for rank, r in enumerate(per_rank):
            for a, b in zip(r["losses"], ref["losses"], strict=True):
                assert abs(a - b) < RTOL * abs(b), f"{name} rank {rank}: losses {r['losses']} vs {ref['losses']}"
            assert abs(r["norm"] - ref["norm"]) < RTOL * ref["norm"], (name, rank, r["norm"], ref["norm"])
        grads = {}
        for r in per_rank:  # the two ranks of a TP group hold the same whole gradients; stages are disjoint
            grads.update(r["grads"])
        want = ref["grads"]
        assert grads.keys() == want.keys(), f"{name}: {sorted(grads.keys() ^ want.keys())}"
        bad = {n: e for n, g in grads.items()
               if (e := float((g - want[n]).norm() / want[n].norm().clamp(min=1e-30))) > RTOL}
        assert not bad, f"{name}: gradients differ from the single-process run: {bad}"
