"""The main job, end to end: `examples/finetune_gpt.py --quick` trains, the loss falls, a PNG."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "finetune_gpt.py"
FINAL = re.compile(r"^final: val_loss_before=(\S+) val_loss_after=(\S+)$", re.MULTILINE)


def test_finetune_demo_quick(tmp_path):
    out_dir, cache_dir = tmp_path / "runs", tmp_path / "cache"
    command = [sys.executable, str(SCRIPT), "--quick"]
    command += ["--out-dir", str(out_dir), "--cache-dir", str(cache_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

    match = FINAL.search(result.stdout)
    assert match, f"no final line in:\n{result.stdout}"
    before, after = map(float, match.groups())
    assert after < before, f"fine-tuning did not lower the validation loss: {before} -> {after}"
    assert (out_dir / "finetune_gpt.png").stat().st_size > 0
