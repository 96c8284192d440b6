"""PhasePeaks (moestack/memory/phase_peaks.py) on CPU with a fake allocator reader: the phase labels of one step
(forward, loss + head backward, one per layer in reverse order, clip + optimizer), no duplicate layer marks under
recompute, DTensor block outputs; `moestack train --set phase_peaks_step=N` writes the per-rank files without
changing the step's numbers, on one process and on 2 gloo ranks (torchrun, EP2 x ZeRO-3); bad values are one-line
errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moestack.cli.app import main
from moestack.config.plan import RecomputePolicy
from moestack.memory.phase_peaks import GIB, MemoryReader, PhasePeaks
from moestack.memory.recompute import apply_recompute
from moestack.model.transformer import build_model

_REPO = Path(__file__).resolve().parents[2]


class FakeReader:
    """Counts calls; the peak grows by 1 GiB per reading so every phase has its own value."""

    def __init__(self):
        self.calls = {"max": 0, "now": 0, "reset": 0}

    def reader(self) -> MemoryReader:
        def peak():
            self.calls["max"] += 1
            return self.calls["max"] * GIB

        def now():
            self.calls["now"] += 1
            return 0

        def reset():
            self.calls["reset"] += 1

        return MemoryReader(peak, now, reset)


def _step(model, peaks: PhasePeaks, keep_in_forward: bool = False) -> None:
    """The trainer's step with marks (benchmarks/memory.py train_step)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.spec.vocab_size, (2, 16), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    peaks.mark("forward")
    peaks.in_forward = True
    loss = model(tokens, tokens)
    peaks.in_forward = keep_in_forward
    peaks.mark("loss + head backward")
    loss.backward()
    peaks.mark("clip + optimizer")
    opt.step()
    opt.zero_grad(set_to_none=True)


def _expected(names) -> list[str]:
    return ["forward", "loss + head backward", *[f"layer {n} backward" for n in reversed(names)], "clip + optimizer"]


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_phase_labels_on_the_model(small_spec, recompute):
    model = build_model(small_spec, "cpu", seed=0)
    if recompute != "none":
        apply_recompute(model, RecomputePolicy.uniform(recompute))
    fake = FakeReader()
    peaks = PhasePeaks(model, torch.device("cpu"), reader=fake.reader())
    _step(model, peaks, keep_in_forward=True)  # armed through backward: the recompute rerun must add nothing
    marks = peaks.close()
    assert [m["phase"] for m in marks] == _expected(list(model.layers))
    assert [m["peak_gib"] for m in marks] == [float(i) for i in range(2, len(marks) + 2)]  # 1st read: prior peak
    assert peaks.prior_peak_bytes == GIB and peaks.run_peak_bytes == (len(marks) + 1) * GIB
    assert fake.calls["reset"] == len(marks) + 1 and fake.calls["now"] == len(marks)
    assert peaks.largest()["phase"] == "clip + optimizer"
    assert not peaks.handles and all(not blk._forward_hooks for blk in model.layers.values())


def test_default_reader_off_cuda_reads_zero(small_spec):
    model = build_model(small_spec, "cpu", seed=0)
    peaks = PhasePeaks(model, torch.device("cpu"))
    _step(model, peaks)
    marks = peaks.close()
    assert [m["phase"] for m in marks] == _expected(list(model.layers))
    assert all(m["peak_gib"] == 0 and m["end_gib"] == 0 for m in marks)


class _Toy(nn.Module):
    """Linear blocks; `whole` checkpoints all blocks at once (the blocks' own __call__ reruns in backward, hooks and
    all); `dtensor_mesh` makes every block output a DTensor."""

    def __init__(self, n: int = 3, whole: bool = False, dtensor_mesh=None):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(n)})
        self.whole, self.mesh = whole, dtensor_mesh
        if dtensor_mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            for blk in self.layers.values():
                blk.register_forward_hook(
                    lambda _m, _i, out: DTensor.from_local(out, dtensor_mesh, [Replicate()], run_check=False))

    def _blocks(self, h):
        for blk in self.layers.values():
            h = blk(h)
            if self.mesh is not None:
                h = h.to_local()
        return h

    def forward(self, x):
        return checkpoint(self._blocks, x, use_reentrant=False) if self.whole else self._blocks(x)


def _toy_marks(model, microbatches: int = 1) -> list[str]:
    peaks = PhasePeaks(model, reader=FakeReader().reader(), microbatches=microbatches)
    peaks.in_forward = True  # armed for the whole step, as the trainer does under pipeline parallelism
    for _ in range(microbatches):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    return [m["phase"] for m in peaks.close()]


def test_recompute_inside_backward_adds_no_marks():
    assert _toy_marks(_Toy(whole=True)) == ["layer 2 backward", "layer 1 backward", "layer 0 backward"]
    # micro-batches counted per block
    assert _toy_marks(_Toy(2), microbatches=2) == ["layer 1 backward (mb 0)", "layer 0 backward (mb 0)",
                                                   "layer 1 backward (mb 1)", "layer 0 backward (mb 1)"]


def test_dtensor_block_outputs(cpu_mesh):
    assert _toy_marks(_Toy(dtensor_mesh=cpu_mesh)) == ["layer 2 backward", "layer 1 backward", "layer 0 backward"]


def test_pipeline_stage_views_share_blocks(small_spec):
    """A list of stage modules (blocks reached twice are hooked once), with stage marks per micro-batch."""
    from moestack.parallel.pipeline import build_stage_modules

    model = build_model(small_spec, "cpu", seed=0)
    first, last = build_stage_modules(model, [0], True, False), build_stage_modules(model, [1], False, True)
    peaks = PhasePeaks([first, last, model], reader=FakeReader().reader(), microbatches=2,
                       stage_marks={0: first, 1: last}, last_stage=1)
    assert peaks.layer_names == ["0", "1"]
    peaks.in_forward = True
    tokens = torch.randint(0, small_spec.vocab_size, (1, 8))
    for _ in range(2):
        first(tokens).sum().mul(0).add(last(model.embed(tokens)).sum()).backward()
    phases = [m["phase"] for m in peaks.close()]
    assert phases[:2] == ["stage 0 forward (mb 0)", "stage 0 after forward (mb 0)"]
    assert "stage 1 loss + head backward (mb 1)" in phases and "layer 1 backward (mb 1)" in phases


# ---------------------------------------------------------------------------------------------------------------
# moestack train --set phase_peaks_step=N

ARGS = ["train", "--steps", "3", "-q", "--batch-size", "2", "--seq-len", "16", "--device", "cpu",
        "--set", "logging.tensorboard=false", "--set", "logging.every=1", "--set", "eval_every=0",
        "--set", "checkpoint.every=0", "--set", "checkpoint.save_final=false", "--set", "grad_accum_steps=2"]


def _logged(run) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]


def test_train_phase_peaks_step_single_process(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*ARGS, "--out", str(out), "--set", "phase_peaks_step=2"]) == 0
    assert "phase peaks, step 2, rank 0: largest" in capsys.readouterr().out.replace("\n", " ")
    marks = json.loads((out / "phase_peaks_rank0.json").read_text())
    layers = [f"layer {i} backward" for i in reversed(range(4))]
    assert [m["phase"] for m in marks] == [
        *[p for k in range(2) for p in (f"forward (mb {k})", f"loss + head backward (mb {k})",
                                        *[f"{lay} (mb {k})" for lay in layers])], "clip + optimizer"]
    assert all(set(m) == {"phase", "peak_gib", "end_gib"} for m in marks)
    # only hooks and allocator resets: the same losses and gradient norms as without
    assert main([*ARGS, "--out", str(tmp_path / "plain")]) == 0
    assert _logged(out) == _logged(tmp_path / "plain") and len(_logged(out)) == 3


@pytest.mark.parametrize("value", ["0", "4", "-1"])
def test_bad_phase_peaks_step_is_a_one_line_error(tmp_path, capsys, value):
    assert main([*ARGS, "--out", str(tmp_path / "run"), "--set", f"phase_peaks_step={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "phase_peaks_step" in err and "1 <= N <= steps" in err, err
    assert "\n" not in err and not (tmp_path / "run").exists()


def test_torchrun_two_ranks_write_phase_peaks(tmp_path):
    """2 gloo ranks through torchrun: EP2 x ZeRO-3 (FSDP2), two micro-batches per step."""
    sys.path.insert(0, str(_REPO / "tests" / "parallel"))
    from _dist import small_model_spec

    from moestack.config.base import dump_yaml
    from moestack.config.plan import make_plan, save_plan

    spec = small_model_spec()
    dump_yaml(spec, tmp_path / "model.yaml")
    plan = make_plan(model=str(tmp_path / "model.yaml"), cluster="cpu", devices=2, seq_len=16, global_batch_size=4,
                     micro_batch_size=1, dp_shard=2, zero_stage=3, ep=2)
    save_plan(plan, tmp_path / "plan.yaml")
    run = tmp_path / "run"
    sets = {"logging.tensorboard": "false", "logging.progress": "false", "eval_every": 0, "data.eval_fraction": 0.0,
            "checkpoint.every": 0, "checkpoint.save_final": "false", "phase_peaks_step": 2}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moestack",
           "train", "--plan", str(tmp_path / "plan.yaml"), "--out", str(run), "--steps", "2", "-q",
           *[f"--set={k}={v}" for k, v in sets.items()]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
    proc = subprocess.run(cmd, check=False, cwd=_REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.replace("\n", " ").count("phase peaks, step 2, rank 0") == 1  # rank 0 alone logs
    mb = plan.num_microbatches
    layers = [f"layer {i} backward" for i in reversed(range(spec.num_layers))]
    expected = [*[p for k in range(mb) for p in (f"forward (mb {k})", f"loss + head backward (mb {k})",
                                                 *[f"{lay} (mb {k})" for lay in layers])], "clip + optimizer"]
    for rank in range(2):
        marks = json.loads((run / f"phase_peaks_rank{rank}.json").read_text())
        assert [m["phase"] for m in marks] == expected, (rank, marks)
