"""examples/hf_trainer.py: HuggingFace Trainer with mlacp's context parallelism on 2 gloo processes
(one CP group) equals the same Trainer on one process without mlacp, in float64: every step's
logged loss and gradient norm (before clipping), every evaluation loss (scheduled and final) and
every trained parameter, to <= 1e-9 relative. The gradient norm catches a wrong gradient scale
(a doubled or missing CP reduction), which AdamW and clipping would hide from the losses."""
import importlib.util
import os
import pathlib

import torch

import distributed

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
STEPS = 6
TOL = 1e-9


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()  # imported once here, so the forked ranks do not import transformers again


def _worker(rank, world, reference, out_dir):
    # As torchrun does: else accelerate sets 2 threads per process (physical cores / local world size unknown
    # here), and 2 spinning OpenMP pools on 2 cores make this test several times slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    out = example.train(reference, cp_size=world, steps=STEPS, batch=2, dtype=torch.float64,
                        output_dir=f"{out_dir}/{rank}")
    log = out["log"]
    return {"loss": [e["loss"] for e in log if "loss" in e], "grad_norm": [e["grad_norm"] for e in log if "loss" in e],
            "eval_loss": [e["eval_loss"] for e in log if "eval_loss" in e], "final_eval_loss": out["eval_loss"],
            "params": out["params"]}


def _relative(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def test_trainer_with_cp_equals_one_process(tmp_path):
    reference = distributed.results(distributed.run(_worker, 1, True, str(tmp_path / "ref")))[0]
    ranks = distributed.results(distributed.run(_worker, 2, False, str(tmp_path / "cp")))
    # logged: every step's loss, the evaluations at steps 3 and 6 (eval_steps) and trainer.evaluate()'s
    assert len(reference["loss"]) == STEPS and len(reference["eval_loss"]) >= 3, reference
    assert reference["eval_loss"][-1] == reference["final_eval_loss"]
    worst = {}
    for r in ranks:
        for key in ("loss", "grad_norm", "eval_loss"):
            assert len(r[key]) == len(reference[key]), (key, r[key], reference[key])
            worst[key] = max([worst.get(key, 0.0)] + [_relative(a, b) for a, b in zip(r[key], reference[key])])
        assert set(r["params"]) == set(reference["params"])
        worst["params"] = max([worst.get("params", 0.0)] + [
            ((p - reference["params"][n]).abs().max() / reference["params"][n].abs().max().clamp_min(1e-30)).item()
            for n, p in r["params"].items()])
    print("worst relative errors", worst, "losses", reference["loss"], "eval", reference["eval_loss"])
    assert all(v <= TOL for v in worst.values()), worst
    # the run trained
    assert abs(reference["loss"][-1] - reference["loss"][0]) > 1e-3
