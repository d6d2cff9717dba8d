"""`examples/hf_finetune.py --quick`: Trainer fine-tunes a GPT-2 with ZenFlowAdamW and with
AdamW, both losses fall, and zenflow's ends near AdamW's."""

import math
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "hf_finetune.py"
ROW = re.compile(r"^(zenflow|adamw)\s+(\S+)\s+(\S+)\s+\S+$", re.MULTILINE)


def test_the_trainer_example_trains_both_runs():
    command = [sys.executable, str(SCRIPT), "--quick"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {name: (float(train), float(val)) for name, train, val in ROW.findall(result.stdout)}
    assert rows.keys() == {"zenflow", "adamw"}, result.stdout
    untrained = math.log(256)  # bytes as tokens, uniform
    for train_loss, eval_loss in rows.values():
        assert eval_loss < untrained and train_loss < untrained
    assert rows["zenflow"][1] < 1.05 * rows["adamw"][1]
