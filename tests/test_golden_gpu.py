"""GPU golden run: a small hybrid model (KDA x3 + Gated DSA sparse, a dense layer, LatentMoE with a shared expert)
at the fast kernels' real head shapes (KDA head_dim 128; DSA latent 512 + rope 64, 16 heads; indexer head_dim
128, top-k 256 of 1024 keys) trained STEPS steps by the Trainer on one GPU (bf16 autocast, fp32 master weights,
AdamW, clipping, router bias updates) with the default CUDA backends (the Triton / Gluon kernels, the fused KDA
layer ops), then again with the plain-PyTorch reference ops everywhere (`REFERENCE_KERNELS`), same seed, same
data. It checks each fused kernel's weight gradients through the whole model, which the op tests check one by
one: a weight gradient 70% off in one kernel (the KDA gated norm's autotuning bug of issue #26) shows here as a
parameter whose gradient norm differs by tens of percent.

Loss bounds, from the measured noise floor. The fast kernels and the reference ops round the same math at bf16 in
different places, and this run amplifies any such difference where its loss falls fastest (steps 7-9: 4.18 ->
4.17 -> 3.54). Measured on the H200 (2026-12-03, benchmarks/RESULTS.md "The golden run's noise floor"): twelve
bf16 variants of the run, each op on its fast or on its reference path (the reference ops with one op fast, the
fast kernels with one op on its reference, both ends), all legitimate forms of the same math: their losses differ
from each other by up to 8.1e-2 at one step (step 8) and by up to 1.39e-2 averaged over the 30 steps. In fp32 (no
autocast) every fast op but KDA's chunk kernel (then bf16-only on the GPU) follows the fp32 reference: the
fused KDA layer ops within 6.0e-4 at every step, the DSA, routing and expert-GEMM kernels (tf32 dots) within
1.4e-2. So a per-step bound at bf16 rounding (3e-2, as before) measured the steep steps' sensitivity, not the kernels:
it failed 3 of 5 times (calls J, K, L). What is bounded now is the mean of three fast runs (DSA's backward adds
with atomics, so fast runs differ from each other) against the bf16 reference: averaged over the steps within
LOSS_MEAN_RTOL = 2.5e-2 (1.8x the variants' largest, 1.39e-2), and at every step within LOSS_STEP_RTOL = 1.5e-1
(1.9x their largest, 8.1e-2; a run that diverges or stalls fails it). The per-parameter gradient norms below are
the tight check of each kernel.

The gradient norms after the first backward (same weights, same batch) are compared per parameter. The same proxy
put most parameters' gradient norms within a few u32 of fp64, but some far more: 138 u32 for the indexer's
k_norm.bias, 124 u32 for a KDA A_log (sums with cancellation), i.e. at bf16 up to ~50%. So the bound is measured in
the run itself: one more first step with the reference ops in fp32 (no autocast) gives each parameter's bf16 noise
d_p = |norm(ref bf16) - norm(ref fp32)| / norm(ref fp32), and the fast run's norm must lie within
max(GRAD_RTOL, 3 d_p) of the fp32 one, GRAD_RTOL = 5% (a few percent, as the rounding of a norm of thousands of
elements allows). d_p is one draw of the rounding error: it is pooled (the largest) over the layers of one role
(`layers.*.attn.A_log`), whose sums cancel alike (H200, 2026-12-02: a KDA A_log drew d_p < 1.7% in layer 0 and
13.7% in layer 1 of the same run, and the fast run's layer-0 norm was 5.6% off). A parameter whose noise alone
exceeds the floor is listed in the failure message with its d_p.

GPU only: on CPU the fused layer ops do not run (they are CUDA-only) and the interpreter would take minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

STEPS, SEQ, MBS = 30, 1024, 4
LOSS_MEAN_RTOL = 2.5e-2  # the loss over the 30 steps, mean relative difference (module docstring: measured floor)
LOSS_STEP_RTOL = 1.5e-1  # the loss at any step (module docstring)
GRAD_RTOL = 5e-2  # floor of the per-parameter gradient-norm bound (module docstring)

# The one place that says "reference ops everywhere": KernelSpec fields (moestack/config/kernel_spec.py)
REFERENCE_KERNELS = {"kernels.kda.backend": "reference", "kernels.kda.layer_ops": "torch",
                     "kernels.dsa.backend": "reference", "kernels.moe.routing": "reference",
                     "kernels.moe.gemm": "reference"}
OPS = ("kda.backend", "kda.layer_ops", "dsa.backend", "moe.routing", "moe.gemm")


def selected_backends(out_dir) -> dict[str, str]:
    """What each op ran, as the run directory's kernels.json records it (to check the two runs really differ)."""
    record = json.loads((Path(out_dir) / "kernels.json").read_text())["kernels"]
    return {op: record[op]["runs"].split(" ")[0] for op in OPS}


def golden_spec():
    from moestack.config.model_spec import ModelSpec

    return ModelSpec.model_validate({
        "name": "golden", "vocab_size": 2048, "hidden_size": 1024, "num_layers": 4, "max_seq_len": SEQ,
        "full_attention_layers": [4], "dense_layers": [1], "attention": "mla", "linear_attention": "kda",
        "kda": {"num_heads": 8, "head_dim": 128, "conv_kernel_size": 4, "gate": "k3", "gate_lower_bound": -5.0,
                "gate_rank": 128},
        "mla": {"num_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "use_rope": False, "output_gate": True,
                "indexer": {"num_heads": 8, "head_dim": 128, "top_k": 256}},
        "moe": {"num_experts": 32, "top_k": 4, "expert_intermediate_size": 256, "latent_size": 512,
                "latent_norm": True, "num_shared_experts": 1, "shared_intermediate_size": 1024,
                "router": {"score": "sigmoid", "renormalize": True, "scaling_factor": 1.0, "selection_bias": True,
                           "bias_update_rate": 1.0e-3, "seq_aux_loss_coef": 1.0e-4}},
        "dense_mlp": {"intermediate_size": 2048}, "activation": "situ_glu", "norm_eps": 1.0e-5})


def train(out_dir, steps: int, precision: str = "auto", device: str = "cuda", kernels: dict | None = None) -> dict:
    """The Trainer: per-step losses and every parameter's gradient norm at the first step (before clipping), with
    the kernel choices `kernels` ({"kernels.x.y": value}; None = the defaults)."""
    from moestack.config.train_spec import load_train_spec
    from moestack.train.trainer import Trainer

    opts = {"seq_len": SEQ, "micro_batch_size": MBS, "steps": steps, "precision": precision, "device": device,
            "seed": 0, "logging.every": 1, "logging.tensorboard": False, "logging.progress": False, "eval_every": 0,
            "data.eval_fraction": 0.0, "schedule.warmup_steps": 5, "optimizer.lr": 3e-4, "optimizer.grad_clip": 1.0,
            "checkpoint.every": 0, "checkpoint.save_final": False, "out_dir": str(out_dir), **(kernels or {})}
    trainer = Trainer(load_train_spec(None, opts), golden_spec(), log=lambda *a: None)
    norms: dict[str, float] = {}
    grad_norm = trainer._grad_norm

    def recording(params):
        if not norms:
            # trainer: the enclosing function's variable, read while fit() runs (ruff reads the `del` below as unbound)
            norms.update({n: float(p.grad.double().norm()) for n, p in trainer.model.named_parameters()  # noqa: F821
                          if p.grad is not None})
        return grad_norm(params)

    trainer._grad_norm = recording
    losses = trainer.fit()["losses"]
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"losses": losses, "norms": norms, "kernels": selected_backends(out_dir)}


def _role(name: str) -> str:
    """A parameter's role: its name without the layer index (layers.3.attn.A_log -> layers.*.attn.A_log)."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() and i > 0 and parts[i - 1] == "layers" else p for i, p in enumerate(parts))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(540)
def test_golden_run_fast_kernels_match_reference_ops(tmp_path):
    fast = train(tmp_path / "fast", STEPS)
    fast_sel = fast["kernels"]
    assert fast_sel["kda.backend"] == "triton" and fast_sel["dsa.backend"] == "triton" \
        and fast_sel["moe.routing"] == "triton" and fast_sel["kda.layer_ops"] == "triton", fast_sel
    again = [train(tmp_path / f"fast_again{i}", STEPS) for i in range(2)]  # the fast kernels' spread (module doc)
    ref = train(tmp_path / "ref", STEPS, kernels=REFERENCE_KERNELS)
    ref_sel = ref["kernels"]
    assert set(ref_sel.values()) <= {"reference", "torch"}, ref_sel
    exact = train(tmp_path / "ref_fp32", 1, precision="fp32", kernels=REFERENCE_KERNELS)  # step 1's grads in fp32

    print(f"GOLDEN_GPU_ERR backends fast {fast_sel} ref {ref_sel}")
    assert len(fast["losses"]) == len(ref["losses"]) == STEPS, (len(fast["losses"]), len(ref["losses"]))
    assert all(torch.isfinite(torch.tensor(fast["losses"]))), fast["losses"]
    runs = [fast["losses"]] + [r["losses"] for r in again]
    mean = [sum(step) / len(step) for step in zip(*runs)]
    rel = [abs(a - b) / abs(b) for a, b in zip(mean, ref["losses"])]
    spread = max(abs(a - b) / abs(b) for i, x in enumerate(runs) for y in runs[i + 1:] for a, b in zip(x, y))
    mean_rel = sum(rel) / STEPS
    worst = max(range(STEPS), key=rel.__getitem__)
    print(f"GOLDEN_GPU_ERR loss (mean of the fast runs): step 1 {mean[0]:.4f} vs {ref['losses'][0]:.4f}, step {STEPS} "
          f"{mean[-1]:.4f} vs {ref['losses'][-1]:.4f}; mean rel diff {mean_rel:.2e} (bound {LOSS_MEAN_RTOL:.1e}), "
          f"max {rel[worst]:.2e} at step {worst + 1} (bound {LOSS_STEP_RTOL:.1e}); fast run-to-run max {spread:.2e}")
    for run in runs:
        print(f"GOLDEN_GPU_ERR losses fast {[round(x, 4) for x in run]}")
    print(f"GOLDEN_GPU_ERR losses ref  {[round(x, 4) for x in ref['losses']]}")
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference run must learn (else the check is weak)"

    assert fast["norms"].keys() == ref["norms"].keys() == exact["norms"].keys()
    bad, noisy = {}, {}
    rel_noise = {n: abs(ref["norms"][n] - w) / w for n, w in exact["norms"].items()}
    by_role: dict[str, float] = {}  # one draw per parameter is a thin estimate: pool it over the layers of a role
    for name, d in rel_noise.items():
        by_role[_role(name)] = max(by_role.get(_role(name), 0.0), d)
    for name, want in exact["norms"].items():
        noise = by_role[_role(name)]
        bound = max(GRAD_RTOL, 3 * noise)
        if bound > GRAD_RTOL:
            noisy[name] = round(noise, 4)
        err = abs(fast["norms"][name] - want) / want
        if err > bound:
            bad[name] = (round(err, 4), round(bound, 4))
    worst_grad = max(exact["norms"], key=lambda n: abs(fast["norms"][n] - exact["norms"][n]) / exact["norms"][n])
    print(f"GOLDEN_GPU_ERR grad norms: worst {worst_grad} "
          f"{abs(fast['norms'][worst_grad] - exact['norms'][worst_grad]) / exact['norms'][worst_grad]:.2e}; "
          f"{len(noisy)} parameters with bf16 noise above {GRAD_RTOL}: {noisy}")
    assert not bad, f"gradient norms after step 1 (fast vs fp32 reference, (rel err, bound)): {bad}"
    assert mean_rel < LOSS_MEAN_RTOL, f"loss: mean rel diff over the steps {mean_rel:.2e} (bound {LOSS_MEAN_RTOL})"
    assert rel[worst] < LOSS_STEP_RTOL, f"loss rel diff {rel[worst]:.2e} at step {worst + 1} (bound {LOSS_STEP_RTOL})"
