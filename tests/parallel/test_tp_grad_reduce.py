"""plan.tp_grad_reduce = "deferred" (moestack.parallel.tensor): the TP sums of partial gradients run once per optimizer
step, bucketed, in `finish_tp_grad_reduce`, instead of once per parameter in every backward ("eager").

Each job runs the same seeded model in both modes on the same batches and compares them (fp64, CPU, gloo): every
gradient after the first step's backward(s) + finish, and every parameter after STEPS AdamW steps. Layouts: TP2
with and without SP, with 2 accumulated micro-batches, tied embeddings (a weight with a partial and a complete use),
small buckets (several all-reduces); TP2 x ZeRO-3 / ZeRO-2 through `parallelize` (the sum runs on FSDP's sharded
gradient); the trainer at TP2 x PP2 (the trainer's finish call and guard). It also checks that deferral really
defers (no all-reduce in backward, partial gradients before the finish) and that a forgotten finish is caught.

The two modes add the same partial sums in another order (and bucketed): in float64 they measured <= 7.3e-15
apart (x86 / torch 2.13 CPU); the bound RTOL is 1e-10 (a sum left out or counted twice is O(1)).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec
from test_tensor import _no_aux, make_batch, tiny_spec, variant_spec

from moestack.config.base import ConfigError
from moestack.config.plan import make_plan

STEPS = 2  # the second step runs on the deferral re-armed by the first finish and on non-empty AdamW state
GRAD_RTOL = PARAM_RTOL = NORM_RTOL = 1e-10  # float64: eager and deferred add the same numbers in another order


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _max_rel(got: dict, want: dict) -> tuple[float, str]:
    assert got.keys() == want.keys()
    return max((_rel(got[n], want[n]), n) for n in want)


@contextlib.contextmanager
def _count_all_reduces():
    """Count torch.distributed.all_reduce calls (the eager path's per-parameter sums go through it)."""
    import torch.distributed as dist

    inner, calls = dist.all_reduce, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = inner


def _update_biases(model, group) -> None:
    """The token-sharded MoE's router state adds up over the TP group (as in test_tensor.py)."""
    from moestack.train.expert_load import reduce_router_state

    reduce_router_state(model.moe_layers(), group)
    for moe in model.moe_layers().values():
        moe.router.update_selection_bias()


# ---------------------------------------------------------------------------------------------------------------
# TP2 through apply_tp (2 ranks)


def _tp_pair_worker(rank: int, world: int, spec, sp: bool, accum: int, bucket_bytes: int | None = None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from moestack.model.transformer import build_model
    from moestack.parallel.tensor import apply_tp, finish_tp_grad_reduce, guard_tp_grad_reduce, tp_grads_pending

    base = build_model(spec, "cpu", seed=0).double()
    for layer in base.dsa_layers().values():
        layer.sparse = True
    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for mode in ("eager", "deferred"):
        models[mode] = copy.deepcopy(base)
        apply_tp(models[mode], mesh, sequence_parallel=sp, grad_reduce=mode)
    opts = {mode: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for mode, m in models.items()}
    for mode, model in models.items():  # a no-op on the eager model
        guard_tp_grad_reduce(opts[mode], model)
    finish_kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    out = {"backward_all_reduces": {}, "tied_deferred": None}
    if spec.tie_word_embeddings:  # both uses of the tied weight are deferred (the head's use is a partial sum)
        d = models["deferred"]
        out["tied_deferred"] = (d.embed.weight is d.lm_head.weight, d.embed._tp_unit.params[0][3] is not None,
                                d.lm_head._tp_unit.params[0][3] is not None)
    for step in range(STEPS):
        for mode, model in models.items():
            with _count_all_reduces() as calls:
                for i in range(accum):
                    tokens, targets = make_batch(spec, step * accum + i)
                    loss = model(tokens, targets) / accum
                    before = calls[0]
                    loss.backward()
                    out["backward_all_reduces"].setdefault(mode, 0)
                    out["backward_all_reduces"][mode] += calls[0] - before
            if mode == "deferred" and step == 0:
                out["pending_after_backward"] = tp_grads_pending(model)
                partial = {n: _full(p.grad) for n, p in model.named_parameters()}
                out["unreduced_err"] = _max_rel(partial, out["grads_eager"])[0]  # must be large
                try:
                    opts[mode].step()
                    out["guard_raised"] = False
                except RuntimeError as err:
                    out["guard_raised"] = "finish_tp_grad_reduce" in str(err)
            out.setdefault("finish_calls", {})[mode] = finish_tp_grad_reduce(model, **finish_kw)
            if step == 0:
                out[f"grads_{mode}"] = {n: _full(p.grad) for n, p in model.named_parameters()}
            opts[mode].step()
            opts[mode].zero_grad(set_to_none=True)
            _update_biases(model, mesh.get_group())
        out["pending_after_finish"] = tp_grads_pending(models["deferred"])
    out["grad_err"] = _max_rel(out.pop("grads_deferred"), out.pop("grads_eager"))
    params = {mode: {n: _full(p) for n, p in m.named_parameters()} for mode, m in models.items()}
    out["param_err"] = _max_rel(params["deferred"], params["eager"])
    return out


TP_CONFIGS = {
    # ~10 KiB buckets: the tiny model's pending gradients take several all-reduces (one micro-batch per step here;
    # the bucketing only sees the accumulated gradients, so it does not need its own accumulating run)
    "sp_small_buckets": {"spec": _no_aux(tiny_spec), "sp": True, "accum": 1, "bucket_bytes": 10_000},
    "sp_accum2": {"spec": _no_aux(tiny_spec), "sp": True, "accum": 2},
    "tied_gqa_sp_accum2": {"spec": _no_aux(variant_spec), "sp": True, "accum": 2},
    "no_sp_accum2": {"spec": _no_aux(tiny_spec), "sp": False, "accum": 2},  # "avg" (indexer), norms not summed
}


def _tp_all_worker(rank: int, world: int) -> dict:
    return {name: _tp_pair_worker(rank, world, **kw) for name, kw in TP_CONFIGS.items()}


@pytest.fixture(scope="module")
def tp2_results() -> dict:
    results = run_ranks(__file__, "_tp_all_worker", world_size=2, timeout=300)
    return {name: [r[name] for r in results] for name in TP_CONFIGS}


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_CONFIGS)
def test_tp2_deferred_matches_eager(tp2_results, name):
    for rank, r in enumerate(tp2_results[name]):
        where = f"{name} rank {rank}"
        assert r["grad_err"][0] < GRAD_RTOL, f"{where}: gradient {r['grad_err'][1]} rel err {r['grad_err'][0]:.2e}"
        assert r["param_err"][0] < PARAM_RTOL, f"{where}: parameter {r['param_err'][1]} rel err {r['param_err'][0]:.2e}"
        # deferral defers: no per-parameter all-reduce in backward, and the gradients were partial until the finish
        assert r["backward_all_reduces"]["deferred"] == 0, where
        assert r["backward_all_reduces"]["eager"] > 0, where
        assert r["unreduced_err"] > 1e-2, f"{where}: deferred gradients were already complete before the finish"
        assert r["pending_after_backward"] and not r["pending_after_finish"], where
        assert r["finish_calls"]["eager"] == 0, where
        want = (lambda n: n > 2) if "small_buckets" in name else (lambda n: n == 1)
        assert want(r["finish_calls"]["deferred"]), f"{where}: {r['finish_calls']['deferred']} bucket all-reduces"
        if r["tied_deferred"] is not None:
            assert r["tied_deferred"] == (True, True, True), where


@pytest.mark.slow
def test_optimizer_step_without_finish_raises(tp2_results):
    """guard_tp_grad_reduce: optimizer.step() with pending sums raises (naming the call to make) and steps nothing;
    the parameters after the run still match the eager run (checked above), so the refused step changed nothing."""
    for name, per_rank in tp2_results.items():
        for rank, r in enumerate(per_rank):
            assert r["guard_raised"] is True, f"{name} rank {rank}: the optimizer stepped on partial gradients"


# ---------------------------------------------------------------------------------------------------------------
# TP2 x ZeRO through parallelize (FSDP2), and the trainer at TP2 x PP2 (4 ranks)

ROWS, T, CLIP = 4, 16, 0.05  # ROWS sequences per step: accum micro-batches x dp ranks x 1


def _fsdp_pair(rank: int, world: int, layout: dict, accum: int) -> dict:
    from moestack.model.transformer import build_model
    from moestack.parallel import build_meshes, clip_grad_norm_, parallelize, set_gradient_sync
    from moestack.parallel.tensor import finish_tp_grad_reduce, tp_grads_pending

    spec = small_model_spec(seq_aux_loss_coef=0.0)
    dp = layout["dp_shard"]
    plans = {mode: make_plan(model="tiny", cluster="cpu", devices=world, seq_len=T, global_batch_size=ROWS,
                             micro_batch_size=ROWS // (dp * accum), tp_grad_reduce=mode, **layout)
             for mode in ("eager", "deferred")}
    meshes = build_meshes(plans["eager"], "cpu")
    models = {mode: parallelize(build_model(spec, "cpu", seed=0).double(), plan, meshes)
              for mode, plan in plans.items()}
    opts = {mode: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for mode, m in models.items()}
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, spec.vocab_size, (ROWS, T + 1), generator=g) for _ in range(STEPS)]
    out = {"norm": {"eager": [], "deferred": []}}
    for step, batch in enumerate(batches):
        rows = batch.view(accum, dp, ROWS // (accum * dp), T + 1)[:, meshes.dp_rank]
        for mode, model in models.items():
            for i in range(accum):
                set_gradient_sync(model, i == accum - 1)  # FSDP reduces once, after the last micro-batch
                (model(rows[i, :, :-1], rows[i, :, 1:]) / accum).backward()
            if mode == "deferred" and step == 0:
                out["pending_after_backward"] = tp_grads_pending(model)
            finish_tp_grad_reduce(model)  # after FSDP's reduce-scatter: sums the sharded gradients
            if step == 0:
                out[f"grads_{mode}"] = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            out["norm"][mode].append(float(clip_grad_norm_(list(model.parameters()), CLIP)))
            opts[mode].step()
            opts[mode].zero_grad(set_to_none=True)
            _update_biases(model, meshes.tp.get_group())
    out["grad_err"] = _max_rel(out.pop("grads_deferred"), out.pop("grads_eager"))
    params = {mode: {n: _full(p) for n, p in m.named_parameters()} for mode, m in models.items()}
    out["param_err"] = _max_rel(params["deferred"], params["eager"])
    embed = models["deferred"].embed.weight
    out["sharded"] = embed.to_local().numel() <= embed.numel() // dp  # FSDP holds a DP shard of the gradient
    return out


def _trainer_pair(rank: int, world: int, out_dir: str, layout: dict) -> dict:
    from moestack.config.train_spec import load_train_spec
    from moestack.train.trainer import Trainer

    spec = small_model_spec(seq_aux_loss_coef=0.0)
    options = {"seq_len": T, "logging.tensorboard": False, "logging.progress": False, "eval_every": 0,
               "data.eval_fraction": 0.0, "schedule.warmup_steps": 1, "optimizer.lr": 3e-3,
               "optimizer.grad_clip": 0.5, "checkpoint.every": 0, "checkpoint.save_final": False, "steps": STEPS,
               "precision": "fp64"}
    out = {}
    for mode in ("eager", "deferred"):
        plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=T, global_batch_size=ROWS,
                         micro_batch_size=1, tp_grad_reduce=mode, **layout)
        trainer = Trainer(load_train_spec(None, {**options, "out_dir": f"{out_dir}/{mode}"}), spec,
                          log=lambda *a: None, plan=plan)
        stats = [trainer.train_step() for _ in range(STEPS)]
        out[mode] = {"loss": [s.loss for s in stats], "norm": [s.grad_norm for s in stats],
                     "params": {n: _full(p) for n, p in trainer.model.named_parameters()}}
    out["param_err"] = _max_rel(out["deferred"].pop("params"), out["eager"].pop("params"))
    return out


FSDP_LAYOUTS = {
    "tp2_zero3_accum2": ({"dp_shard": 2, "zero_stage": 3, "tp": 2}, 2),
    "tp2_zero2": ({"dp_shard": 2, "zero_stage": 2, "tp": 2}, 1),
}
TRAINER_LAYOUT = {"pp": 2, "tp": 2}  # 1F1B over 4 micro-batches of one sequence


def _four_rank_worker(rank: int, world: int, out_dir: str) -> dict:
    out = {name: _fsdp_pair(rank, world, layout, accum) for name, (layout, accum) in FSDP_LAYOUTS.items()}
    out["trainer_pp2_tp2"] = _trainer_pair(rank, world, out_dir, TRAINER_LAYOUT)
    return out


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory) -> list[dict]:
    return run_ranks(__file__, "_four_rank_worker", world_size=4, timeout=300,
                     out_dir=str(tmp_path_factory.mktemp("tp_grad_reduce")))


@pytest.mark.slow
@pytest.mark.parametrize("name", FSDP_LAYOUTS)
def test_tp2_x_zero_deferred_matches_eager(four_rank_results, name):
    for rank, per_layout in enumerate(four_rank_results):
        r, where = per_layout[name], f"{name} rank {rank}"
        assert r["sharded"] and r["pending_after_backward"], where
        assert r["grad_err"][0] < GRAD_RTOL, f"{where}: gradient {r['grad_err'][1]} rel err {r['grad_err'][0]:.2e}"
        assert r["param_err"][0] < PARAM_RTOL, f"{where}: parameter {r['param_err'][1]} rel err {r['param_err'][0]:.2e}"
        torch.testing.assert_close(torch.tensor(r["norm"]["deferred"], dtype=torch.float64),
                                   torch.tensor(r["norm"]["eager"], dtype=torch.float64), rtol=NORM_RTOL, atol=0)
        assert min(r["norm"]["eager"]) > CLIP, f"{where}: clipping never active"


@pytest.mark.slow
def test_trainer_pp2_tp2_deferred_matches_eager(four_rank_results):
    """The trainer calls finish_tp_grad_reduce before clipping (its guard would raise otherwise) for every stage
    this rank holds."""
    for rank, per_layout in enumerate(four_rank_results):
        r, where = per_layout["trainer_pp2_tp2"], f"trainer rank {rank}"
        for key in ("loss", "norm"):
            torch.testing.assert_close(torch.tensor(r["deferred"][key], dtype=torch.float64),
                                       torch.tensor(r["eager"][key], dtype=torch.float64), rtol=NORM_RTOL, atol=0,
                                       msg=where)
        assert r["param_err"][0] < PARAM_RTOL, f"{where}: parameter {r['param_err'][1]} rel err {r['param_err'][0]:.2e}"


def test_plan_field_is_validated():
    base = {"model": "tiny", "cluster": "cpu", "devices": 2, "seq_len": 16, "global_batch_size": 2, "tp": 2}
    assert make_plan(**base).tp_grad_reduce == "eager"
    assert make_plan(**base, tp_grad_reduce="deferred").tp_grad_reduce == "deferred"
    want = r"^plan: tp_grad_reduce: Input should be 'eager' or 'deferred' \(got 'lazy'\)$"  # one line, by name
    with pytest.raises(ConfigError, match=want):
        make_plan(**base, tp_grad_reduce="lazy")
