"""The cost model against published training runs, each evaluated with `--fix` on its published configuration.

Published numbers (reported TFLOP/s per GPU, or seconds per step) must be reproduced within 15%. What a
publication does not state is written in `fix` with the reason (see "Planner validation" in benchmarks/RESULTS.md); choices left
open are made by the planner (the fastest plan that fits our memory model).
"""

from __future__ import annotations

import dataclasses

import pytest

from moestack.planner.calibration import HostCalibration
from moestack.planner.search import evaluate_fixed, load_problem, parse_fix

CASES = [
    # name, model, cluster, devices, seq_len, fix, metric, published
    ("deepseek-v3-h100-fp8", "tests/data/hf_configs/deepseek-v3.config.json", "h100-cluster", 1024, 4096,
     # Megatron-Bridge DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1: recompute_modules [mla_up_proj, mlp], hybridep
     # dispatcher (hierarchical), moe_a2a_overlap False, distributed optimizer (ZeRO-1), MTP 1 layer
     "tp=2,pp=8,vpp=4,ep=64,etp=1,cp=1,mbs=1,gbs=8192,schedule=interleaved_1f1b,zero=1,precision=fp8,ep_dispatch=fp8,"
     "recompute=attention:selective+mlp:full,dispatcher=hierarchical,ep_overlap=false,offload=none",
     "tflops", 338.0),
    ("llama3-405b-8k-h100", "tests/data/planner/llama3-405b.yaml", "h100-cluster", 8192, 8192,
     # Llama 3 paper Table 4: TP8 CP1 PP16 DP64, 16M tokens/batch (2048 x 8192), bf16. FSDP with fp32 gradient
     # accumulation and one fp32 reduce-scatter per step (ZeRO-1 communication); TP comm not overlapped
     # (not described); vpp and recompute chosen by the planner
     "tp=8,pp=16,cp=1,dp=64,mbs=1,gbs=2048,schedule=interleaved_1f1b,zero=1,offload=none,tp_overlap=false",
     "tflops", 430.0),
    ("llama3-405b-16k-h100", "tests/data/planner/llama3-405b.yaml", "h100-cluster", 16384, 8192,
     "tp=8,pp=16,cp=1,dp=128,mbs=1,gbs=2048,schedule=interleaved_1f1b,zero=1,offload=none,tp_overlap=false",
     "tflops", 400.0),
    ("gpt3-175b-a100-full", "tests/data/planner/gpt3-175b.yaml", "a100-cluster", 64, 2048,
     # Korthikanti et al. 2022 Table 4: TP8 PP8 (interleaved, v=3), GBS 64, full recompute; 2022 Megatron had no
     # TP-comm overlap and no distributed optimizer (DP = 1 anyway)
     "tp=8,pp=8,vpp=3,dp=1,mbs=1,gbs=64,schedule=interleaved_1f1b,recompute=full,tp_overlap=false,zero=0,"
     "offload=none", "step_s", 18.13),
    ("gpt3-175b-a100-selective-sp", "tests/data/planner/gpt3-175b.yaml", "a100-cluster", 64, 2048,
     "tp=8,pp=8,vpp=3,dp=1,mbs=1,gbs=64,schedule=interleaved_1f1b,recompute=selective,tp_overlap=false,zero=0,"
     "offload=none", "step_s", 13.75),
]


def run_case(model, cluster, devices, seq, fix):
    problem = load_problem(model, cluster, devices, seq)
    # these are Megatron-LM runs: Calibration.host prices moestack's eager trainer (its Python and launches per
    # layer), not Megatron's fused, graph-captured steps, whose host time the publications do not show
    no_host = HostCalibration(layer_s=0.0, ep_moe_s=0.0, tp_layer_s=0.0, fp8_layer_s=0.0)
    problem = dataclasses.replace(problem, cal=problem.cal.model_copy(update={"host": no_host}))
    result = evaluate_fixed(problem, parse_fix(fix))
    assert result.best is not None
    return result.best


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_published_run_within_15_percent(case):
    name, model, cluster, devices, seq, fix, metric, published = case
    cost = run_case(model, cluster, devices, seq, fix)
    pred = cost.tflops_per_device if metric == "tflops" else cost.step_time_s
    err = pred / published - 1
    assert abs(err) <= 0.15, f"{name}: predicted {pred:.2f} vs published {published} ({err:+.1%})"


def test_korthikanti_recompute_ratio():
    """Selective recompute + SP vs full recompute: published 18.13 / 13.75 = 1.32x; the model must see most of it."""
    full = run_case(*CASES[3][1:6])
    sel = run_case(*CASES[4][1:6])
    assert full.step_time_s / sel.step_time_s == pytest.approx(18.13 / 13.75, rel=0.05)


def test_llama3_scaling_direction():
    """16384 GPUs (DP128, 16 micro-batches per step) lose a larger share of the step to the pipeline bubble than
    8192 (DP64, 32 micro-batches), the cause of the paper's 430 -> 400 drop; per-GPU TFLOP/s stay within 10%
    (the planner's recompute choice differs between the two: only 8192 needs MLP recompute to fit)."""
    a = run_case(*CASES[1][1:6])
    b = run_case(*CASES[2][1:6])
    assert b.time["pp_bubble"] / b.step_time_s > a.time["pp_bubble"] / a.step_time_s
    assert b.tflops_per_device == pytest.approx(a.tflops_per_device, rel=0.10)
