"""The README's examples run as documented (torchrun, 4 local gloo processes) and print that the
context-parallel losses agree with the single-process ones."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("example", ["hf_context_parallel.py", "fsdp2_context_parallel.py"])
def test_example_losses_agree(example):
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "4", str(ROOT / "examples" / example)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "losses agree: True" in run.stdout, run.stdout[-3000:]
