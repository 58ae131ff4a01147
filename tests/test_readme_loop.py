"""The README's own-loop example runs as written, under torchrun with 2 CPU ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_loop() -> str:
    text = README.read_text()
    after = text.index("As the optimizer of your own FSDP2 loop")
    start = text.index("```python\n", after) + len("```python\n")
    return text[start : text.index("```", start)]


def test_readme_loop_example_runs_as_written(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(readme_loop())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]  # a free port of its own
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "own-loop-checkpoint" / ".metadata").exists()
