"""The longest sequence each system trains under the same per-rank memory cap.

For each (P, dtype, system): S doubles from --longest-start while a forward + backward completes
under the cap, then bisects between the last S that fit and the first that did not, down to
--longest-step. Each probe is a fresh process group (forked, real gloo, one intra-op thread per
rank) running one step of the job at that S, every rank inside its own memory cgroup limited to
the cap (cap.py: the kernel enforces it; a rank that needs more is OOM-killed). Without a usable
memory cgroup the probe falls back to the measured criterion (the step's peak resident set above
the rank's start, as the main table measures it, at most the cap) and the report says so.
"""
from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist

from . import cap as cap_mod, job, systems as systems_mod
from .meter import MemoryMeter, exact_memory, now


def probe(rank: int, p: int, port: int, opts: dict, out_path: str) -> None:
    """One rank of one probe: set up the system at S, one step inside the rank's cgroup."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(p),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p, timeout=datetime.timedelta(seconds=opts["timeout"]))
    try:
        seq, dtype = opts["seq"], opts["dtype"]
        layer, rotary = job.make_layer(seq)
        system = next(s for s in systems_mod.all_systems(p) if s.name == opts["system"])
        system.setup(layer, p, rank)
        x, d_out = job.inputs(seq)
        cos, sin = job.rope_table(rotary, seq)
        part = system.partition
        x, cos, sin, d_out = (job.shard(t, part, p, rank) for t in (x, cos, sin, d_out))
        x.requires_grad_(True)
        capped = bool(opts["cgroups"])
        exact_memory()  # freed memory goes back to the kernel: the resident set follows the live tensors
        meter = MemoryMeter()
        dist.barrier()
        meter.start()
        if capped:
            cap_mod.join(opts["cgroups"][rank])
        t0 = now()
        with job.autocast(dtype):
            out = system.forward(x, cos, sin)
            out.backward(d_out.to(out.dtype))
        seconds = now() - t0
        if capped:
            cap_mod.join(opts["cgroup_root"])
        resident = meter.stop()
        stats = torch.tensor([seconds, float(resident)], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(dict(seconds=float(stats[0]), resident=int(stats[1])), f)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


class Prober:
    """Runs probes for the driver: `spawn(p, opts, path)` starts one process group and raises
    SystemExit if a rank dies (run._spawn's contract)."""

    def __init__(self, spawn, out: str, cap: int, timeout: int):
        self.spawn, self.out, self.cap, self.timeout = spawn, out, cap, timeout
        self.root, self.why_not = cap_mod.find()
        self.log: list[dict] = []

    @property
    def enforcement(self) -> str:
        if self.root is not None:
            return f"cgroup v{self.root.version} memory limit per rank (kernel-enforced, no swap)"
        return f"measured peak resident set per rank (not enforced: {self.why_not})"

    def fits(self, p: int, dtype: str, system: str, seq: int) -> dict:
        path = os.path.join(self.out, "probe.json")
        if os.path.exists(path):
            os.remove(path)
        groups = []
        opts = dict(seq=seq, dtype=dtype, system=system, cap=self.cap, timeout=self.timeout, cgroups=[])
        try:
            if self.root is not None:
                tag = f"mlacp-longest-{os.getpid()}"
                for r in range(p):
                    groups.append(self.root.make(f"{tag}-r{r}", self.cap))
                opts.update(cgroups=[g.path for g in groups], cgroup_root=self.root.path)
            died = ""
            try:
                self.spawn(p, opts, path)
            except SystemExit as e:
                lines = [v.strip() for v in str(e).splitlines() if v.strip()]
                died = " ".join(lines[-1:]) or "a rank died"
            kills = sum(g.oom_kills() for g in groups)
            peaks = [g.peak() for g in groups]
        finally:
            cap_mod.remove_all(groups)
        rec = dict(P=p, dtype=dtype, system=system, S=seq)
        if peaks and all(v is not None for v in peaks):
            rec["cgroup_peak"] = max(peaks)
        if died:
            rec.update(fits=False, reason="OOM-killed at the cap" if kills else f"failed: {died}", failed=not kills)
        else:
            with open(path) as f:
                got = json.load(f)
            rec.update(seconds=got["seconds"], resident=got["resident"])
            rec["fits"] = self.root is not None or got["resident"] <= self.cap
            if not rec["fits"]:
                rec["reason"] = "measured peak above the cap"
        self.log.append(rec)
        stamp = datetime.datetime.now().strftime("%H:%M:%S")
        print(f"[{stamp}] longest P={p} {dtype} {system} S={seq}: "
              + ("fits" if rec["fits"] else rec["reason"])
              + (f", {rec['seconds']:.1f} s" if "seconds" in rec else "")
              + (f", cgroup peak {rec['cgroup_peak'] / 2**20:.0f} MiB" if "cgroup_peak" in rec else "")
              + (f", resident {rec['resident'] / 2**20:.0f} MiB" if "resident" in rec else ""), flush=True)
        return rec


def search(fits, start: int, step: int, most: int) -> dict:
    """The largest S (a multiple of step) with fits(S), doubling from start then bisecting: fits is
    assumed monotone (memory grows with S). Returns longest (None if start does not fit) and
    first_over (None if `most` fit), and the probes' records."""
    ok, over, tried = None, None, []

    def check(s):
        rec = fits(s)
        tried.append(rec)
        if rec.get("failed"):
            raise RuntimeError(f"S={s}: {rec['reason']}")
        return rec["fits"]

    s = start
    while s <= most:
        if check(s):
            ok, s = s, 2 * s
        else:
            over = s
            break
    last = most // step * step  # doubling may step over `most`: try it too
    if ok is not None and over is None and last > ok:
        if check(last):
            ok = last
        else:
            over = last
    if ok is not None and over is not None:
        while over - ok > step:
            mid = (ok + over) // 2 // step * step
            if not ok < mid < over:
                break
            if check(mid):
                ok = mid
            else:
                over = mid
    return dict(longest=ok, first_over=over, probes=tried)
