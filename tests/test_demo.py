"""The main job, end to end: `examples/finetune_gpt.py --quick` trains, the loss falls, a PNG
and a JSON summary per run, a few progress lines when the output is a log rather than a
terminal; `--resume` continues the ZenFlow run from its checkpoint."""

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "finetune_gpt.py"
FINAL = re.compile(r"^final: val_loss_before=(\S+) val_loss_after=(\S+)$", re.MULTILINE)


RESUMED = re.compile(r"^resumed from \S+ at step (\d+)$", re.MULTILINE)


PROGRESS = re.compile(r"^(pre-training|zenflow|zero-offload|adamw): \d+/\d+ ", re.MULTILINE)


def run_demo(*args: str) -> str:
    command = [sys.executable, str(SCRIPT), "--quick", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # Not a terminal: four lines per loop, no bar redrawn per step.
    progress = PROGRESS.findall(result.stderr)
    assert progress and len(progress) == 4 * len(set(progress)), result.stderr
    assert "\r" not in result.stderr and "it/s" not in result.stderr
    return result.stdout


def test_finetune_demo_quick_then_resume(tmp_path):
    out_dir, cache_dir = tmp_path / "runs", tmp_path / "cache"
    dirs = ["--out-dir", str(out_dir), "--cache-dir", str(cache_dir)]
    stdout = run_demo(*dirs)

    match = FINAL.search(stdout)
    assert match, f"no final line in:\n{stdout}"
    before, after = map(float, match.groups())
    assert after < before, f"fine-tuning did not lower the validation loss: {before} -> {after}"
    assert (out_dir / "finetune_gpt.png").stat().st_size > 0
    report = json.loads((out_dir / "finetune_gpt.json").read_text())
    assert report.keys() == {"zenflow", "zero-offload", "adamw"}
    fields = {"val_loss", "train_loss", "median_step_ms", "mean_step_ms", "mb_per_step"}
    assert all(fields | {"cpu_updates", "vs_adamw"} <= run.keys() for run in report.values())
    assert round(report["zenflow"]["val_loss"], 4) == after
    assert report["adamw"]["vs_adamw"] == 1.0 and report["adamw"]["mb_per_step"] == 0
    assert (out_dir / "export" / "pytorch_model.bin").stat().st_size > 0

    stdout = run_demo("--resume", *dirs)
    steps = int(RESUMED.search(stdout).group(1))
    resumed_before, resumed_after = map(float, FINAL.search(stdout).groups())
    assert resumed_before == after  # it continues from where the first run ended
    assert resumed_after < resumed_before
    assert (out_dir / "checkpoint" / f"global_step{2 * steps}").is_dir()
