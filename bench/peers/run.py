"""The peer benchmark's command line: one process group per P (forked, real gloo, one intra-op
thread per rank), the records merged, the report written (table, JSON, plot).

    scripts/bench-peers.sh                 # the full comparison (README table)
    scripts/bench-peers.sh --quick         # CI smoke test: every system, small S
    scripts/bench-peers.sh --procs 2 --seq 8192 --dtypes float32 --reps 3
    scripts/bench-peers.sh --longest --cap-mib 512   # longest S per system under a per-rank cap
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

from . import longest, report, systems as systems_mod, worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{text}'")
    return values


def _preload() -> None:
    """Imports the peers once in this process, so every forked group starts in a second."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import transformers  # noqa: F401
    for name in ("deepspeed", "deepspeed.sequence.layer", "yunchang", "mlacp"):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - the system's setup reports it
            pass


def _spawn(p: int, opts: dict, path: str, mode: str) -> None:
    if os.path.exists(path):
        os.remove(path)
    target, args = (longest.probe, ()) if mode == "longest" else (worker.main, (mode,))
    try:
        mp.start_processes(target, args=(p, _free_port(), opts, path) + args, nprocs=p, join=True,
                           start_method="fork")
    except mp.ProcessRaisedException as e:
        raise SystemExit(f"bench-peers: a rank of the P={p} {mode} group raised:\n{e}") from None
    except mp.ProcessExitedException as e:
        raise SystemExit(f"bench-peers: a rank of the P={p} {mode} group died: {e}") from None


def _smoke(p: int, opts: dict, out: str) -> dict:
    """Every system once at a tiny S in a process group of its own round; a fresh group after each
    failure (worker.Runner.smoke), until every system has been tried."""
    todo = None  # None: all systems
    total = dict(passed=[], failed={}, wrong={}, unavailable={})
    path = os.path.join(out, f"smoke-P{p}.json")
    while True:
        _spawn(p, dict(opts, only=todo), path, "smoke")
        with open(path) as f:
            got = json.load(f)
        for key in ("failed", "wrong", "unavailable"):
            total[key].update(got[key])
        total["passed"] += got["passed"]
        if not got["failed"]:
            return total
        tried = set(total["passed"]) | set(total["failed"]) | set(total["wrong"]) | set(total["unavailable"])
        names = [s.name for s in systems_mod.all_systems(p) if s.parallel]
        if opts["systems"]:
            names = [n for n in names if any(f in n for f in opts["systems"])]
        todo = [n for n in names if n not in tried]
        if not todo:
            return total


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def parse(argv):
    ap = argparse.ArgumentParser(prog="scripts/bench-peers.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=_ints, default=[2, 4], help="CP sizes P (default 2,4)")
    ap.add_argument("--seq", type=_ints, default=[2048, 4096], help="global sequence lengths S (default 2048,4096)")
    ap.add_argument("--dtypes", default="float32,bf16", help="float32 and/or bf16 (CPU autocast)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per system and point, interleaved")
    ap.add_argument("--systems", default="", help="comma-separated name fragments to keep (the baseline always runs)")
    ap.add_argument("--quick", action="store_true", help="smoke test: P=2,4, S=256, float32 at both P and bf16 at "
                    "P=2, 1 repetition (with --longest: P=2, float32, a 160 MiB cap, S from 1024 to 8192)")
    ap.add_argument("--out", default="out/peers", help="folder for results.json, table.md, steps.png")
    ap.add_argument("--memory-limit-gib", type=float, default=None,
                    help="skip the eager single-process layer above this estimate (default: 60%% of MemAvailable)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a collective may wait (gloo)")
    lo = ap.add_argument_group("longest S under a memory cap (--longest; longest.py)")
    lo.add_argument("--longest", action="store_true",
                    help="instead of timing: the largest S each system's forward + backward completes under --cap-mib "
                         "per rank (default systems: mlacp latent kv-recompute, mlacp expanded, deepspeed-ulysses)")
    lo.add_argument("--cap-mib", type=int, default=512, help="memory a rank's step may add, MiB (default 512)")
    lo.add_argument("--longest-start", type=int, default=2048, help="first S tried, doubled while it fits")
    lo.add_argument("--longest-step", type=int, default=512, help="resolution of the bisection (a multiple of 2P)")
    lo.add_argument("--longest-max", type=int, default=65536, help="largest S tried")
    a = ap.parse_args(argv)
    if a.quick and a.longest:  # CI: P=2 float32 under a small cap, S <= 8K (about a minute)
        a.procs, a.dtypes, a.cap_mib, a.longest_start, a.longest_max = [2], "float32", 160, 1024, 8192
    elif a.quick:
        a.procs, a.seq, a.dtypes, a.reps = [2, 4], [256], "float32,bf16", 1
    # --quick is a smoke test (every system checked, mlacp's bytes against its formula; its times are
    # no result), sized by bf16: on a CPU without bf16 arithmetic LibTorch's bf16 matmul runs ~1
    # GFLOP/s (an AMD EPYC Zen 3: at S = 512 with 2 repetitions the bf16 points took 4.2 min at P=2
    # and 5.5 at P=4), so S = 256, one repetition, and bf16 at P=2 only.
    a.bf16_procs = [2] if a.quick else None
    dtypes = [d for d in a.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in ("float32", "bf16")]
    if bad or not dtypes:
        ap.error(f"--dtypes takes float32 and/or bf16, got '{a.dtypes}'")
    if a.reps < 1:
        ap.error(f"--reps must be >= 1, got {a.reps}")
    if a.longest:
        for name, v in (("--longest-start", a.longest_start), ("--longest-step", a.longest_step)):
            bad = [p for p in a.procs if v < 2 * p or v % (2 * p)]
            if bad:
                ap.error(f"{name} must be a positive multiple of 2P (head_tail partition): {v}, P={bad[0]}")
        if a.cap_mib < 1 or a.longest_max < a.longest_start:
            ap.error(f"need --cap-mib >= 1 and --longest-max >= --longest-start "
                     f"(got {a.cap_mib}, {a.longest_max}, {a.longest_start})")
    for p in a.procs:
        for s in a.seq:
            if s % (2 * p):
                ap.error(f"every S must be divisible by 2P (head_tail partition): S={s}, P={p}")
        if 16 % p:
            ap.error(f"P must divide the 16 heads (Ulysses): P={p}")
    a.dtypes = dtypes
    return a


LONGEST_SYSTEMS = ("mlacp latent kv-recompute", "mlacp expanded", "deepspeed-ulysses (V padded)")


def main_longest(a, argv) -> int:
    # A terminated driver unwinds (its probes' cgroups are removed and their ranks killed).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    _preload()
    prober = longest.Prober(lambda p, opts, path: _spawn(p, opts, path, "longest"), a.out, a.cap_mib * 2**20, a.timeout)
    print(f"== longest S under {a.cap_mib} MiB per rank: {prober.enforcement}", flush=True)
    results = []
    for p in a.procs:
        names = [s.name for s in systems_mod.all_systems(p) if s.parallel]
        keep = [n for n in names if any(f in n for f in a.systems.split(",") if f)] if a.systems else \
            [n for n in names if n in LONGEST_SYSTEMS]
        for dtype in a.dtypes:
            for name in keep:
                try:
                    got = longest.search(lambda s: prober.fits(p, dtype, name, s), a.longest_start,
                                         a.longest_step, a.longest_max)
                except RuntimeError as e:
                    got = dict(longest=None, first_over=None, failed=str(e))
                results.append(dict(P=p, dtype=dtype, system=name, longest=got["longest"],
                                    first_over=got["first_over"], failed=got.get("failed", "")))
    meta = dict(command=" ".join(["scripts/bench-peers.sh"] + list(argv)), machine=report.machine(),
                torch=torch.__version__, seconds=round(time.time() - started, 1), cap_mib=a.cap_mib,
                enforcement=prober.enforcement, step=a.longest_step, most=a.longest_max)
    report.write_longest(a.out, meta, results, prober.log)
    print(open(os.path.join(a.out, "longest.md")).read())
    failed = [r for r in results if r["failed"] and r["system"].startswith("mlacp")]
    for r in failed:
        print(f"bench-peers: FAILED {r['system']} P={r['P']} {r['dtype']}: {r['failed']}")
    if a.quick:  # the smoke test's own check: mlacp's leanest configuration goes at least as far as DeepSpeed
        print(f"bench-peers: the cap was enforced by: {prober.enforcement}")
        for r in [r for r in results if r["system"] == "mlacp latent kv-recompute"]:
            peer = next((x for x in results if x["system"].startswith("deepspeed") and x["P"] == r["P"]
                         and x["dtype"] == r["dtype"]), None)
            if peer is None or not peer["longest"] or not r["longest"] or r["longest"] < peer["longest"]:
                print(f"bench-peers: FAILED {r['system']} P={r['P']} {r['dtype']}: longest S {r['longest']} against "
                      f"DeepSpeed-Ulysses's {peer and (peer['longest'] or peer['failed'] or 'none')}")
                failed.append(r)
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.longest:
        return main_longest(a, argv)
    limit = int((a.memory_limit_gib * 2**30) if a.memory_limit_gib else 0.6 * _mem_available())
    opts = dict(smoke_timeout=60, seqs=a.seq, dtypes=a.dtypes, reps=a.reps, timeout=a.timeout, memory_limit=limit,
                systems=[n for n in a.systems.split(",") if n])
    started = time.time()
    _preload()
    records = []
    for p in a.procs:
        print(f"== P={p}: smoke test of every system", flush=True)
        smoke = _smoke(p, opts, a.out)
        for name, why in smoke["failed"].items():
            print(f"   {name}: failed: {why}", flush=True)
        for name, why in smoke["wrong"].items():
            print(f"   {name}: WRONG: {why}", flush=True)
        dtypes = [d for d in a.dtypes if d != "bf16" or a.bf16_procs is None or p in a.bf16_procs]
        print(f"== P={p}: S={a.seq} dtypes={dtypes} reps={a.reps}; timing {smoke['passed']}", flush=True)
        versions = {}
        for system in systems_mod.all_systems(p):
            try:
                versions[system.name] = system.version()
            except Exception:  # noqa: BLE001 - a peer that does not import
                versions[system.name] = ""
        path = os.path.join(a.out, f"records-P{p}.json")
        _spawn(p, dict(opts, only=smoke["passed"], dtypes=dtypes), path, "run")
        with open(path) as f:
            run = json.load(f)
        records += run
        for s in a.seq:
            for d in dtypes:
                for status in ("failed", "wrong", "unavailable"):
                    for name, why in smoke[status].items():
                        records.append(dict(system=name, P=p, S=s, dtype=d, status=status, version=versions.get(name, ""),
                                            reason=why + " (smoke test)"))
    meta = dict(command=" ".join(["scripts/bench-peers.sh"] + argv),
                machine=report.machine(), torch=torch.__version__, python=platform.python_version(),
                seconds=round(time.time() - started, 1), threads_per_rank=1, backend="gloo (loopback, real)")
    report.write(a.out, meta, records)
    print(open(os.path.join(a.out, "table.md")).read())
    print(f"bench-peers: {len(records)} records in {meta['seconds']} s -> {a.out}/")
    # The benchmark's own checks (the CI smoke test relies on them): mlacp correct at every point,
    # and its measured bytes equal to its formula (docs/DESIGN.md §4.6) exactly.
    mine = [r for r in records if r.get("system", "").startswith("mlacp")]
    bad = [r for r in mine if r.get("status") not in ("ok", "unchecked")]
    bad += [r for r in mine if r.get("status") == "ok" and r.get("bytes") != r.get("formula_bytes")]
    if bad:
        for r in bad:
            print(f"bench-peers: FAILED {r['system']} P={r['P']} S={r['S']} {r['dtype']}: status {r.get('status')}"
                  f" {r.get('reason', '')} bytes {r.get('bytes')} formula {r.get('formula_bytes')}")
        return 1
    return 0
