"""Runs a function on N local processes over gloo (real torch.distributed, as under torchrun)."""
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException as e:  # reported to the test, with the rank's traceback
        torch.save({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(fn, world: int, *args, timeout_s: float = 600):
    """fn(rank, world, *args) on `world` processes; returns the per-rank results (or the
    per-rank exception texts as {"error": ...} dicts). A process that dies (a signal, an abort) or
    a run longer than timeout_s (a hang) fails the test, naming the ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world, _free_port(), fn, args, out_dir), nprocs=world,
                                     join=False, start_method="fork")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                for p in context.processes:
                    p.kill()
                raise AssertionError(f"ranks {alive} still running after {timeout_s} s (a hang)")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]


def results(outcomes):
    """The per-rank results; fails with the first rank's traceback if any rank raised."""
    for r, o in enumerate(outcomes):
        if "error" in o:
            raise AssertionError(f"rank {r} raised {o['error']}\n{o['trace']}")
    return [o["ok"] for o in outcomes]
