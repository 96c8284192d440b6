"""The released Kimi K3 checkpoint layout, round trip on CPU: train a scaled-down K3 (the released config.json with
small widths, its compressed-tensors MXFP4 quantization_config kept), export it in the released layout (MXFP4
routed experts, bf16 elsewhere, fp32 where the release keeps fp32, zero-padded A_log), read it back, and measure
what the round trip costs: the weights' relative error per class and the loss on the same batch.

    PYTHONPATH=. python benchmarks/k3_release_roundtrip.py [--steps 40] [--attn-res]

Prints a `|` table. The loss columns are the first training step of two runs started with --init-from on the same
data position: from the exact fp32 checkpoint, and from the exported HF directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "train"))
from _k3_small import small_k3_config  # noqa: E402

from moestack.cli.app import main  # noqa: E402
from moestack.config.hf import hf_config_to_spec  # noqa: E402
from moestack.train.convert import CheckpointSource, hf_to_state_dict  # noqa: E402

ARGS = ["--device", "cpu", "--precision", "fp32", "-q", "--seq-len", "64", "--batch-size", "8",
        "--set", "logging.tensorboard=false", "--set", "eval_every=0", "--set", "data.eval_fraction=0",
        "--set", "logging.every=1", "--set", "schedule.warmup_steps=4"]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def _quiet(argv: list[str]) -> int:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


def run(tmp: Path, steps: int, attn_res: bool) -> list[tuple[str, str]]:
    cfg_dict = small_k3_config(attn_res=attn_res)
    cfg = tmp / "k3-small.config.json"
    cfg.write_text(json.dumps(cfg_dict, indent=2))
    spec = hf_config_to_spec(cfg_dict, "k3-small").spec
    assert _quiet(["train", "--model", str(cfg), "--steps", str(steps), "--out", str(tmp / "src"), *ARGS]) == 0
    assert _quiet(["convert", str(tmp / "src" / "checkpoints"), str(tmp / "hf"), "--model", str(cfg)]) == 0
    assert _quiet(["train", "--init-from", str(tmp / "hf"), "--steps", "1", "--out", str(tmp / "new"), *ARGS]) == 0
    assert _quiet(["train", "--model", str(cfg), "--init-from", str(tmp / "src"), "--steps", "1",
                   "--out", str(tmp / "exact"), *ARGS]) == 0
    src = CheckpointSource(sorted((tmp / "src" / "checkpoints").glob("step_*"))[-1])
    exact = src.get(list(src.keys()))
    back = hf_to_state_dict(tmp / "hf", spec, mxfp4_dtype=torch.float32)
    classes: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, t in exact.items():
        kind = "routed experts (MXFP4)" if ".experts." in name else (
            "fp32 tensors (A_log, dt_bias, conv, o_norm, bias)" if name.endswith(("A_log", "dt_bias", "selection_bias"))
            or "conv" in name or "o_norm" in name else "other tensors (bf16)")
        classes.setdefault(kind, []).append((t.float(), back[name].float()))
    rows = []
    for kind, pairs in classes.items():
        num = sum(float((b - a).pow(2).sum()) for a, b in pairs)
        den = sum(float(a.pow(2).sum()) for a, _ in pairs)
        worst = max(float((b - a).abs().max()) for a, b in pairs)
        rows.append((f"weights: {kind}, relative RMS error", f"{(num / den) ** 0.5:.4f} (max abs {worst:.3g})"))
    src_last = _losses(tmp / "src")[-1]
    l_exact, l_new = _losses(tmp / "exact")[0], _losses(tmp / "new")[0]
    files = sorted(p.name for p in (tmp / "hf").iterdir())
    rows += [
        ("source run: steps, first -> last loss", f"{steps}, {_losses(tmp / 'src')[0]:.4f} -> {src_last:.4f}"),
        ("exported files", f"{len(files) - 2} shard(s) + index + config.json"),
        ("first loss from the exact checkpoint (same batch)", f"{l_exact:.5f}"),
        ("first loss from the released layout (--init-from HF)", f"{l_new:.5f}"),
        ("difference (released - exact), relative", f"{l_new - l_exact:+.5f} ({(l_new - l_exact) / l_exact:+.3%})"),
    ]
    return rows


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--attn-res", action="store_true", help="keep attn_res_block_size (K3's Attention Residuals)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        rows = run(Path(d), args.steps, args.attn_res)
    print("| quantity | value |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    cli()
