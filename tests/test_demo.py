"""The main job, end to end: `examples/finetune_gpt.py --quick` trains, the loss falls, a PNG;
`--resume` continues the ZenFlow run from its checkpoint."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "finetune_gpt.py"
FINAL = re.compile(r"^final: val_loss_before=(\S+) val_loss_after=(\S+)$", re.MULTILINE)


RESUMED = re.compile(r"^resumed from \S+ at step (\d+)$", re.MULTILINE)


def run_demo(*args: str) -> str:
    command = [sys.executable, str(SCRIPT), "--quick", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
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
    assert (out_dir / "export" / "pytorch_model.bin").stat().st_size > 0

    stdout = run_demo("--resume", *dirs)
    steps = int(RESUMED.search(stdout).group(1))
    resumed_before, resumed_after = map(float, FINAL.search(stdout).groups())
    assert resumed_before == after  # it continues from where the first run ended
    assert resumed_after < resumed_before
    assert (out_dir / "checkpoint" / f"global_step{2 * steps}").is_dir()
