"""The report: results.json (every record), table.md (summary and details), steps.png."""
from __future__ import annotations

import json
import os
import platform


def machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def _derive(records: list[dict]) -> None:
    """Efficiency against the same run's single-process time; mlacp's best speed-up over each."""
    by_point: dict = {}
    for r in records:
        by_point.setdefault((r["P"], r["S"], r["dtype"]), []).append(r)
    for (p, _, _), rs in by_point.items():
        base = next((r for r in rs if r["system"].startswith("hf-eager") and r.get("median_seconds")), None)
        timed = [r for r in rs if r.get("median_seconds")]
        mlacp = [r for r in timed if r["system"].startswith("mlacp")]
        best = min(mlacp, key=lambda r: r["median_seconds"]) if mlacp else None
        for r in timed:
            if base is not None and r is not base:
                r["efficiency"] = base["median_seconds"] / (p * r["median_seconds"])
            if best is not None and not r["system"].startswith(("mlacp", "hf-")):
                r["mlacp_best"] = best["system"]
                r["mlacp_speedup"] = r["median_seconds"] / best["median_seconds"]


def _fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def _summary(records: list[dict]) -> list[str]:
    """One row per (P, dtype, timed system), one column per S: the median step, the efficiency
    and, for a peer, how many times slower than mlacp's best at that point."""
    seqs = sorted({r["S"] for r in records})
    lines = ["\nMedian step time (forward + backward) in s; (eff) = single-process time / (P × time); "
             "for a peer, ×k = it is k times slower than mlacp's fastest configuration at that point.\n",
             "| P | dtype | system | " + " | ".join(f"S = {s}" for s in seqs) + " |",
             "|---|---|---|" + "---|" * len(seqs)]
    for p in sorted({r["P"] for r in records}):
        for dtype in [d for d in ("float32", "bf16") if any(r["dtype"] == d for r in records)]:
            rows = [r for r in records if r["P"] == p and r["dtype"] == dtype]
            timed = [n for n in dict.fromkeys(r["system"] for r in rows)
                     if any(x.get("median_seconds") for x in rows if x["system"] == n)]
            for name in timed:
                cells = []
                for s in seqs:
                    r = next((x for x in rows if x["system"] == name and x["S"] == s), None)
                    if r is None:
                        cells.append("")
                    elif r.get("median_seconds") is None:
                        cells.append(r.get("status", "?"))
                    else:
                        cell = f"{r['median_seconds']:.2f}"
                        if "efficiency" in r:
                            cell += f" ({r['efficiency']:.2f})"
                        if "mlacp_speedup" in r:
                            cell += f" ×{r['mlacp_speedup']:.2f}"
                        cells.append(cell)
                lines.append(f"| {p} | {dtype} | {name} | " + " | ".join(cells) + " |")
    return lines


def _details(records: list[dict]) -> list[str]:
    lines = ["\n| P | dtype | S | system | status | median s | reps | peak MiB/rank | MiB sent/rank | "
             "formula MiB | max rel. error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["P"], r["dtype"] != "float32", r["S"])):
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        lines.append("| " + " | ".join([
            str(r["P"]), r["dtype"], str(r["S"]), r["system"], r.get("status", "?"),
            _fmt(r.get("median_seconds"), ".3f"), str(len(r.get("times", []))),
            _fmt(mib(r.get("memory")), ".0f"), _fmt(mib(r.get("bytes")), ".2f"),
            _fmt(mib(r.get("formula_bytes")), ".2f"),
            _fmt(r.get("max_error"), ".1e") + (f" ({r['max_error_at']})" if r.get("max_error_at") else "")]) + " |")
    reasons = {}
    for r in records:
        if r.get("reason"):
            reasons.setdefault(r["system"], set()).add(r["reason"])
    from .systems import GPU_ONLY

    lines.append("\nNot run on this machine (GPU only):\n")
    for name, why in GPU_ONLY.items():
        lines.append(f"- **{name}**: {why}")
    if reasons:
        lines.append("\nNot timed:\n")
        for name, why in reasons.items():
            for w in sorted(why):
                lines.append(f"- **{name}**: {w}")
    return lines


def _plot(out: str, records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r["P"] for r in records})
    dtypes = [d for d in ("float32", "bf16") if any(r["dtype"] == d for r in records)]
    fig, axes = plt.subplots(len(ps), len(dtypes), figsize=(6 * len(dtypes), 4.2 * len(ps)), squeeze=False)
    for ax, (p, dtype) in zip(axes.flat, [(p, d) for p in ps for d in dtypes]):
        rows = [r for r in records if r["P"] == p and r["dtype"] == dtype and r.get("median_seconds")]
        for name in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((r["S"], r["median_seconds"]) for r in rows if r["system"] == name)
            style = "-o" if name.startswith("mlacp") else ("--s" if name.startswith("hf") else ":^")
            ax.plot([s for s, _ in pts], [t for _, t in pts], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global sequence length S")
        ax.set_ylabel("median step time (s), forward+backward")
        ax.set_title(f"P = {p}, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "steps.png"), dpi=110)
    plt.close(fig)


def write(out: str, meta: dict, records: list[dict]) -> None:
    _derive(records)
    for r in records:
        if r.get("status") == "ok":
            r.pop("trace", None)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    lines = [f"Machine: {meta['machine']}; torch {meta['torch']}; {meta['backend']}; "
             f"{meta['threads_per_rank']} intra-op thread per rank; command `{meta['command']}` "
             f"({meta['seconds']} s)."]
    versions = sorted({r["version"] for r in records if r.get("version")})
    lines.append("Versions: " + "; ".join(versions) + ".")
    lines += _summary(records)
    lines += _details(records)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(out, records)


def _same_s_peaks(results: list[dict], probes: list[dict]) -> list[str]:
    """The probes every system ran (the doubling points): peak per rank at the same S, and the
    leanest mlacp configuration's against DeepSpeed-Ulysses's."""
    peer = "deepspeed-ulysses (V padded)"
    lines = ["", "Peak memory per rank at the same S (the doubling probes that fit: the cgroup's peak, else the "
             "resident peak, MiB; over = OOM-killed at the cap):", "", "| P | dtype | S | " +
             " | ".join(dict.fromkeys(r["system"] for r in results)) + " | leanest mlacp / DeepSpeed |",
             "|---|---|---|" + "---|" * (len(dict.fromkeys(r["system"] for r in results)) + 1)]
    names = list(dict.fromkeys(r["system"] for r in results))
    for p, dtype in dict.fromkeys((r["P"], r["dtype"]) for r in results):
        here = [x for x in probes if x["P"] == p and x["dtype"] == dtype]
        seqs = sorted({x["S"] for x in here if all(any(y["S"] == x["S"] and y["system"] == n for y in here)
                                                   for n in names)})
        for seq in seqs:
            cells, peak = [], {}
            for n in names:
                x = next(y for y in here if y["S"] == seq and y["system"] == n)
                got = x.get("cgroup_peak") or x.get("resident")  # the cgroup's, else the measured resident peak
                if x["fits"] and got:
                    peak[n] = got
                    cells.append(f"{got / 2**20:.0f}")
                else:
                    cells.append("over" if x.get("reason", "").startswith("OOM") else x.get("reason", "-"))
            mine = [v for n, v in peak.items() if n.startswith("mlacp")]
            ratio = f"{min(mine) / peak[peer]:.2f}" if mine and peer in peak else "-"
            over = next((y for y in here if y["S"] == seq and y["system"] == peer and not y["fits"]), None)
            if mine and over is not None and over.get("cgroup_peak"):  # DeepSpeed needed more than the cap
                ratio = f"< {min(mine) / over['cgroup_peak']:.2f}"
            lines.append(f"| {p} | {dtype} | {seq} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def write_longest(out: str, meta: dict, results: list[dict], probes: list[dict]) -> None:
    """longest.json and longest.md: the longest S per system under the cap, then every probe."""
    peer = "deepspeed-ulysses (V padded)"
    for r in results:
        ds = next((x for x in results if x["P"] == r["P"] and x["dtype"] == r["dtype"] and x["system"] == peer), None)
        if ds is not None and ds is not r and ds.get("longest") and r.get("longest"):
            r["vs_deepspeed"] = r["longest"] / ds["longest"]
    with open(os.path.join(out, "longest.json"), "w") as f:
        json.dump(dict(meta=meta, results=results, probes=probes), f, indent=1)
    lines = [f"Machine: {meta['machine']}; torch {meta['torch']}; command `{meta['command']}` ({meta['seconds']} s).",
             f"Cap: {meta['cap_mib']} MiB per rank on what one forward + backward adds to the rank "
             f"(model, inputs and the rank's runtime are not counted), enforced by: {meta['enforcement']}. "
             f"S doubles from the first S, then bisects to a multiple of {meta['step']} (at most {meta['most']}).",
             "", "| P | dtype | system | longest S | first S over the cap | × DeepSpeed-Ulysses |",
             "|---|---|---|---|---|---|"]
    for r in results:
        longest = str(r["longest"]) if r.get("longest") else ("failed: " + r["failed"] if r.get("failed") else
                                                             "none (the first S is over)")
        over = str(r["first_over"]) if r.get("first_over") else (f"(> {meta['most']})" if r.get("longest") else "-")
        lines.append(f"| {r['P']} | {r['dtype']} | {r['system']} | {longest} | {over} | "
                     f"{_fmt(r.get('vs_deepspeed'), '.2f')} |")
    lines += _same_s_peaks(results, probes)
    lines += ["", "Every probe:", "", "| P | dtype | system | S | result | step s | cgroup peak MiB | "
              "resident peak MiB |", "|---|---|---|---|---|---|---|---|"]
    mib = lambda b: None if b is None else b / 2**20  # noqa: E731
    for r in probes:
        lines.append(f"| {r['P']} | {r['dtype']} | {r['system']} | {r['S']} | "
                     f"{'fits' if r['fits'] else r.get('reason', 'over')} | {_fmt(r.get('seconds'), '.1f')} | "
                     f"{_fmt(mib(r.get('cgroup_peak')), '.0f')} | {_fmt(mib(r.get('resident')), '.0f')} |")
    with open(os.path.join(out, "longest.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
