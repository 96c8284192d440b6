"""Meta-device initialisation (moestack/parallel/init.py, moestack/model/init.py): a model built on meta, parallelised
and materialised shard by shard holds exactly the values of the full build sliced, at every layout.

On 4 gloo ranks the trainer builds each plan twice from the same seed, once whole then sharded (meta_init off) and
once on meta (meta_init on: no rank ever holds a whole tensor); every local shard must be bitwise equal, each
gathered DTensor equal to the single-device `build_model` of that seed (so training from either is the same run).
The layouts cover TP (column / row / head shards), EP and ETP (strided gate/up shards), FSDP over them (ZeRO-3,
HSDP: nested Shard / _StridedShard placements) and PP with a tied embedding (the head copy of a partial stage).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dist import run_ranks, small_model_spec  # noqa: E402

from moestack.model.init import init_model, plain_locate  # noqa: E402
from moestack.model.transformer import build_model  # noqa: E402

SEQ = 16
LAYOUTS = {
    "tp2_ep2_zero3": {"tp": 2, "ep": 2, "dp_shard": 2, "zero_stage": 3},
    "tp2_ep2_etp2_zero3": {"tp": 2, "ep": 2, "etp": 2, "dp_shard": 2, "zero_stage": 3},
    "hsdp_ep4": {"ep": 4, "dp_replicate": 2, "dp_shard": 2, "zero_stage": 3},
    "pp2_tp2_tied": {"pp": 2, "vpp": 2, "tp": 2, "schedule": "interleaved_1f1b", "tie": True},
}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _worker(rank: int, world: int, layout: dict, out_dir: str) -> dict:
    from torch.distributed.tensor import DTensor

    from moestack.config.plan import make_plan
    from moestack.config.train_spec import load_train_spec
    from moestack.train.trainer import Trainer

    layout = dict(layout)
    spec_model = small_model_spec()
    if layout.pop("tie", False):
        spec_model = spec_model.model_copy(update={"tie_word_embeddings": True})
    dp = layout.get("dp_shard", 1) * layout.get("dp_replicate", 1)
    plan = make_plan(model="tiny", cluster="cpu", devices=world, seq_len=SEQ, global_batch_size=4 * dp,
                     micro_batch_size=1, **layout)
    out = {}
    for meta in ("off", "on"):
        spec = load_train_spec(None, {"seq_len": SEQ, "steps": 1, "meta_init": meta, "out_dir": f"{out_dir}/{meta}",
                                      "logging.progress": False, "logging.tensorboard": False, "eval_every": 0,
                                      "data.eval_fraction": 0.0})
        trainer = Trainer(spec, spec_model, log=lambda *a, **k: None, plan=plan)
        model = trainer.model
        state = {n: _local(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        nwd = sorted(n for n, p in model.named_parameters() if getattr(p, "_no_weight_decay", False))
        full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach().clone()
                for n, p in model.named_parameters()}
        out[meta] = {"state": state, "full": full, "nwd": nwd}
        trainer.close()
    return out


@pytest.fixture(scope="module")
def init_results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("meta_init")
    return {name: run_ranks(__file__, "_worker", world_size=4, timeout=300, layout=layout, out_dir=str(tmp / name))
            for name, layout in LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_init_equals_the_sliced_full_build(init_results, layout):
    spec = small_model_spec()
    if LAYOUTS[layout].get("tie"):
        spec = spec.model_copy(update={"tie_word_embeddings": True})
    ref = dict(build_model(spec, "cpu", seed=0).named_parameters())
    for rank, result in enumerate(init_results[layout]):
        off, on = result["off"], result["on"]
        assert off["state"].keys() == on["state"].keys()
        for name, value in off["state"].items():
            assert torch.equal(value, on["state"][name]), f"rank {rank}: {name} differs between the two builds"
        for name, value in on["full"].items():  # the gathered shards are the single-device build
            want = ref["embed.weight" if name == "lm_head.weight" and spec.tie_word_embeddings else name]
            assert torch.equal(value, want.detach()), f"rank {rank}: {name} is not the full build's value"
        assert on["nwd"] == off["nwd"] and any(n.endswith("A_log") for n in on["nwd"])  # tags survive FSDP


def test_init_model_is_deterministic_and_layout_free():
    """Same seed, same values; another seed, other values; the distributions of init_weights."""
    spec = small_model_spec()
    a, b, c = (dict(build_model(spec, "cpu", seed=s).named_parameters()) for s in (5, 5, 6))
    for name, p in a.items():
        assert torch.equal(p, b[name]), name
        if p.numel() > 8 and p.std() > 0:
            assert not torch.equal(p, c[name]), name
    w = a["layers.0.attn.q_proj.weight"].detach()
    assert abs(float(w.std()) - spec.init_std) < 0.1 * spec.init_std
    A = a["layers.0.attn.A_log"].exp()
    assert ((A >= 1) & (A <= 16)).all()
    assert torch.equal(a["layers.0.attn_norm.weight"], torch.ones_like(a["layers.0.attn_norm.weight"]))


def test_init_model_writes_any_row_and_column_subset():
    """A shard given by global indices gets exactly those elements of the whole tensor (rule tensors drawn per row
    block: rows from two blocks, uneven columns)."""
    from moestack.model import init as init_mod

    spec = small_model_spec()
    whole = dict(build_model(spec, "cpu", seed=3).named_parameters())
    model = build_model(spec, "cpu", seed=0)
    picks = {"embed.weight": (torch.tensor([3, 70, 5]), torch.tensor([1, 0, 63])),
             "layers.1.ffn.experts.w_gate_up": (torch.tensor([7, 0]), None, torch.tensor([2, 9]))}
    old = init_mod.BLOCK_ELEMS
    init_mod.BLOCK_ELEMS = 64 * 4  # 4 embedding rows per block: the picks span several blocks
    try:
        full = dict(build_model(spec, "cpu", seed=3).named_parameters())
        shards = {}

        def locate(t):
            for name, p in model.named_parameters():
                if p is t and name in picks:
                    index = picks[name]
                    shape = [len(i) if i is not None else n for i, n in zip(index, p.shape)]
                    shards[name] = torch.full(shape, float("nan"))
                    return shards[name], index
            return plain_locate(t)

        init_model(model, 3, "cpu", locate)
    finally:
        init_mod.BLOCK_ELEMS = old
    for name, index in picks.items():
        want = full[name]
        for d, i in enumerate(index):
            if i is not None:
                want = want.index_select(d, i)
        assert torch.equal(shards[name], want.detach()), name
    # the block size is part of the values: the default build differs from the small-block one
    assert not torch.equal(whole["embed.weight"], full["embed.weight"])
