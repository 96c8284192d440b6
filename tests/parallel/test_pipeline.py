"""Pipeline parallelism (moestack.parallel.pipeline): cost-balanced splits, stage placement, stage modules, and
PP2 on gloo (1F1B, GPipe, interleaved 1F1B with 4 chunks, ZBV zero-bubble, DualPipeV) matching the
single-process run: the loss of 3 AdamW steps and all gradients after the first (float64, CPU), with the MoE
sequence aux loss and the DSA indexer KL loss on (they ride on the activations through each stage's backward).

In float64 the schedules differ from the single process by the order of micro-batch sums only: measured <= 4e-15
(losses) and 2.2e-14 (gradients; PP2 x TP2 and tied included) on x86 / torch 2.13 CPU; bounds FP64 1e-10.
test_pp2_fp32_smoke runs 1F1B in float32, the training dtype: the fp32 noise floor, the single-process fp32 run's
distance from the fp64 one, is 2.6e-5 (loss at step 3) and 1.1e-5 (gradients); 1F1B measured 1.9e-6 / 3.7e-7 from
the fp32 single process. FP32 is 20x the floor.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import ATTN_RES_ZERO_GRAD, randomise_attn_res, run_ranks

from moestack.config.model_spec import load_model_spec
from moestack.model.transformer import build_model
from moestack.parallel.pipeline import (
    build_stage_modules,
    split_stages,
    stage_costs,
    stage_ids_for_rank,
)

B, T, STEPS = 4, 32, 3  # 4 micro-batches of one sequence
FP64 = {"loss": 1e-10, "grad": 1e-10}
FP32 = {"loss": 5e-4, "grad": 5e-4}  # module docstring: 20x the fp32 noise floor


# ---------------------------------------------------------------------------------------------------------------
# splitting and placement (single process)


def _brute_force_best(costs, S, embed, head) -> float:
    """The smallest maximum stage cost over all contiguous splits (for checking the DP on small cases)."""
    import itertools

    L = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        stage = [sum(costs[bounds[s] : bounds[s + 1]]) for s in range(S)]
        stage[0] += embed
        stage[-1] += head
        best = min(best, max(stage))
    return best


def _max_stage_cost(stages, costs, embed, head) -> float:
    sums = [sum(costs[i] for i in st) for st in stages]
    sums[0] += embed
    sums[-1] += head
    return max(sums)


def test_split_balances_cost_not_count():
    # four equal layer counts would put [0, 1] | [2, 3]; the expensive last layer belongs alone
    assert split_stages(None, 2, 1, [1.0, 1.0, 1.0, 5.0]) == [[0, 1, 2], [3]]
    # the head cost on the last stage pushes layers to the first
    assert split_stages(None, 2, 1, [1.0, 1.0, 1.0, 1.0], embed_cost=0.0, head_cost=2.5) == [[0, 1, 2], [3]]
    assert split_stages(None, 2, 1, [1.0, 1.0, 1.0, 1.0], embed_cost=2.5, head_cost=0.0) == [[0], [1, 2, 3]]


def test_split_is_optimal_contiguous_and_complete():
    g = torch.Generator().manual_seed(0)
    for L, S in ((7, 3), (9, 4), (8, 8), (10, 2)):
        costs = (torch.rand(L, generator=g) * 10 + 0.1).tolist()
        embed, head = float(torch.rand((), generator=g)), float(torch.rand((), generator=g) * 20)
        stages = split_stages(None, S, 1, costs, embed, head)
        assert [i for st in stages for i in st] == list(range(L)) and all(stages)
        got = _max_stage_cost(stages, costs, embed, head)
        assert got == pytest.approx(_brute_force_best(costs, S, embed, head), rel=1e-12)


def test_split_uses_profile_costs_of_the_model():
    spec = load_model_spec("proxy")  # 16 layers: 12 KDA + 4 Gated DSA, dense layer 1, 163840-wide vocab
    costs, embed, head = stage_costs(spec, 4096)
    assert len(costs) == spec.num_layers and head == 6.0 * spec.hidden_size * spec.vocab_size
    stages = split_stages(None, 4, 1, costs, embed, head)
    by_count = [list(range(4 * s, 4 * s + 4)) for s in range(4)]
    assert _max_stage_cost(stages, costs, embed, head) < _max_stage_cost(by_count, costs, embed, head)
    assert len(stages[-1]) < len(stages[1])  # the LM head's stage gets fewer layers


def test_split_rejects_too_many_stages():
    with pytest.raises(ValueError, match="need at least"):
        split_stages(None, 4, 2, [1.0] * 7)


def test_stage_placement():
    assert [stage_ids_for_rank("1f1b", 4, 1, r) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids_for_rank("interleaved_1f1b", 2, 3, r) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    for name in ("zbv", "dualpipev"):
        assert [stage_ids_for_rank(name, 3, 2, r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    with pytest.raises(ValueError, match="unknown schedule"):
        stage_ids_for_rank("looped", 2, 1, 0)


def test_stage_modules_keep_fqns_and_share_weights():
    spec = load_model_spec("tiny")
    model = build_model(spec, "cpu", seed=0)
    full = dict(model.named_parameters())
    first = build_stage_modules(model, [0, 1], True, False)
    last = build_stage_modules(model, [2, 3], False, True)
    names = [set(dict(p.named_parameters())) for p in (first, last)]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(full)
    assert first.norm is None and first.lm_head is None and last.embed is None
    for part in (first, last):
        for n, p in part.named_parameters():
            assert p is full[n]  # shared, not copied
    # a stage run equals the whole model run
    tokens = torch.randint(0, spec.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)
    meta = build_model(spec, "meta")
    assert build_stage_modules(meta, [3], False, True).lm_head.weight.is_meta


# ---------------------------------------------------------------------------------------------------------------
# PP2 vs one process


def make_batch(vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    targets = torch.randint(0, vocab, (B, T), generator=g)
    targets[1, :20] = -100  # micro-batches with different numbers of counted tokens
    return tokens, targets


def _forward_backward_keeps_aux_scale(runner, tokens, targets) -> float:
    """runner.forward_backward, checking that it restores the process-wide aux-loss scale: a leaked scale made a
    later job in the reused rank processes (test_fsdp.py's TP layouts) scale its aux losses differently per rank."""
    from moestack.model import aux_loss

    aux_loss.set_aux_loss_scale(0.5)
    loss = runner.forward_backward(tokens, targets)
    assert aux_loss._SCALE[0] == 0.5, f"forward_backward left the aux-loss scale at {aux_loss._SCALE[0]}"
    aux_loss.set_aux_loss_scale(1.0)
    return loss


def _rel_errs(got: dict, ref: dict, bound: float) -> dict[str, float]:
    """name -> relative error of each gradient above `bound`."""
    errs = {n: float((g.double() - ref[n].double()).norm() / ref[n].double().norm().clamp(min=1e-30))
            for n, g in got.items()}
    return {n: e for n, e in errs.items() if e > bound}


def _close_losses(got: list[float], want: list[float], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0)


@functools.cache
def _reference(spec_json: str, steps: int, dtype: torch.dtype = torch.float64) -> dict:
    """The single-process run every schedule is compared with: loss of each step, gradients (and their norm) after
    the first. It depends only on the spec and the steps, so a rank process makes it once (not once per schedule):
    cached (by the spec's JSON) while the rank pool keeps this module loaded."""
    from moestack.config.model_spec import ModelSpec
    from moestack.model.aux_loss import set_aux_loss_scale

    spec = ModelSpec.model_validate_json(spec_json)
    ref = _build(spec, dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    out = {"ref_loss": []}
    for step in range(steps):
        tokens, targets = make_batch(spec.vocab_size, step)
        set_aux_loss_scale(1.0)
        loss = ref(tokens, targets)
        loss.backward()
        out["ref_loss"].append(loss.item())
        if step == 0:
            out["ref_grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
            out["ref_norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for moe in ref.moe_layers().values():
            moe.router.update_selection_bias()
    return out


def _build(spec, dtype: torch.dtype):
    """The seeded model in `dtype` (with Attention Residuals random pseudo-queries: see _dist.py)."""
    model = build_model(spec, "cpu", seed=0)
    if spec.attn_res_block_size is not None:
        randomise_attn_res(model)
    return model.to(dtype)


def attn_res_spec():
    """The tiny preset with Attention Residuals in blocks of 2 layers: the 4 layers close blocks at layers 0 and 2,
    so stage boundaries see 1 or 2 completed blocks, and one receives the partial sum it closes at once."""
    from moestack.config.model_spec import ModelSpec

    return ModelSpec.model_validate({**load_model_spec("tiny").model_dump(), "attn_res_block_size": 2})


def _pp_worker(rank: int, world_size: int, schedule: str, vpp: int, attn_res: bool = False,
               dtype: torch.dtype = torch.float64) -> dict:
    import torch.distributed as dist

    from moestack.config.plan import make_plan
    from moestack.parallel.pipeline import PipelineStepRunner, stage_state_blocks

    spec = attn_res_spec() if attn_res else load_model_spec("tiny")
    plan = make_plan(model="tiny", cluster="cpu", devices=world_size, seq_len=T, global_batch_size=B,
                     pp=world_size, vpp=vpp, schedule=schedule)
    model = _build(spec, dtype)
    costs, embed, head = stage_costs(spec, T)
    layers = split_stages(model, plan.pp, plan.vpp, costs, embed, head)
    S = plan.pp * plan.vpp
    ids = stage_ids_for_rank(schedule, plan.pp, plan.vpp, rank)
    parts = [build_stage_modules(model, layers[s], s == 0, s == S - 1) for s in ids]
    runner = PipelineStepRunner(parts, ids, plan, dist.group.WORLD, "cpu", hidden_dtype=dtype)
    assert runner.n_microbatches == B

    params = {n: p for part in parts for n, p in part.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=3e-3, weight_decay=0.1)
    out = {"loss": [], "layers": layers, "ids": ids}
    for step in range(STEPS):
        tokens, targets = make_batch(spec.vocab_size, step)
        out["loss"].append(_forward_backward_keeps_aux_scale(runner, tokens, targets))
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
            out["params"] = sorted(params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for part in parts:
            for moe in part.moe_layers().values():
                moe.router.update_selection_bias()
    out["state_blocks"] = [stage_state_blocks(p) for p in parts]
    if rank == 0:
        ref = _reference(spec.model_dump_json(), STEPS, dtype)
        out.update(ref_loss=ref["ref_loss"], ref_grads=ref["ref_grads"])
    return out


CONFIGS = {"1f1b": 1, "gpipe": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}  # float64
ATTN_RES = {"1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}  # float64, Attention Residuals
FP32_SMOKE = "1f1b"


def _all_worker(rank: int, world_size: int) -> dict:
    out = {name: _pp_worker(rank, world_size, name, vpp) for name, vpp in CONFIGS.items()}
    out |= {f"attn_res_{name}": _pp_worker(rank, world_size, name, vpp, attn_res=True)
            for name, vpp in ATTN_RES.items()}
    out["fp32"] = _pp_worker(rank, world_size, FP32_SMOKE, CONFIGS[FP32_SMOKE], dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def pp2_results() -> dict:
    results = run_ranks(__file__, "_all_worker", world_size=2, timeout=300)
    return {name: [r[name] for r in results] for name in results[0]}


def _check_pp2(r0: dict, r1: dict, S: int, rtol: dict[str, float]) -> None:
    assert len(r0["layers"]) == S and sorted(r0["ids"] + r1["ids"]) == list(range(S))
    _close_losses(r0["loss"], r0["ref_loss"], rtol["loss"])
    assert r1["loss"] == r0["loss"]  # broadcast to every pipeline rank
    assert set(r0["params"]).isdisjoint(r1["params"])
    grads = {**r0["grads"], **r1["grads"]}
    ref = r0["ref_grads"]
    assert grads.keys() == ref.keys(), "every parameter lives on exactly one stage and gets a gradient"
    bad = _rel_errs(grads, ref, rtol["grad"])
    assert not bad, f"gradients differ from the single-process run: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(CONFIGS))
def test_pp2_matches_single_process(pp2_results, schedule):
    r0, r1 = pp2_results[schedule]
    assert r0["grads"][next(iter(r0["grads"]))].dtype == torch.float64
    _check_pp2(r0, r1, 2 * CONFIGS[schedule], FP64)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(ATTN_RES))
def test_pp2_attention_residuals_match_single_process(pp2_results, schedule):
    """Attention Residuals (blocks of 2): the stacked block state [n + 1, B, T, D] crosses every stage boundary;
    float64 loss of 3 steps and every gradient after the first within 1e-10 of the single process."""
    r0, r1 = pp2_results[f"attn_res_{schedule}"]
    blocks = dict(zip(r0["ids"] + r1["ids"], r0["state_blocks"] + r1["state_blocks"]))
    n_in = [blocks[s][0] for s in sorted(blocks) if s > 0]
    assert all(n >= 1 for n in n_in) and (len(blocks) == 2 or len(set(n_in)) > 1), blocks  # stacks of several sizes
    _close_losses(r0["loss"], r0["ref_loss"], FP64["loss"])
    assert r1["loss"] == r0["loss"]
    grads = {**r0["grads"], **r1["grads"]}
    ref = r0["ref_grads"]
    assert grads.keys() == ref.keys() and any("_res." in n for n in grads)
    bad = _rel_errs({n: g for n, g in grads.items() if ref[n].any()}, ref, FP64["grad"])
    assert not bad, f"gradients differ from the single-process run: {bad}"
    zero = sorted(n for n, g in ref.items() if not g.any())
    assert zero == sorted(ATTN_RES_ZERO_GRAD), zero


@pytest.mark.slow
def test_pp2_fp32_smoke(pp2_results):
    r0, r1 = pp2_results["fp32"]
    assert r0["grads"][next(iter(r0["grads"]))].dtype == torch.float32
    _check_pp2(r0, r1, 2 * CONFIGS[FP32_SMOKE], FP32)


# ---------------------------------------------------------------------------------------------------------------
# PP2 x TP2 (sequence parallel) on 4 ranks vs one process


def _pp_tp_worker(rank: int, world_size: int, schedule: str, vpp: int, tie: bool = False, steps: int = STEPS
                   ) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from moestack.config.model_spec import ModelSpec
    from moestack.config.plan import make_plan
    from moestack.parallel.comm import global_grad_norm
    from moestack.parallel.pipeline import PipelineStepRunner
    from moestack.parallel.tensor import apply_tp
    from moestack.train.expert_load import reduce_router_state

    data = load_model_spec("tiny").model_dump()
    data["moe"]["router"]["seq_aux_loss_coef"] = 0.0  # token-sharded MoE: see test_tensor.py
    data["tie_word_embeddings"] = tie
    spec = ModelSpec.model_validate(data)
    plan = make_plan(model="tiny", cluster="cpu", devices=world_size, seq_len=T, global_batch_size=B,
                     pp=2, tp=2, vpp=vpp, schedule=schedule)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_rank = mesh.get_local_rank("pp")
    model = build_model(spec, "cpu", seed=0).double()
    costs, embed, head = stage_costs(spec, T)
    layers = split_stages(model, plan.pp, plan.vpp, costs, embed, head)
    S = plan.pp * plan.vpp
    ids = stage_ids_for_rank(schedule, plan.pp, plan.vpp, pp_rank)
    parts = [build_stage_modules(model, layers[s], s == 0, s == S - 1) for s in ids]
    for part in parts:
        apply_tp(part, mesh["tp"], sequence_parallel=True)
    runner = PipelineStepRunner(parts, ids, plan, mesh["pp"].get_group(), "cpu", seq_shards=2,
                                hidden_dtype=torch.float64)

    params = {n: p for part in parts for n, p in part.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=3e-3, weight_decay=0.1)
    out = {"loss": []}
    for step in range(steps):
        tokens, targets = make_batch(spec.vocab_size, step)
        out["loss"].append(_forward_backward_keeps_aux_scale(runner, tokens, targets))
        if step == 0:
            out["grads"] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                            for n, p in params.items() if p.grad is not None}
            out["norm"] = float(global_grad_norm(list(params.values()), mesh["pp"].get_group()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        for part in parts:  # token-sharded MoE: the router state adds up over the TP group (as the trainer's)
            reduce_router_state(part.moe_layers(), mesh["tp"].get_group())
            for moe in part.moe_layers().values():
                moe.router.update_selection_bias()
    if rank == 0:  # the tied test's two schedules share one reference run
        out.update(_reference(spec.model_dump_json(), steps))
    return out


@pytest.mark.slow
def test_pp2_tp2_interleaved_matches_single_process():
    results = run_ranks(__file__, "_pp_tp_worker", world_size=4, timeout=300, schedule="interleaved_1f1b", vpp=2)
    r0 = results[0]
    _close_losses(r0["loss"], r0["ref_loss"], FP64["loss"])
    assert all(r["loss"] == r0["loss"] for r in results)
    grads = {}
    for r in results:  # ranks of one TP group hold the same (full) gradients
        grads.update(r["grads"])
    ref = r0["ref_grads"]
    assert grads.keys() == ref.keys()
    bad = _rel_errs(grads, ref, FP64["grad"])
    assert not bad, f"gradients differ from the single-process run: {bad}"


# ---------------------------------------------------------------------------------------------------------------
# tied embeddings under PP2 x TP2: the first stage's embedding and the last stage's head are copies of one weight
# whose gradients the runner sums (on one rank for V-shapes, between pipeline ranks otherwise)

TIED = {"1f1b": 1, "zbv": 2}  # first and last stage on different ranks / on one rank


def _tied_worker(rank: int, world_size: int) -> dict:
    return {name: _pp_tp_worker(rank, world_size, name, vpp, tie=True, steps=2) for name, vpp in TIED.items()}


@pytest.mark.slow
def test_pp2_tp2_tied_embeddings_match_single_process():
    results = run_ranks(__file__, "_tied_worker", world_size=4, timeout=300)
    for name in TIED:
        per_rank = [r[name] for r in results]
        r0 = per_rank[0]
        # the losses of step 2 see the updated weights: the tie held through the optimizer step
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(r0["loss"], r0["ref_loss"]))
        assert loss_err < FP64["loss"], f"{name}: loss rel err {loss_err:.2e} ({r0['loss']} vs {r0['ref_loss']})"
        assert all(r["loss"] == r0["loss"] for r in per_rank)
        assert all(abs(r["norm"] - r0["ref_norm"]) < FP64["grad"] * r0["ref_norm"] for r in per_rank), (
            name, [r["norm"] for r in per_rank], r0["ref_norm"])  # the tied gradient counts once in the norm
        ref = r0["ref_grads"]  # named_parameters() lists the tied weight once, as embed.weight
        assert "lm_head.weight" not in ref
        grads = {}
        for r in per_rank:
            grads.update(r["grads"])
        assert "embed.weight" in grads and "lm_head.weight" in grads
        ref = {**ref, "lm_head.weight": ref["embed.weight"]}  # both copies carry the whole tied gradient
        assert grads.keys() == ref.keys()
        bad = _rel_errs(grads, ref, FP64["grad"])
        assert not bad, f"{name}: gradients differ from the single-process run: {bad}"

