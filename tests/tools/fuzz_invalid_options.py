#!/usr/bin/env python3
"""Fuzz harness: hostile inputs for every command, generated from the tool's own --help (so a new
option is covered the day it is added), in these families:
  - option values: for each option whose help gives a type (INT, FLOAT, BOOLEAN, TEXT:{choices})
    or a range ([lo - hi], POSITIVE, NONNEGATIVE), values it does not accept: by its own
    declaration every option's (just outside the range, 0 or -1 where excluded, not finite or
    huge for a FLOAT, not one of the choices), and of its type's one conversion two of the list
    (not a number, empty, overflowing), the options of a type taking the list in turn;
  - path arguments: for each option whose help marks a path (OUTPUT_FILE, OUTPUT_FOLDER,
    INPUT_FILE, INPUT_FOLDER, INPUT_PATH, PROFILE_OR_INPUT_FILE; tools/option_checks.h), one path
    of its kind's list, the options of a kind taking them in turn: under a missing folder, under a
    regular file, a folder for a file, a file for a folder, a missing file;
  - torchrun-style environments (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) that are
    malformed or name a host that does not resolve, for the commands that run ranks;
and it asserts for each invocation:
  - exit code 2 (invalid input, README "Exit codes") within the time bound;
  - an "mlacp:" line that names the option (or the variable);
  - no stack trace, no C++ runtime text, no LibTorch/c10d log line, no unreadable number (a run of
    20 digits: CLI11's own ranges print the largest double in full);
  - no process left in its session, no file left in its working folder or $TMPDIR.
A last family damages a checkpoint of two generations (trained once, copied per case) and
resumes from it (see checkpoint_cases): a damaged newest generation is an error of kind fault
(exit 4) naming the damaged file and the older generation, --resume-fallback takes that one, and
what a kill leaves (a .partial or .pruning folder) or a damaged older generation is passed over.
Every invocation runs in its own session (process group) with a memory limit; MLACP_FUZZ_JOBS
invocations (default 2) run at a time.
Usage: fuzz_invalid_options.py MLACP
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

COMMANDS = ["info", "verify", "bench", "bench-kernel", "train", "plan"]
TIME_LIMIT_S = 30
MEMORY_LIMIT = 8 << 30
FORBIDDEN = ["frame #", "Exception raised from", "terminate called", "Segmentation fault", "std::bad_alloc",
             "what():", "Traceback", "not in range", "[c10d]", "Logging before InitGoogleLogging"]
UNREADABLE = re.compile(r"[0-9]{20}|^[IWEF][0-9]{8} ", re.M)  # a 309-digit bound; a glog line

OPTION = re.compile(r"^\s+(?:-\w,)?(--[a-z][a-z0-9-]*)\s+([A-Z]+)(?::(\{[^}]*\}|INT in \[[^\]]*\]|FLOAT in \[[^\]]*\]|"
                    r"[A-Z_]+(?: in \[[^\]]*\])?))?")
A_FILE = "a_file"  # a regular file in every invocation's working folder

# Paths no option of the kind accepts, relative to the working folder.
BAD_PATHS = {
    "OUTPUT_FILE": ["missing/out.json", A_FILE + "/out.json", "."],
    "OUTPUT_FOLDER": [A_FILE, A_FILE + "/sub"],
    "INPUT_FILE": ["missing.json", "."],
    "INPUT_FOLDER": ["missing", A_FILE],
    "INPUT_PATH": ["missing", "/dev/null"],
    "PROFILE_OR_INPUT_FILE": ["no-such-profile", "."],
}


def options_of(mlacp, command):
    text = subprocess.run([mlacp] + ([command] if command else []) + ["--help"], capture_output=True, text=True,
                          timeout=60).stdout
    found = {}
    for line in text.splitlines():
        m = OPTION.match(line)
        if m and m.group(1) not in found:
            found[m.group(1)] = (m.group(2), m.group(3) or "")
    return found


def generic_values(kind):
    """Values no option of the type accepts, whatever its range: they exercise the type's one
    conversion (tools/option_checks.h), so the options of a type take them in turn."""
    if kind in ("INT", "UINT"):
        return ["abc", "", "1e999", "99999999999999999999999999"]
    if kind == "FLOAT":
        return ["abc", "", "1e999x"]
    if kind == "BOOLEAN":
        return ["maybe", "2"]
    return []


def bad_values(kind, detail):
    """Values this option rejects by its own declaration: just outside its range, 0 or -1 where it
    excludes them, not one of its choices."""
    values = []
    if kind == "FLOAT":  # numbers the conversion takes: the option's own check must refuse them
        values += ["nan", "99999999999999999999999999"]
    if kind in ("INT", "FLOAT", "UINT"):
        r = re.search(r"\[(-?[0-9.e+]+) - (-?[0-9.e+]+)\]", detail)
        if r and kind != "FLOAT":
            lo, hi = int(float(r.group(1))), int(float(r.group(2)))
            values += [str(lo - 1), str(hi + 1)]
        elif r:
            lo, hi = float(r.group(1)), float(r.group(2))
            values += [repr(lo - 0.5), repr(hi * 2 + 1)]
        if "POSITIVE" in detail:
            values += ["0", "-1"]
        if "NONNEGATIVE" in detail:
            values += ["-1"]
    elif kind == "TEXT" and detail.startswith("{"):
        values += ["not-a-choice"]
    elif kind == "TEXT" and detail == "INTERFACES":
        values += ["no-such-iface0", "lo,", "lo,,lo"]
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


def limited(argv):
    """argv under the memory limit (prlimit execs the command in place: same pid); the process
    itself starts a session (Popen's start_new_session: no preexec_fn, which threads make unsafe)."""
    return argv if SANITIZED else ["prlimit", f"--as={MEMORY_LIMIT}", "--"] + argv


class Harness:
    def __init__(self, mlacp):
        self.mlacp = mlacp
        self.total = 0
        self.failures = []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(os.environ.get("MLACP_FUZZ_JOBS", "2"))))
        self.pending = []
        self.sequential = False  # one invocation at a time (they share a fixed port)

    def run(self, *args, **kwargs):
        """Queues one invocation (check_one's arguments); wait() collects them."""
        with self.lock:
            self.total += 1
        if self.sequential:
            self.check_one(*args, **kwargs)
        else:
            self.pending.append(self.pool.submit(self.check_one, *args, **kwargs))

    def wait(self):
        for done in self.pending:
            done.result()  # a harness error propagates
        self.pending = []

    def check_one(self, argv, env=None, expect_rc=2, names=(), contains=(), keep=(), setup=None):
        """Runs `mlacp argv...` in a fresh working folder (holding A_FILE and what `setup(folder)`
        makes) with a private $TMPDIR and `env` added; records a failure unless it exits
        `expect_rc` with an mlacp: line naming one of `names` (for exit 2) and the output holding
        every text of `contains`. Files named in `keep` may stay in the working folder."""
        work = tempfile.mkdtemp(prefix="mlacp-fuzz-")
        tmp, run_dir = os.path.join(work, "tmp"), os.path.join(work, "run")
        os.mkdir(tmp)
        os.mkdir(run_dir)
        open(os.path.join(run_dir, A_FILE), "w").close()
        if setup:
            setup(run_dir)
        full_env = dict(os.environ, TMPDIR=tmp, **(env or {}))
        if SANITIZED:
            full_env["ASAN_OPTIONS"] = (full_env.get("ASAN_OPTIONS", "") +
                                        f":hard_rss_limit_mb={MEMORY_LIMIT >> 20}").lstrip(":")
        start = time.monotonic()
        p = subprocess.Popen(limited([self.mlacp] + argv), cwd=run_dir, env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=TIME_LIMIT_S)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            rc = "timeout"
        took = time.monotonic() - start
        problems = []
        if rc != expect_rc:
            problems.append(f"exit {rc}, not {expect_rc}")
        lines = [l for l in out.splitlines() if "mlacp:" in l]
        if expect_rc != 0 and not lines:
            problems.append("no mlacp: line")
        elif names and not any(n in l for n in names for l in lines):
            problems.append("the mlacp: line does not name " + " or ".join(names))
        problems += [f"'{t}' not in the output" for t in contains if t not in out]
        problems += [f"'{t}' in the output" for t in FORBIDDEN if t in out]
        said = out
        for word in argv:  # the invocation's own values, echoed back, do not count
            said = said.replace(word, "") if word else said
        if UNREADABLE.search(said):
            problems.append(f"raw or unreadable text in the output: {UNREADABLE.search(said).group(0)!r}")
        time.sleep(0.05)
        left = leftover_processes(p.pid)
        if left:
            problems.append("processes left: " + " ".join(left))
            for pid in left:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        leftovers = os.listdir(tmp) + [f for f in os.listdir(run_dir) if f != A_FILE and f not in keep]
        if leftovers:
            problems.append("files left: " + " ".join(leftovers))
        if problems:
            label = " ".join(f"{k}={v}" for k, v in (env or {}).items())
            with self.lock:
                self.failures.append((label + (" " if label else "") + " ".join(argv), problems,
                                      out.strip().splitlines()[-3:], took))
        shutil.rmtree(work, ignore_errors=True)


# Values of the type's conversion an option takes (the rest go to the next options of its type):
# every option meets the conversion, every value meets several options, and the run stays
# within CI's time (each invocation loads LibTorch: about 1 s with the wheel's CUDA build).
GENERIC_PER_OPTION = 2


def option_cases(h):
    """Bad values for every typed option of every command: its own range and choices, and values of
    its type's conversion (taken in turn across the options of a type); one bad path for every
    path option (the paths of a kind taken in turn: the options of a kind share one check)."""
    turn = {}

    def in_turn(key, choices, count=1):  # the next `count` of `choices`, for the options of `key` in turn
        start = turn[key] = turn.get(key, -count) + count
        return [choices[(start + i) % len(choices)] for i in range(min(count, len(choices)))]

    for command in COMMANDS:
        for option, (kind, detail) in sorted(options_of(h.mlacp, command).items()):
            values = bad_values(kind, detail) + in_turn(kind, generic_values(kind), GENERIC_PER_OPTION)
            if kind == "TEXT" and detail in BAD_PATHS:
                values = in_turn(detail, BAD_PATHS[detail])
            for value in values:
                h.run([command, option, value], names=(option, option.lstrip("-")))
    # The options before the command (mlacp --help): e.g. --iface
    for option, (kind, detail) in sorted(options_of(h.mlacp, "").items()):
        if kind == "TEXT" and detail == "INTERFACES":
            for value in bad_values(kind, detail):
                h.run([option, value, "info", "--skip-gemm"], names=(option, option.lstrip("-")))


# The commands that run ranks, each with a small run (the environment is checked before it).
RANK_COMMANDS = [["verify", "--case", "latent-p2-u2-head_tail", "--timeout", "5"],
                 ["bench", "--steps", "1", "--seq", "64", "--timeout", "5"],
                 ["train", "--preset", "test", "--steps", "1", "--seq", "32", "--timeout", "5"]]
GOOD_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


def environment_cases(h):
    """torchrun-style variables that no launch accepts, each once, taking the commands in turn
    (they share one reader, world_from_env, and one rendezvous): a MASTER_ADDR that does not
    resolve (c10d's store retried it with a log line a second), malformed numbers."""
    broken = [("MASTER_ADDR", "no-such-host.invalid"), ("MASTER_ADDR", ""), ("MASTER_ADDR", "bad host!"),
              ("MASTER_PORT", "0"), ("MASTER_PORT", "65536"), ("MASTER_PORT", "abc"), ("RANK", "2"), ("RANK", "-1"),
              ("RANK", "x"), ("WORLD_SIZE", "0"), ("WORLD_SIZE", "abc"), ("LOCAL_RANK", "abc"),
              ("LOCAL_WORLD_SIZE", "0"), ("LOCAL_WORLD_SIZE", "abc"), ("GROUP_RANK", "x"),
              ("GLOO_SOCKET_IFNAME", "no-such-iface0")]
    for i, (name, value) in enumerate(broken):
        h.run(RANK_COMMANDS[i % len(RANK_COMMANDS)], env=dict(GOOD_ENV, **{name: value}), names=(name,))


# ---- checkpoint damage -----------------------------------------------------------------------------

TRAIN = ["train", "--nproc", "1", "--preset", "test", "--seq", "32"]
NEWEST, OLDER = "step-00000002", "step-00000001"
SHARD = "tp0-of-1.pt"


def edit_meta(path, change):
    with open(path) as f:
        meta = json.load(f)
    change(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def swap(a, b):
    os.rename(a, a + ".swap")
    os.rename(b, a)
    os.rename(a + ".swap", b)


# Damage to one generation folder: (name, function of the folder, the damaged file's name in it).
DAMAGE = [
    ("meta.json missing", lambda g: os.remove(os.path.join(g, "meta.json")), "meta.json"),
    ("meta.json not JSON", lambda g: open(os.path.join(g, "meta.json"), "w").write("{not json"), "meta.json"),
    ("meta.json lacks a field", lambda g: edit_meta(os.path.join(g, "meta.json"), lambda m: m.pop("data_position")),
     "meta.json"),
    ("negative step", lambda g: edit_meta(os.path.join(g, "meta.json"), lambda m: m.update(step=-m["step"])),
     "meta.json"),
    ("meta.json and shard swapped", lambda g: swap(os.path.join(g, "meta.json"), os.path.join(g, SHARD)), "meta.json"),
    ("shard missing", lambda g: os.remove(os.path.join(g, SHARD)), SHARD),
    ("shard truncated", lambda g: os.truncate(os.path.join(g, SHARD), os.path.getsize(os.path.join(g, SHARD)) // 2),
     SHARD),
]


def checkpoint_cases(h, base):
    """`base`: a checkpoint folder with generations step 1 and step 2. Each case resumes from a
    damaged copy (in the working folder, kept there as `ckpt`)."""
    resume = TRAIN + ["--steps", "3", "--checkpoint", "ckpt", "--resume"]

    def copy(damage_newest=None, damage_older=None, extra=None):
        def setup(run_dir):
            ckpt = os.path.join(run_dir, "ckpt")
            shutil.copytree(base, ckpt)
            if damage_newest:
                damage_newest(os.path.join(ckpt, NEWEST))
            if damage_older:
                damage_older(os.path.join(ckpt, OLDER))
            if extra:
                extra(ckpt)
        return setup

    for name, damage, file in DAMAGE:  # the newest generation: an error, or the fallback when asked
        h.run(resume, expect_rc=4, setup=copy(damage), keep=("ckpt",),
              contains=("the newest checkpoint generation is damaged", f"file=ckpt/{NEWEST}/{file}",
                        f"older_complete=ckpt/{OLDER} (step 1)", "--resume-fallback"))
    for name, damage, file in DAMAGE[::4]:
        h.run(resume + ["--resume-fallback"], expect_rc=0, setup=copy(damage), keep=("ckpt",),
              contains=(f"resumed from ckpt/{OLDER}", f"passed over the damaged ckpt/{NEWEST}/{file}"))
    # Damage only loading sees: the older generation's shard in the newest folder.
    h.run(resume, expect_rc=4, keep=("ckpt",),
          setup=copy(lambda g: shutil.copy(os.path.join(os.path.dirname(g), OLDER, SHARD), os.path.join(g, SHARD))),
          contains=("checkpoint shard and meta.json disagree", f"to resume from ckpt/{OLDER}"))
    for name, damage, file in DAMAGE[::5]:  # the older generation: passed over
        h.run(resume, expect_rc=0, setup=copy(damage_older=damage), keep=("ckpt",),
              contains=(f"resumed from ckpt/{NEWEST}",))
    # What kills leave: a cut save, a cut prune.
    def leftovers(ckpt):
        for folder in [".step-00000003.partial", ".step-00000000.pruning"]:
            os.mkdir(os.path.join(ckpt, folder))
            open(os.path.join(ckpt, folder, SHARD), "w").write("half")
    h.run(resume, expect_rc=0, setup=copy(extra=leftovers), keep=("ckpt",), contains=(f"resumed from ckpt/{NEWEST}",))
    # The newest damaged with nothing older to fall back to.
    h.run(resume + ["--resume-fallback"], expect_rc=4, keep=("ckpt",),
          setup=copy(DAMAGE[0][1], extra=lambda ckpt: shutil.rmtree(os.path.join(ckpt, OLDER))),
          contains=("no complete generation is left to fall back to",))


def main():
    mlacp = os.path.realpath(sys.argv[1])
    h = Harness(mlacp)
    families = []  # (name, invocations, seconds)

    def family(name, cases, *args, sequential=False):
        count, start = h.total, time.monotonic()
        h.sequential = sequential
        cases(h, *args)
        h.wait()
        families.append((name, h.total - count, time.monotonic() - start))

    family("option values and paths", option_cases)
    family("torchrun-style environments", environment_cases, sequential=True)  # all on MASTER_PORT 29400
    base = tempfile.mkdtemp(prefix="mlacp-fuzz-ckpt-")
    try:
        trained = subprocess.run([mlacp] + TRAIN + ["--steps", "2", "--checkpoint-every", "1", "--checkpoint",
                                                    os.path.join(base, "ckpt")], capture_output=True, text=True,
                                 timeout=120)
        if trained.returncode != 0:
            print("FAIL: the checkpoint to damage was not written:\n" + trained.stdout + trained.stderr)
            return 1
        family("checkpoint damage", checkpoint_cases, os.path.join(base, "ckpt"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name, count, seconds in families:
        print(f"{name}: {count} invocations in {seconds:.0f} s")
    for argv, problems, tail, took in h.failures:
        print(f"FAIL: mlacp {argv!r} ({took:.1f} s): {'; '.join(problems)}")
        for line in tail:
            print("    " + line[:300])
    print(f"{h.total} invalid invocations, {h.total - len(h.failures)} clear errors, {len(h.failures)} failures")
    if h.total < 200:
        print(f"FAIL: only {h.total} invocations generated (the --help parser may be broken)")
        return 1
    if h.failures:
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
