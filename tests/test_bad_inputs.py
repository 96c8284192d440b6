"""Common mistakes get one line on stderr naming the field or file and the fix, exit status 2, no traceback, and no
silent acceptance; under torchrun only rank 0 prints it. One case per mistake (the issue's list, then neighbours)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from moestack.cli.app import main
from moestack.config.plan import make_plan, save_plan
from moestack.train.checkpoint import save_checkpoint


def _one_line(capsys) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert err.startswith("error:"), (cap.out[-2000:], cap.err[-2000:])
    assert "\n" not in err and "Traceback" not in err, err
    return err


# train: (id, extra argv, fragments the line must hold); every case also gets --out <tmp>/run unless it sets --out
TRAIN_CASES = [
    ("device-tpu", ["--device", "tpu"], ["device: 'tpu'", "auto, cpu, cuda or cuda:N"]),
    ("device-cuda-abc", ["--device", "cuda:abc"], ["device: 'cuda:abc'", "cuda:N"]),
    ("steps-bool", ["--set", "steps=true"], ["steps:", "a boolean"]),
    ("out-empty", ["--out", ""], ["out_dir:", "empty"]),
    ("seed-huge", ["--set", "seed=99999999999999999999999"], ["seed:", "less than 4294967296"]),
    ("seed-negative", ["--set", "seed=-1"], ["seed:", "greater than or equal to 0"]),
    ("betas-above-one", ["--set", "optimizer.betas=[0.9,1.5]"], ["optimizer.betas", "outside [0, 1)"]),
    ("betas-negative", ["--set", "optimizer.betas=[-0.1,0.95]"], ["optimizer.betas", "betas[0]"]),
    ("betas-bool", ["--set", "optimizer.betas=[true,0.95]"], ["optimizer.betas", "a boolean"]),
    ("steps-zero", ["--steps", "0"], ["steps:", "greater than 0"]),
    ("batch-negative", ["--batch-size", "-1"], ["micro_batch_size:"]),
    ("lr-zero", ["--lr", "0"], ["optimizer.lr:"]),
    ("lr-inf", ["--set", "optimizer.lr=.inf"], ["optimizer.lr:", "finite"]),
    ("logging-every-zero", ["--set", "logging.every=0"], ["logging.every:"]),
    ("collective-timeout-zero", ["--set", "timeouts.collective_minutes=0"], ["timeouts.collective_minutes:"]),
    ("watchdog-negative", ["--set", "timeouts.watchdog_minutes=-1"], ["timeouts.watchdog_minutes:"]),
    ("set-into-a-value", ["--set", "steps.x=1"], ["steps.x", "'steps' is a value"]),
    ("set-no-key", ["--set", "=3"], ["--set", "no key"]),
    ("set-no-equals", ["--set", "steps"], ["--set", "key=value"]),
    ("set-unknown-key", ["--set", "optimizer.lrr=1"], ["optimizer.lrr", "unknown key"]),
    ("steps-not-a-number", ["--steps", "abc"], ["'--steps'", "--help"]),
    ("unknown-flag", ["--bogus"], ["--bogus"]),
    ("precision", ["--precision", "fp4"], ["precision:"]),
    ("data-missing", ["--data", "/nonexistent/corpus.txt"], ["data.paths:", "does not exist"]),
    ("tokenizer-missing", ["--tokenizer", "/nonexistent/tokenizer.json"], ["data.tokenizer:", "is not a file"]),
    ("config-missing", ["--config", "/nonexistent/train.yaml"], ["/nonexistent/train.yaml", "file not found"]),
    ("model-missing", ["--model", "/nonexistent/model.yaml"], ["/nonexistent/model.yaml"]),
    ("trust-key-missing", ["--set", "checkpoint.trust_key_file=/nonexistent/key"],
     ["checkpoint.trust_key_file: cannot read"]),
    ("profile-steps", ["--profile-steps", "9:3"], ["--profile-steps"]),
]


@pytest.mark.parametrize("argv,fragments", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_train_mistake_is_one_line(tmp_path, capsys, argv, fragments):
    out = [] if "--out" in argv else ["--out", str(tmp_path / "run")]
    assert main(["train", "-q", "--steps", "1", *out, *argv]) == 2
    err = _one_line(capsys)
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_device_index_without_the_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert main(["train", "-q", "--device", "cuda:3", "--out", str(tmp_path / "run")]) == 2
    assert "no CUDA device is available" in _one_line(capsys)


def test_tokenizer_file_without_the_hf_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    assert main(["train", "-q", "--tokenizer", str(tok), "--out", str(tmp_path / "run")]) == 2
    assert "pip install 'moestack[hf]'" in _one_line(capsys)


def _truncated_config(tmp_path: Path) -> Path:
    src = Path(__file__).parent / "data" / "hf_configs"
    text = next(iter(sorted(src.glob("*.json")))).read_text()
    bad = tmp_path / "model" / "config.json"
    bad.parent.mkdir()
    bad.write_text(text[: len(text) // 2])
    return bad


def test_truncated_config_json_says_where(tmp_path, capsys):
    bad = _truncated_config(tmp_path)
    assert main(["train", "-q", "--model", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = _one_line(capsys)
    assert str(bad) in err and "not valid JSON" in err and " column " in err and "not an HF config" not in err
    assert main(["profile", str(bad.parent)]) == 2  # a directory holding it: the same line
    assert " column " in _one_line(capsys)


def test_out_is_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["train", "-q", "--steps", "1", "--out", str(target), "--batch-size", "2", "--seq-len", "16",
                 "--set", "logging.tensorboard=false", "--set", "eval_every=0"]) == 2
    assert f"out_dir: cannot write into '{target}'" in _one_line(capsys)


def test_plan_file_with_wrong_types(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("model: tiny\ncluster: cpu\ndevices: two\nseq_len: 16\nglobal_batch_size: 4\n")
    assert main(["train", "-q", "--plan", str(plan), "--out", str(tmp_path / "run")]) == 2
    err = _one_line(capsys)
    assert str(plan) in err and "devices" in err
    plan.write_text("model: tiny\ncluster: cpu\ndevices: 2\nseq_len: 16\nglobal_batch_size: true\n")
    assert main(["train", "-q", "--plan", str(plan), "--out", str(tmp_path / "run")]) == 2
    assert "global_batch_size" in _one_line(capsys)


def test_world_size_not_matching_the_plan(tmp_path, capsys, monkeypatch):
    plan = tmp_path / "plan.yaml"
    save_plan(make_plan(model="tiny", cluster="cpu", devices=2, seq_len=16, global_batch_size=4, micro_batch_size=2,
                        dp_replicate=2), plan)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["train", "-q", "--plan", str(plan), "--out", str(tmp_path / "run")]) == 2
    assert "the plan lays out 2 ranks but the launcher started 3" in _one_line(capsys)


def test_only_rank_0_prints(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # torchrun's other ranks: the same error, said once (by rank 0)
    assert main(["train", "-q", "--device", "tpu", "--out", str(tmp_path / "run")]) == 2
    assert main(["train", "--bogus"]) == 2
    cap = capsys.readouterr()
    assert cap.err == "" and cap.out == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "-q", "--device", "tpu", "--out", str(tmp_path / "run")]) == 2
    assert "device" in _one_line(capsys)


# ---------------------------------------------------------------------------------------------- other commands

OTHER_CASES = [
    ("plan-seq-len-0", ["plan", "tiny", "--seq-len", "0"], ["--seq-len", ">= 2"]),
    ("plan-seq-len-over-max", ["plan", "tiny", "--seq-len", "100000"], ["--seq-len", "max_seq_len"]),
    ("plan-devices-0", ["plan", "tiny", "--devices", "0"], ["devices:"]),
    ("plan-global-batch-0", ["plan", "tiny", "--global-batch-tokens", "0"], ["--global-batch-tokens"]),
    ("plan-top-0", ["plan", "tiny", "--top", "0"], ["--top"]),
    ("profile-seq-len-0", ["profile", "tiny", "--seq-len", "0"], ["--seq-len"]),
    ("adapt-seq-len-0", ["adapt", "tiny", "--fit", "cpu-8g", "--seq-len", "0"], ["--seq-len"]),
    ("adapt-batch-0", ["adapt", "tiny", "--fit", "cpu-8g", "--batch", "0"], ["--batch"]),
    ("convert-missing-source", ["convert", "/nonexistent/ckpt", "OUT"], ["/nonexistent/ckpt"]),
    ("missing-argument", ["plan"], ["Missing argument", "--help"]),
]


@pytest.mark.parametrize("argv,fragments", [c[1:] for c in OTHER_CASES], ids=[c[0] for c in OTHER_CASES])
def test_command_mistake_is_one_line(tmp_path, capsys, argv, fragments):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    if argv[0] == "plan" and len(argv) > 1:
        argv += ["--out", str(tmp_path / "plan.yaml")]
    assert main(argv) == 2
    err = _one_line(capsys)
    for fragment in fragments:
        assert fragment in err, err
    assert not (tmp_path / "plan.yaml").exists() and not (tmp_path / "out").exists()


def test_tune_without_a_gpu_fails(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert main(["tune", "tiny"]) == 2
    assert "tune: no CUDA GPU" in _one_line(capsys)


def _tiny_checkpoint(root: Path) -> Path:
    from moestack.config import load_model_spec
    from moestack.model.transformer import build_model

    model = build_model(load_model_spec("tiny"), "cpu", seed=0)
    return save_checkpoint(root, 1, model, None, {"step": 1}, keep=1)


def _reshaped_tiny(tmp_path: Path, old: str, new: str) -> Path:
    from moestack.config.model_spec import PRESET_DIR

    text = (PRESET_DIR / "tiny.yaml").read_text()
    assert old in text
    path = tmp_path / f"wrong_{new.split(':')[0]}.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


def test_convert_with_a_wrongly_shaped_model_leaves_nothing(tmp_path, capsys):
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    wrong = _reshaped_tiny(tmp_path, "vocab_size: 512", "vocab_size: 600")
    hf = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(hf), "--model", str(wrong), "--family", "kimi_k3"]) == 2
    err = _one_line(capsys)
    assert "shape mismatch" in err and "embed.weight" in err and "--model" in err
    assert not hf.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")] == []
    # the other way: HF -> moestack with a model of another width
    assert main(["convert", str(ckpt), str(hf), "--model", "tiny", "--family", "kimi_k3"]) == 0
    capsys.readouterr()
    narrow = _reshaped_tiny(tmp_path, "hidden_size: 128", "hidden_size: 64")
    back = tmp_path / "back"
    assert main(["convert", str(hf), str(back), "--model", str(narrow), "--family", "kimi_k3"]) == 2
    err = _one_line(capsys)
    assert "shape mismatch" in err and "more" in err and len(err) < 1500
    assert not back.exists()


def test_checkpoint_dir_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "hf"), "--model", "tiny"]) == 2
    assert "neither an HF checkpoint" in _one_line(capsys)
    meta = tmp_path / "ckpt"
    _tiny_checkpoint(meta)
    (meta / "step_00000001" / "meta.json").write_text(json.dumps({"format_version": 1})[:-3])
    assert main(["convert", str(meta), str(tmp_path / "hf"), "--model", "tiny", "--family", "kimi_k3"]) == 2
    assert "meta.json" in _one_line(capsys)
