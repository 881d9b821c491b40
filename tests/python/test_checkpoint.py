"""save_pretrained -> mlacp's C++ checkpoint reader -> `mlacp verify --checkpoint` passes, for a
single-file and a sharded checkpoint of the tiny HuggingFace model."""
import os
import pathlib
import subprocess

import pytest
import torch

import models

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = pathlib.Path(os.environ.get("MLACP_TOOL", ROOT / "build-torch2" / "mlacp"))


def _verify(folder, *extra):
    assert TOOL.is_file(), f"the mlacp tool is not built at {TOOL} (scripts/build.sh, or set MLACP_TOOL)"
    run = subprocess.run([str(TOOL), "verify", "--nproc", "2", "--checkpoint", str(folder), *extra],
                         capture_output=True, text=True, timeout=300, cwd=folder)
    assert run.returncode == 0 and "checks of 1 cases passed" in run.stdout, run.stdout + run.stderr
    return run.stdout


@pytest.mark.parametrize("shard", [None, "40KB"], ids=["single-file", "sharded"])
def test_save_pretrained_then_cpp_verify(tmp_path, shard):
    config = models.tiny_config(q_latent=True, rope_interleave=True, yarn=True)
    model = models.tiny_model(config, torch.float32)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    _verify(tmp_path, "--layer", "1", "--dtype", "float64")
    _verify(tmp_path, "--layer", "0", "--dtype", "bfloat16", "--strategy", "expanded_ulysses")


def test_checkpoint_without_the_layer_is_a_clear_error(tmp_path):
    model = models.tiny_model(models.tiny_config(), torch.float32)
    model.save_pretrained(tmp_path)
    run = subprocess.run([str(TOOL), "verify", "--nproc", "2", "--checkpoint", str(tmp_path), "--layer", "5"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "mlacp: " in run.stdout + run.stderr, run.stdout + run.stderr
    assert "Exception raised from" not in run.stdout + run.stderr
