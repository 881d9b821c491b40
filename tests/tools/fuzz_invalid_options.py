#!/usr/bin/env python3
"""Fuzz harness: invalid values for every typed option of every command, generated from the
tool's own --help (so a new option is covered the day it is added).

For each command (info, verify, bench, bench-kernel, train, plan) and each option whose help gives a
type (INT, FLOAT, BOOLEAN, TEXT:{choices}) or a range [lo - hi], it runs `mlacp <command>
--option VALUE` with values that no such option accepts (not a number, empty, overflowing,
just outside the range, not one of the choices) and asserts for each invocation:
  - exit code 2 (invalid input, README "Exit codes") within the time bound;
  - an "mlacp:" line that names the option;
  - no stack trace or C++ runtime text;
  - no process left in its session, no file left in its working folder or $TMPDIR.
Every invocation runs in its own session (process group) with a memory limit.
Usage: fuzz_invalid_options.py MLACP
"""
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

COMMANDS = ["info", "verify", "bench", "bench-kernel", "train", "plan"]
TIME_LIMIT_S = 30
MEMORY_LIMIT = 8 << 30
FORBIDDEN = ["frame #", "Exception raised from", "terminate called", "Segmentation fault", "std::bad_alloc",
             "what():", "Traceback"]

OPTION = re.compile(r"^\s+(?:-\w,)?(--[a-z][a-z0-9-]*)\s+([A-Z]+)(?::(\{[^}]*\}|INT in \[[^\]]*\]|FLOAT in \[[^\]]*\]|"
                    r"[A-Z]+(?: in \[[^\]]*\])?|POSITIVE|NONNEGATIVE))?")


def options_of(mlacp, command):
    text = subprocess.run([mlacp, command, "--help"], capture_output=True, text=True, timeout=60).stdout
    found = {}
    for line in text.splitlines():
        m = OPTION.match(line)
        if m and m.group(1) not in found:
            found[m.group(1)] = (m.group(2), m.group(3) or "")
    return found


def bad_values(kind, detail):
    values = []
    if kind in ("INT", "FLOAT"):
        values += ["abc", "", "1e999" if kind == "INT" else "1e999x", "99999999999999999999999999"]
        r = re.search(r"\[(-?[0-9.e+]+) - (-?[0-9.e+]+)\]", detail)
        if r and kind == "INT":
            lo, hi = int(float(r.group(1))), int(float(r.group(2)))
            values += [str(lo - 1), str(hi + 1)]
        if "POSITIVE" in detail:
            values += ["0", "-1"]
    elif kind == "BOOLEAN":
        values += ["maybe", "2"]
    elif kind == "TEXT" and detail.startswith("{"):
        values += ["not-a-choice"]
    return values


def leftover_processes(session):
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == session and int(pid) != session:  # fields[3]: session id
                left.append(pid)
        except (OSError, IndexError, ValueError):
            pass
    return left


# AddressSanitizer reserves terabytes of shadow address space, so a sanitized build (the suite
# under ASan/UBSan, README "Tests") is bounded by the sanitizer's own resident-size limit instead.
SANITIZED = os.environ.get("MLACP_SANITIZED") == "1"


def limit_memory():
    os.setsid()
    if not SANITIZED:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def main():
    mlacp = os.path.realpath(sys.argv[1])
    failures, total = [], 0
    for command in COMMANDS:
        for option, (kind, detail) in sorted(options_of(mlacp, command).items()):
            for value in bad_values(kind, detail):
                total += 1
                work = tempfile.mkdtemp(prefix="mlacp-fuzz-")
                tmp = os.path.join(work, "tmp")
                os.mkdir(tmp)
                run_dir = os.path.join(work, "run")
                os.mkdir(run_dir)
                env = dict(os.environ, TMPDIR=tmp)
                if SANITIZED:
                    env["ASAN_OPTIONS"] = (env.get("ASAN_OPTIONS", "") +
                                           f":hard_rss_limit_mb={MEMORY_LIMIT >> 20}").lstrip(":")
                argv = [mlacp, command, option, value]
                start = time.monotonic()
                p = subprocess.Popen(argv, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=limit_memory)
                try:
                    out, _ = p.communicate(timeout=TIME_LIMIT_S)
                    rc = p.returncode
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    out, _ = p.communicate()
                    rc = "timeout"
                took = time.monotonic() - start
                problems = []
                if rc != 2:
                    problems.append(f"exit {rc}, not 2")
                lines = [l for l in out.splitlines() if "mlacp:" in l]
                if not lines:
                    problems.append("no mlacp: line")
                elif not any(option in l or option.lstrip("-") in l for l in lines):
                    problems.append("the mlacp: line does not name " + option)
                problems += [f"'{t}' in the output" for t in FORBIDDEN if t in out]
                time.sleep(0.05)
                left = leftover_processes(p.pid)
                if left:
                    problems.append("processes left: " + " ".join(left))
                    for pid in left:
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except OSError:
                            pass
                leftovers = os.listdir(tmp) + os.listdir(run_dir)
                if leftovers:
                    problems.append("files left: " + " ".join(leftovers))
                if problems:
                    failures.append((" ".join(argv[1:]), problems, out.strip().splitlines()[-3:], took))
                shutil.rmtree(work, ignore_errors=True)
    for argv, problems, tail, took in failures:
        print(f"FAIL: mlacp {argv!r} ({took:.1f} s): {'; '.join(problems)}")
        for line in tail:
            print("    " + line[:300])
    print(f"{total} invalid invocations, {total - len(failures)} clear errors, {len(failures)} failures")
    if total < 200:
        print(f"FAIL: only {total} invocations generated (the --help parser may be broken)")
        return 1
    if failures:
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
