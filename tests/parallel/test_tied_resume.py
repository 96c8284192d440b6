"""Checkpoints of a TIED model (tie_word_embeddings: true) across a pipeline boundary.

One process holds one parameter reachable as embed.weight and lm_head.weight; under PP the last stage's LM head is
a separate copy of the embedding (moestack.parallel.pipeline), saved as its own model / optimizer entry. A
checkpoint must still resume at the other layout with the losses of the uninterrupted run:
  (a) the single-process run's step-2 checkpoint resumed at PP2 (1F1B, 2 gloo ranks, dp 1);
  (b) a PP2 run's step-2 checkpoint resumed in one process;
  (c) that checkpoint resumed at PP2 (DCP keeps one rank's param-group name lists, which named only the other
      stage's parameters: the ranks left out lost their groups' hyper-parameters, for tied and untied models).
Also: after the PP2 resume both copies (weights and AdamW state) hold the checkpoint's values, so the runner's
first-step "copy the embedding into the head" changes nothing; a checkpoint whose copies differ (weight, or the
head copy's optimizer state) is refused with one line, at PP2 and in one process.
Every run trains in float64 (precision fp64), so losses and weights must agree to RTOL = 1e-10 (measured <= 3.1e-16
on x86 / torch 2.13 CPU).

test_tied_checkpoint_resumes_across_layouts: the same model under a V-shaped pipeline (zbv: first and last stage on
one rank, the stage wrapper as FSDP root), TP2 (the embedding and the head vocab-sharded) and ZeRO-3 over two
data-parallel ranks. For each, on 2 gloo ranks: the run from scratch has the single-process run's losses; the
single-process step-2 checkpoint resumed at that layout gives the uninterrupted run's losses; the layout's own
step-2 checkpoint resumed in ONE process gives them too, the tie intact.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moestack.config.base import dump_yaml
from moestack.config.model_spec import ModelSpec
from moestack.config.plan import make_plan, save_plan
from moestack.config.train_spec import load_train_spec
from moestack.train.checkpoint import CheckpointError
from moestack.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec

SEQ, GLOBAL_BATCH, MICRO_STEPS, STEPS, SAVED_AT = 16, 4, 2, 4, 2
OPTIONS = {"seq_len": SEQ, "logging.every": 1, "logging.tensorboard": False, "logging.progress": False,
           "eval_every": 0, "data.eval_fraction": 0.0, "schedule.warmup_steps": 1, "optimizer.lr": 3e-3,
           "optimizer.grad_clip": 0.5, "checkpoint.every": SAVED_AT, "precision": "fp64"}
TIED = ("embed.weight", "lm_head.weight")
RTOL = 1e-10  # float64 runs: layouts and resumes differ from the uninterrupted single process by summation order
LAYOUTS = {  # name: plan fields beyond the common ones
    "zbv": {"pp": 2, "vpp": 2, "schedule": "zbv", "micro_batch_size": 1},
    "tp2": {"tp": 2, "micro_batch_size": 2},
    "zero3": {"dp_shard": 2, "zero_stage": 3, "micro_batch_size": 1},
}


def _tied_spec() -> ModelSpec:
    return ModelSpec.model_validate({**small_model_spec().model_dump(), "tie_word_embeddings": True})


def _single_spec(out: Path):
    return load_train_spec(None, {**OPTIONS, "out_dir": str(out), "steps": STEPS,
                                  "micro_batch_size": GLOBAL_BATCH // MICRO_STEPS, "grad_accum_steps": MICRO_STEPS})


def _ranks_spec(out: str | Path):
    """The train spec of a run under a plan (the plan sets micro-batches and data parallelism)."""
    return load_train_spec(None, {**OPTIONS, "out_dir": str(out), "steps": STEPS})


def _close(got, want, what, rel=RTOL):
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) < rel * abs(b), f"{what}: losses {got} vs the uninterrupted run's {want}"


def _copies(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """name -> weight and AdamW state of the tied copies this process holds (a single process: one, under two
    names)."""
    from torch.distributed.tensor import DTensor

    def plain(t):  # FSDP over dp 1: the local shard is the whole tensor
        return (t.to_local() if isinstance(t, DTensor) else torch.as_tensor(t)).detach().clone()

    params = dict(trainer.model.named_parameters(remove_duplicate=False))
    return {name: {"weight": plain(params[name]), **{k: plain(v) for k, v in
                                                     trainer.optimizer.state.get(params[name], {}).items()}}
            for name in TIED if name in params}


def _tamper(src: Path, dst: Path, head_weight: bool, head_state: bool) -> None:
    """A copy of checkpoint `src` (one process, tied) at `dst` whose two copies of the tied weight disagree: the
    lm_head.weight entry moved off the embedding's, and / or an lm_head.weight optimizer state (a PP checkpoint's
    own entry for the head copy) unlike the embedding's. Valid otherwise (meta.json, COMPLETE)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    from moestack.train import checkpoint as ckpt

    whole = dst.parents[2] / f"{dst.parents[1].name}.pt"  # (outside the run directory)
    dcp_to_torch_save(src, whole)
    sd = torch.load(whole, weights_only=False)
    if head_weight:
        sd["model"]["lm_head.weight"] = sd["model"]["embed.weight"] + 1e-3
    if head_state:
        sd["optim"]["state"]["lm_head.weight"] = {k: v * 2 if k == "exp_avg" else v.clone()
                                                  for k, v in sd["optim"]["state"]["embed.weight"].items()}
    torch.save(sd, whole)
    torch_save_to_dcp(whole, dst)
    shutil.copy(src / ckpt.META, dst / ckpt.META)
    files = {f: ckpt._digest(dst / f) for f in ckpt._data_files(dst)}
    (dst / ckpt.COMPLETE).write_text(json.dumps({"format_version": ckpt.FORMAT_VERSION, "files": files}))


def _pp2_worker(rank: int, world: int, model_path: str, plan_path: str, fresh: str, resumed: str,
                tampered: dict[str, str]) -> dict:
    """The `tampered` checkpoints at PP2 (each must be refused); a PP2 run from scratch (its step-SAVED_AT
    checkpoint is case (b)); the single-process run's checkpoint (copied under `resumed`) resumed at PP2 (case (a));
    the PP2 run's checkpoint resumed at PP2 (case (c))."""
    from moestack.config.base import read_yaml
    from moestack.config.plan import load_plan
    from moestack.train.checkpoint import CheckpointError

    model_spec, plan = ModelSpec.model_validate(read_yaml(model_path)), load_plan(plan_path)
    out = {"refused": {}}
    for name, path in tampered.items():  # (first: no run left in a half-loaded state behind them)
        trainer = Trainer(_ranks_spec(path), model_spec, log=lambda *a: None, plan=plan)
        try:
            trainer.resume()
        except CheckpointError as err:
            out["refused"][name] = str(err)
    trainer = Trainer(_ranks_spec(fresh), model_spec, log=lambda *a: None, plan=plan)
    assert trainer.pipeline is not None
    out["fresh"] = trainer.fit()["losses"]
    trainer = Trainer(_ranks_spec(resumed), model_spec, log=lambda *a: None, plan=plan)
    assert trainer.resume() and trainer.step == SAVED_AT
    out["after_resume"] = _copies(trainer)
    out["resumed"] = trainer.fit()["losses"]
    out["after_fit"] = _copies(trainer)
    # (c) the PP2 run's own checkpoint at PP2 again
    trainer = Trainer(_ranks_spec(f"{fresh}_again"), model_spec, log=lambda *a: None, plan=plan)
    assert trainer.resume(Path(fresh) / "checkpoints" / f"step_{SAVED_AT:08d}") and trainer.step == SAVED_AT
    out["again"] = trainer.fit()["losses"]
    return out


def _tied_model_file(tmp_path: Path):
    """The tied model's spec and the YAML file the ranks read it from."""
    model_spec = _tied_spec()
    model_path = tmp_path / "model.yaml"
    dump_yaml(model_spec, model_path)
    return model_spec, model_path


@pytest.mark.slow
def test_tied_checkpoint_resumes_across_pp(tmp_path, one_thread):
    model_spec, model_path = _tied_model_file(tmp_path)

    # the reference: one process, uninterrupted; its step-SAVED_AT checkpoint is case (a)'s
    ref_trainer = Trainer(_single_spec(tmp_path / "ref"), model_spec, log=lambda *a: None)
    assert ref_trainer.model.lm_head.weight is ref_trainer.model.embed.weight
    ref = ref_trainer.fit()["losses"]
    saved = tmp_path / "ref" / "checkpoints" / f"step_{SAVED_AT:08d}"
    shutil.copytree(saved, tmp_path / "pp2_from_one" / "checkpoints" / saved.name)

    plan_path = tmp_path / "plan_pp2.yaml"
    save_plan(make_plan(model=str(model_path), cluster="cpu", devices=2, seq_len=SEQ,
                        global_batch_size=GLOBAL_BATCH, micro_batch_size=1, pp=2, schedule="1f1b"), plan_path)
    tampered = {}
    for name, weight, state in (("head_weight", True, False), ("head_state", False, True)):
        _tamper(saved, tmp_path / name / "checkpoints" / saved.name, weight, state)
        tampered[name] = str(tmp_path / name)
    results = run_ranks(__file__, "_pp2_worker", world_size=2, timeout=300, model_path=str(model_path),
                        plan_path=str(plan_path), fresh=str(tmp_path / "pp2"), resumed=str(tmp_path / "pp2_from_one"),
                        tampered=tampered)

    # copies that disagree are refused, on both ranks, one line naming them: at PP2 the first step's embedding ->
    # head copy would mend the weight but not the head's optimizer state
    for rank, r in enumerate(results):
        for name, what in (("head_weight", "(weight)"), ("head_state", "(exp_avg)")):
            msg = r["refused"].get(name, "")
            assert "'embed.weight' and 'lm_head.weight' differ" in msg and what in msg and "\n" not in msg, (
                rank, name, msg)
    for rank, r in enumerate(results):
        _close(r["fresh"], ref, f"PP2 run (rank {rank})")
        _close(r["resumed"], ref[SAVED_AT:], f"(a) one process -> PP2 (rank {rank})")
        _close(r["again"], ref[SAVED_AT:], f"(c) PP2 -> PP2 (rank {rank})")
    # the copies live on different ranks (embedding on pp rank 0, head on pp rank 1): equal weights and optimizer
    # state right after the resume (so the runner's first-step copy embedding -> head is a no-op) and at the end
    for when in ("after_resume", "after_fit"):
        copies = {name: c for r in results for name, c in r[when].items()}
        assert set(copies) == set(TIED), (when, set(copies))
        embed, head = copies["embed.weight"], copies["lm_head.weight"]
        assert embed.keys() == head.keys() and {"weight", "exp_avg", "exp_avg_sq", "step"} <= embed.keys(), (
            when, embed.keys(), head.keys())
        for key in embed:
            assert torch.equal(embed[key], head[key]), f"{when}: the head copy's {key} differs from the embedding's"
    # the resumed weights are the uninterrupted run's
    final = {n: p.detach() for n, p in ref_trainer.model.named_parameters()}
    got = {name: c["weight"] for r in results for name, c in r["after_fit"].items()}
    for name in TIED:
        err = float((got[name] - final["embed.weight"]).norm() / final["embed.weight"].norm())
        assert err < RTOL, f"(a) {name} after the resumed steps: rel err {err:.2e} vs the uninterrupted run"

    # (b) the PP2 run's step-SAVED_AT checkpoint (embed.weight and lm_head.weight stored apart) in one process
    pp_saved = tmp_path / "pp2" / "checkpoints" / f"step_{SAVED_AT:08d}"
    meta = json.loads((pp_saved / "meta.json").read_text())
    assert "pp2" in meta["extra"]["layout"], meta["extra"]["layout"]
    one = tmp_path / "one_from_pp2"
    shutil.copytree(pp_saved, one / "checkpoints" / pp_saved.name)
    trainer = Trainer(_single_spec(one), model_spec, log=lambda *a: None)
    assert trainer.resume() and trainer.step == SAVED_AT
    assert trainer.model.lm_head.weight is trainer.model.embed.weight  # still one parameter
    _close(trainer.fit()["losses"], ref[SAVED_AT:], "(b) PP2 -> one process")

    # one parameter cannot take two different stored values (the later read would silently win)
    trainer = Trainer(_single_spec(tmp_path / "head_weight"), model_spec, log=lambda *a: None)
    with pytest.raises(CheckpointError, match=r"'embed.weight' and 'lm_head.weight' differ, but the model ties"):
        trainer.resume()


def _layouts_worker(rank: int, world: int, model_path: str, plans: dict[str, str], root: str) -> dict:
    """Per layout: the fresh run's losses, then the single-process checkpoint (copied under <root>/<name>_resumed)
    resumed at the layout."""
    from moestack.config.base import read_yaml
    from moestack.config.plan import load_plan

    model_spec = ModelSpec.model_validate(read_yaml(model_path))
    out = {}
    for name, plan_path in plans.items():
        plan = load_plan(plan_path)
        fresh = Trainer(_ranks_spec(Path(root) / name), model_spec, log=lambda *a: None, plan=plan)
        got = {"fresh": fresh.fit()["losses"]}
        resumed = Trainer(_ranks_spec(Path(root) / f"{name}_resumed"), model_spec, log=lambda *a: None, plan=plan)
        assert resumed.resume() and resumed.step == SAVED_AT, name
        got["resumed"] = resumed.fit()["losses"]
        out[name] = got
    return out


@pytest.mark.slow
def test_tied_checkpoint_resumes_across_layouts(tmp_path, one_thread):
    model_spec, model_path = _tied_model_file(tmp_path)
    ref = Trainer(_single_spec(tmp_path / "ref"), model_spec, log=lambda *a: None).fit()["losses"]
    saved = tmp_path / "ref" / "checkpoints" / f"step_{SAVED_AT:08d}"
    plans = {}
    for name, fields in LAYOUTS.items():
        shutil.copytree(saved, tmp_path / f"{name}_resumed" / "checkpoints" / saved.name)
        plans[name] = str(tmp_path / f"plan_{name}.yaml")
        save_plan(make_plan(model=str(model_path), cluster="cpu", devices=2, seq_len=SEQ,
                            global_batch_size=GLOBAL_BATCH, **fields), plans[name])
    results = run_ranks(__file__, "_layouts_worker", world_size=2, timeout=600, model_path=str(model_path),
                        plans=plans, root=str(tmp_path))
    for name in LAYOUTS:
        for rank, r in enumerate(results):
            _close(r[name]["fresh"], ref, f"{name} from scratch (rank {rank})")
            _close(r[name]["resumed"], ref[SAVED_AT:], f"one process -> {name} (rank {rank})")
        # the layout's own checkpoint back in one process: one parameter again, the uninterrupted run's losses
        own = tmp_path / name / "checkpoints" / f"step_{SAVED_AT:08d}"
        back = tmp_path / f"{name}_back"
        shutil.copytree(own, back / "checkpoints" / own.name)
        trainer = Trainer(_single_spec(back), model_spec, log=lambda *a: None)
        assert trainer.resume() and trainer.step == SAVED_AT, name
        assert trainer.model.lm_head.weight is trainer.model.embed.weight
        _close(trainer.fit()["losses"], ref[SAVED_AT:], f"{name} -> one process")
