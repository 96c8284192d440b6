"""Under ZeRO 0-2 the trainer keeps FSDP2's gathered (bf16 on GPUs) parameters between the micro-batches of a step
(parallel/fsdp.py set_reshard_after_backward): on 2 gloo ranks with 2 micro-batches per step, half the
all-gathers, and the same losses and weights bit for bit as gathering for every micro-batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec  # noqa: E402

STEPS = 2


def _worker(rank: int, world: int, keep: bool, zero_stage: int, out: str) -> dict:
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    import moestack.train.trainer as trainer_mod
    from moestack.config.plan import make_plan
    from moestack.config.train_spec import load_train_spec

    torch.manual_seed(0)
    gathers = [0]
    real_gather, real_setter = param_group.foreach_all_gather, trainer_mod.set_reshard_after_backward

    def counting(*args, **kwargs):
        gathers[0] += 1
        return real_gather(*args, **kwargs)

    param_group.foreach_all_gather = counting
    if not keep:
        trainer_mod.set_reshard_after_backward = lambda model, enabled: None
    try:
        plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=16, global_batch_size=2 * world,
                         micro_batch_size=1, dp_shard=world, zero_stage=zero_stage)
        spec = load_train_spec(None, {"out_dir": f"{out}/{keep}{zero_stage}", "steps": STEPS, "eval_every": 0,
                                      "logging.tensorboard": False, "logging.progress": False,
                                      "data.eval_fraction": 0.0})
        trainer = trainer_mod.Trainer(spec, small_model_spec(), log=lambda *a, **k: None, plan=plan)
        assert trainer.spec.grad_accum_steps == 2
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        params = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
        trainer.close()
    finally:
        param_group.foreach_all_gather, trainer_mod.set_reshard_after_backward = real_gather, real_setter
    return {"losses": losses, "gathers": gathers[0], "params": params}


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2])
def test_kept_gathers_between_microbatches(tmp_path, zero_stage):
    keep = run_ranks(__file__, "_worker", world_size=2, timeout=240, keep=True, zero_stage=zero_stage,
                     out=str(tmp_path))
    every = run_ranks(__file__, "_worker", world_size=2, timeout=240, keep=False, zero_stage=zero_stage,
                      out=str(tmp_path))
    for k, e in zip(keep, every, strict=True):
        assert k["losses"] == e["losses"]
        for name, p in k["params"].items():
            assert p.equal(e["params"][name]), name
        assert 0 < k["gathers"] and 2 * k["gathers"] == e["gathers"], (k["gathers"], e["gathers"])
