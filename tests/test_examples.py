"""The example scripts run as a user would run them, and print what they promise."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_tiny_llama_example(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    png = tmp_path / "losses.png"
    args = ["--steps", "4", "--seq", "32", "--batch", "2", "--threads", "1", "--plot", str(png)]
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tiny_llama.py"), *args], capture_output=True,
                         text=True, env=env, check=True)
    lines = out.stdout.splitlines()
    assert any(line.startswith(" step  loss (HF)") for line in lines), out.stdout
    rows = [line.split() for line in lines if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 4]
    for r in rows:  # same weights, same batches, same roundings: identical losses
        assert r[1] == r[2], r
    assert "largest loss difference" in out.stdout and "%|" in out.stderr  # the progress bar
    assert re.search(r"^tokens per second: HF \d+, rope_ext \d+$", out.stdout, re.M), out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out.stdout
