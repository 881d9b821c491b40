#!/usr/bin/env python3
"""Device-assumption check (docs/DESIGN.md §16): the library takes its device from the tensors, so
every place in src/ and include/ that names the CPU device must say why it may.

A line that names the CPU device (kCPU, DeviceType::CPU, is_cpu(), .cpu(), CPUGeneratorImpl,
Device("cpu")) passes when
  - its file is CPU-only by purpose (CPU_ONLY below, each with its reason), or
  - the line, or the line above it, carries a "device:" comment giving the reason
    (e.g. "// device: host metadata stays on the CPU").
Anything else fails, naming the file and the line: code that would quietly run on the CPU, or
reject a GPU tensor, where the tensors' device should decide.

Usage: check_device_assumptions.py ROOT   (exit 1 with one line per unjustified mention)
       check_device_assumptions.py --expect FILE ROOT   (exit 0 iff the "file:line" of each reported
       mention equals FILE's lines: the checker's own test on a fixture tree)
"""
import fnmatch
import pathlib
import re
import sys

# Files whose whole purpose is the CPU (paths from ROOT, fnmatch patterns), each with its reason.
CPU_ONLY = {
    "src/kernels/blockwise_*": "the CPU's flash-style kernel (AVX-512, host threads)",
    "src/kernels/segmented_attention*": "the blockwise kernel's row segments",
    "src/kernels/float32_gemm*": "LibTorch's sgemm_ routed to oneDNN on CPU hosts",
    "src/kernels/gemm_rate*": "this host's CPU GEMM rate (mlacp info)",
    "src/core/host_*": "the host allocator and host memory",
    "src/core/memory_probe*": "the CPU allocator's byte counter",
    "src/core/threads*": "intra-op threads and the CPU scheduler",
    "src/core/device*": "the device helpers themselves (the CPU is one of their cases)",
    "src/core/compat.h": "LibTorch's per-device autocast API (the CPU is one of its cases)",
    "src/planner/calibrate.cpp": "calibrates this CPU host (two local Gloo ranks)",
    "src/check/single_device_checks*": "the CPU oracle's checks of itself (verify --single-device)",
}
PATTERN = re.compile(r'kCPU|DeviceType::CPU|is_cpu\(\)|\.cpu\(\)|CPUGeneratorImpl|Device\("cpu"\)')


def problems(root: pathlib.Path):
    files = sorted(p for p in list(root.glob("src/**/*")) + list(root.glob("include/mlacp/*"))
                   if p.suffix in (".h", ".hpp", ".cpp", ".cc"))
    found, justified = [], 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        if any(fnmatch.fnmatch(rel, glob) for glob in CPU_ONLY):
            continue
        previous = ""
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PATTERN.search(line):
                if "device:" in line or "device:" in previous:
                    justified += 1
                else:
                    found.append(f"{rel}:{number} names the CPU device without a \"device:\" reason: {line.strip()}")
            previous = line
    return found, justified


def main() -> int:
    args = sys.argv[1:]
    if len(args) == 3 and args[0] == "--expect":
        found, _ = problems(pathlib.Path(args[2]))
        got = [line.split(" ", 1)[0] for line in found]
        want = pathlib.Path(args[1]).read_text(encoding="utf-8").split()
        print("\n".join(found))
        print("as expected" if got == want else f"expected {want}, got {got}")
        return 0 if got == want else 1
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    found, justified = problems(pathlib.Path(args[0]))
    for line in found:
        print(line)
    if found:
        print("device assumptions (docs/DESIGN.md §16): take the device from the tensors, or say why the CPU is "
              "meant with a \"// device: <reason>\" comment on the line or above it")
        return 1
    print(f"device assumptions: {justified} justified mentions of the CPU device outside CPU-only files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
