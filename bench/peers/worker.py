"""One rank of one process group: checks every system against the single-process layer, then
times the correct ones in interleaved repetitions. Rank 0 writes the records."""
from __future__ import annotations

import datetime
import json
import os
import traceback

import torch
import torch.distributed as dist

from . import job, systems as systems_mod
from .meter import ByteMeter, MemoryMeter, exact_memory, now, timing_memory

TOLERANCE_F32 = 1e-4   # relative (max |error| / max |reference|): orders of summation differ
BF16_FACTOR = 4.0      # bf16: at most 4x the single-process bf16 layer's own error vs float32
BF16_FLOOR = 2e-2


def _gather_rows(local: torch.Tensor, partition: str, p: int) -> torch.Tensor:
    local = local.detach().float().contiguous()
    shards = [torch.empty_like(local) for _ in range(p)]
    dist.all_gather(shards, local)
    return job.unshard(shards, partition)


def _flag_any(failed: bool) -> bool:
    t = torch.tensor([1.0 if failed else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _max(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class _ForwardRaised(Exception):
    pass


class Runner:
    def __init__(self, rank: int, p: int, opts: dict):
        self.rank, self.p, self.opts = rank, p, opts
        self.bytes = ByteMeter()
        self.bytes.install()
        self.memory = MemoryMeter()
        self.layer, self.rotary = job.make_layer(max(opts["seqs"]))
        self.parameter_names = [n for n, _ in self.layer.named_parameters()]  # every system's gradient order
        self.records: list[dict] = []
        self.reference: dict = {}  # rank 0: (S, dtype) -> (out, dx, grads) of the single process
        self.systems = []
        self.unavailable: dict[str, str] = {}
        names = opts.get("systems")
        only = opts.get("only")  # exact names (the driver's choice after the smoke test)
        for s in systems_mod.all_systems(p):
            if s.parallel and names and not any(n in s.name for n in names):
                continue
            if s.parallel and only is not None and s.name not in only:
                continue
            try:
                s.setup(self.layer, p, rank)
                failed, reason = False, ""
            except systems_mod.Unavailable as e:
                failed, reason = True, str(e)
            except Exception as e:  # noqa: BLE001 - recorded
                failed, reason = True, f"setup failed: {type(e).__name__}: {e}"
            if _flag_any(failed):
                self.unavailable[s.name] = reason or "failed on another rank"
            else:
                self.systems.append(s)

    # --- one step ---------------------------------------------------------------------------
    def _step(self, s, seq: int, dtype: str, data: dict, collect: bool, exact: bool = None) -> dict:
        """Forward + backward of system s; time and bytes per rank; with collect, the full output,
        dX and summed parameter gradients on rank 0. exact (default: collect): the untimed step
        whose memory is reported (meter.exact_memory)."""
        for q in s.parameters():
            q.grad = None
        runs_here = s.parallel or self.rank == 0
        result = {"error": None}
        (exact_memory if (collect if exact is None else exact) else timing_memory)()
        dist.barrier()
        if runs_here:
            context_parallel = isinstance(s, systems_mod.TorchContextParallel)
            if not context_parallel:  # this rank's inputs, sharded before the clock starts
                local = {k: (job.shard(v, s.partition, self.p, self.rank) if s.parallel else v.clone())
                         for k, v in data.items()}
            s.reset_bytes()
            self.memory.start()
            self.bytes.start()
            try:
                t0 = now()
                with job.autocast(dtype):
                    if context_parallel:
                        out, dx = s.step(data["x"], data["cos"], data["sin"], data["d_out"])
                    else:
                        x_local, cos, sin, d_out = (local[k] for k in ("x", "cos", "sin", "d_out"))
                        x_local.requires_grad_(True)
                        out = s.forward(x_local, cos, sin)
                        out.backward(d_out.to(out.dtype))
                        dx = x_local.grad
                seconds = now() - t0
            except Exception as e:  # noqa: BLE001 - the system is reported broken with this text
                seconds = float("nan")
                result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
                result["trace"] = traceback.format_exc()[-3000:]
            sent = self.bytes.stop()
            result["bytes"] = s.measured_bytes(sent)
            result["memory"] = self.memory.stop()
        else:
            seconds, result["bytes"], result["memory"] = 0.0, 0, 0
        failed = _flag_any(result["error"] is not None)
        if failed:
            result["error"] = result["error"] or "failed on another rank"
            return result
        result["seconds"] = _max(seconds)
        result["bytes"] = int(_max(result["bytes"]))
        result["memory"] = int(_max(result["memory"]))
        if collect:
            if s.parallel:
                part = s.partition
                result["out"] = _gather_rows(out, part, self.p)
                result["dx"] = _gather_rows(dx, part, self.p)
                grads = [q.grad.detach().float().clone() for q in s.parameters()]
                for g in grads:
                    dist.all_reduce(g)
                result["grads"] = grads
            elif self.rank == 0:
                result["out"] = out.detach().float()
                result["dx"] = dx.detach().float()
                result["grads"] = [q.grad.detach().float().clone() for q in s.parameters()]
        return result

    # --- checks -----------------------------------------------------------------------------
    def _rel_error(self, res: dict, ref: tuple) -> tuple[float, str]:
        worst, where = 0.0, ""
        pairs = [("output", res["out"], ref[0]), ("dX", res["dx"], ref[1])]
        pairs += [(f"d {n}", a, b) for n, a, b in zip(self.parameter_names, res["grads"], ref[2])]
        for name, a, b in pairs:
            e = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            if e > worst or not where:
                worst, where = e, name
        return worst, where

    def _reference(self, seq: int, dtype: str, data: dict):
        base = self.systems[0]
        assert not base.parallel
        key = (seq, dtype)
        if key not in self.reference:
            res = self._step(base, seq, dtype, data, collect=True)
            if res["error"]:
                raise RuntimeError(f"the single-process layer failed: {res['error']}")
            # every rank records the key (same collectives on every rank); rank 0 the tensors
            self.reference[key] = (res["out"], res["dx"], res["grads"]) if self.rank == 0 else None
        return self.reference[key]

    def run(self) -> list[dict]:
        opts = self.opts
        for dtype in opts["dtypes"]:
            for seq in opts["seqs"]:
                self._run_point(seq, dtype)
        return self.records

    def _run_point(self, seq: int, dtype: str) -> None:
        x, d_out = job.inputs(seq)
        cos, sin = job.rope_table(self.rotary, seq)
        data = dict(x=x, d_out=d_out, cos=cos, sin=sin)
        elem = 2 if dtype == "bf16" else 4
        base_bytes = job.eager_attention_bytes(seq, dtype)
        limit = self.opts["memory_limit"]
        baseline_fits = base_bytes <= limit
        records = {}
        for s in self.systems:
            records[s.name] = dict(system=s.name, P=self.p, S=seq, dtype=dtype, version=s.version(),
                                   partition=s.partition if s.parallel else "all", times=[],
                                   formula_bytes=(s.formula_bytes(seq, self.p, elem)
                                                  if s.parallel else 0))
        for name, why in self.unavailable.items():
            self.records.append(dict(system=name, P=self.p, S=seq, dtype=dtype, status="unavailable", reason=why))
        ref32 = ref = None
        if baseline_fits:
            ref32 = self._reference(seq, "float32", data)
            ref = self._reference(seq, dtype, data)
        base_err = None
        if self.rank == 0 and ref is not None and dtype != "float32":
            base_err, _ = self._rel_error(dict(out=ref[0], dx=ref[1], grads=ref[2]), ref32)
        live = []
        for s in self.systems:
            rec = records[s.name]
            if not s.parallel and not baseline_fits:
                rec.update(status="infeasible", reason=(
                    f"eager attention needs ~{base_bytes / 2**30:.1f} GiB (4 S x S x H float32 tensors) > "
                    f"{limit / 2**30:.1f} GiB allowed (--memory-limit-gib)"))
                continue
            res = self._step(s, seq, dtype, data, collect=baseline_fits, exact=True)
            if res["error"]:
                rec.update(status="failed", reason=res["error"], trace=res.get("trace", ""))
                continue
            status, err, where = "ok", None, ""
            if self.rank == 0 and baseline_fits:
                err, where = self._rel_error(res, ref32)
                bound = TOLERANCE_F32 if dtype == "float32" else max(BF16_FACTOR * (base_err or 0.0), BF16_FLOOR)
                rec.update(max_error=err, max_error_at=where, error_bound=bound)
                if not err <= bound:
                    status = "wrong"
            flag = torch.tensor([1.0 if status == "ok" else 0.0])
            dist.broadcast(flag, 0)
            if flag.item() < 1:
                rec.update(status="wrong", reason=f"max relative error {err:.3g} at {where} > bound"
                           if self.rank == 0 else "wrong")
                continue
            rec.update(status="ok" if baseline_fits else "unchecked", check_seconds=res["seconds"],
                       memory=res["memory"], bytes=res["bytes"])
            live.append(s)
        for rep in range(self.opts["reps"]):
            k = rep % max(len(live), 1)
            for s in live[k:] + live[:k]:
                res = self._step(s, seq, dtype, data, collect=False)
                rec = records[s.name]
                if res["error"]:
                    rec.update(status="failed", reason=res["error"])
                    continue
                rec["times"].append(res["seconds"])
                if rec.get("bytes") != res["bytes"]:
                    rec["bytes_varied"] = True
        for rec in records.values():
            t = sorted(rec["times"])
            if t:
                rec["median_seconds"] = t[len(t) // 2] if len(t) % 2 else 0.5 * (t[len(t) // 2 - 1] + t[len(t) // 2])
            self.records.append(rec)
        if self.rank == 0:
            stamp = datetime.datetime.now().strftime("%H:%M:%S")
            done = ", ".join(f"{r['system']}={r.get('median_seconds', float('nan')):.2f}s" for r in records.values())
            print(f"[{stamp}] P={self.p} S={seq} {dtype}: {done}", flush=True)

    def _forward_error(self, s, data: dict, ref_out) -> str:
        """The forward alone against the single process (tells a wrong forward from a missing
        backward); '' when it matches. Raises _ForwardRaised (agreed on every rank) when the
        forward itself raises."""
        if isinstance(s, systems_mod.TorchContextParallel):
            return ""
        part = s.partition
        try:
            with torch.no_grad():
                out = s.forward(*(job.shard(data[k], part, self.p, self.rank) for k in ("x", "cos", "sin")))
            failed = ""
        except Exception as e:  # noqa: BLE001
            failed = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
        if _flag_any(bool(failed)):
            raise _ForwardRaised(failed or "failed on another rank")
        full = _gather_rows(out, part, self.p)
        if self.rank != 0:
            return ""
        err = float((full - ref_out).abs().max() / ref_out.abs().max())
        return "" if err <= TOLERANCE_F32 else f"output wrong (max relative error {err:.3g})"

    def smoke(self) -> dict:
        """Each system once at a tiny S against the single-process layer, in order. A system that
        raises may leave point-to-point transfers posted on this process group (yunchang's ring
        posts its sends before its kernel fails), so the group stops at the first failure and the
        driver starts a fresh one for the systems not yet tried."""
        seq = 16 * 2 * self.p
        x, d_out = job.inputs(seq)
        cos, sin = job.rope_table(self.rotary, seq)
        data = dict(x=x, d_out=d_out, cos=cos, sin=sin)
        ref = self._reference(seq, "float32", data)
        out = dict(passed=[], failed={}, wrong={}, unavailable=dict(self.unavailable))
        for s in self.systems[1:]:
            try:
                forward = self._forward_error(s, data, ref[0] if ref else None)
            except _ForwardRaised as e:
                out["failed"][s.name] = f"forward: {e}"
                break
            res = self._step(s, seq, "float32", data, collect=True)
            if res["error"]:
                out["failed"][s.name] = res["error"] + (f"; forward alone: {forward}" if forward else "")
                out["trace"] = res.get("trace", "")
                break
            if self.rank == 0:
                err, where = self._rel_error(res, ref)
                if not err <= TOLERANCE_F32:
                    out["wrong"][s.name] = f"max relative error {err:.3g} at {where} (S={seq}, float32)"
                    continue
            out["passed"].append(s.name)
        return out


def main(rank: int, p: int, port: int, opts: dict, out_path: str, mode: str = "run") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(p),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    timeout = opts["smoke_timeout"] if mode == "smoke" else opts["timeout"]
    dist.init_process_group("gloo", rank=rank, world_size=p, timeout=datetime.timedelta(seconds=timeout))
    try:
        runner = Runner(rank, p, opts)
        result = runner.smoke() if mode == "smoke" else runner.run()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a poisoned group after a failed peer
            pass
