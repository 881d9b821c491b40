"""A per-rank memory cap the kernel enforces: one memory cgroup per rank, made by the driver.

A rank joins its cgroup just before its step and leaves it right after, so the cap bounds what the
step adds above what the rank already holds (model, inputs): charges stay with the cgroup a page
was first touched in (cgroup v1 without move_charge_at_immigrate; v2 never moves them). There is no
swap on these machines (and memsw/swap.max is capped where the kernel offers it), so a step that
needs more than the cap is killed by the cgroup's OOM killer: the driver sees the rank die and
reads the cgroup's OOM counter to tell that from any other death.

Needs root and a memory controller the process may create children under: cgroup v1's memory
hierarchy, or a v2 cgroup with memory in its subtree_control. ``find()`` says why not otherwise.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _, opts = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, opts))
    return out


def _own_paths() -> dict[str, str]:
    """controller list ('' for v2) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            out[controllers] = path
    return out


def join(path: str) -> None:
    """Moves the calling process (all its threads) into the cgroup at path (a rank joins its own
    cgroup before its step and goes back to Root.path after it)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


class Root:
    """Where this process's per-rank cgroups go (its own memory cgroup)."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version

    def make(self, name: str, limit: int) -> "Cgroup":
        return Cgroup(self, os.path.join(self.path, name), limit)


def _swap_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def find() -> tuple[Optional[Root], str]:
    """(Root, '') where per-rank memory cgroups can be made here, else (None, why not)."""
    if os.geteuid() != 0:
        return None, "not root (cgroups need it)"
    root, why = _find()
    if root is not None and _swap_total() > 0:
        swap_limit = "memory.memsw.limit_in_bytes" if root.version == 1 else "memory.swap.max"
        if not os.path.exists(os.path.join(root.path, swap_limit)):
            return None, f"the machine has swap and no {swap_limit} to keep a capped step out of it"
    return root, why


def _find() -> tuple[Optional[Root], str]:
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as e:
        return None, f"cannot read /proc/self/mountinfo or cgroup: {e}"
    for point, fstype, opts in mounts:
        if fstype == "cgroup" and "memory" in opts.split(","):
            rel = next((p for c, p in own.items() if "memory" in c.split(",")), None)
            if rel is not None:
                path = os.path.join(point, rel.lstrip("/"))
                if os.access(path, os.W_OK) and os.path.exists(os.path.join(path, "memory.limit_in_bytes")):
                    return Root(path, 1), ""
    for point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            path = os.path.join(point, own[""].lstrip("/"))
            try:
                with open(os.path.join(path, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
            except OSError:
                continue
            if "memory" in enabled and os.access(path, os.W_OK):
                return Root(path, 2), ""
    return None, ("no writable memory cgroup (cgroup v1 memory hierarchy, or a v2 cgroup with memory in "
                  "cgroup.subtree_control)")


class Cgroup:
    def __init__(self, root: Root, path: str, limit: int):
        self.root, self.path, self.limit = root, path, int(limit)
        os.mkdir(path)
        try:
            if root.version == 1:
                self._write("memory.oom_control", 0)  # the OOM killer on (a new v1 group inherits the flag)
                self._write("memory.limit_in_bytes", self.limit)
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    self._write("memory.memsw.limit_in_bytes", self.limit)
            else:
                self._write("memory.max", self.limit)
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    self._write("memory.swap.max", 0)
        except BaseException:
            os.rmdir(path)
            raise

    def _write(self, name: str, value) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def peak(self) -> Optional[int]:
        """The most memory charged to this cgroup (None where the kernel keeps no peak)."""
        name = "memory.max_usage_in_bytes" if self.root.version == 1 else "memory.peak"
        try:
            return int(self._read(name))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the cgroup's OOM killer killed (v1: memory.oom_control, v2: memory.events)."""
        name = "memory.oom_control" if self.root.version == 1 else "memory.events"
        try:
            for line in self._read(name).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def _pids(self) -> list[int]:
        try:
            return [int(v) for v in self._read("cgroup.procs").split()]
        except (OSError, ValueError):
            return []

    def remove(self) -> None:
        """Removes the cgroup: a process still in it (a rank interrupted mid-step) is killed first;
        a killed process may take a moment to leave."""
        for attempt in range(200):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if attempt % 20 == 0:
                    for pid in self._pids():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                time.sleep(0.05)
        os.rmdir(self.path)


def remove_all(groups: list[Cgroup]) -> None:
    """Removes every group, each whatever happens to the others; raises the first error after."""
    first = None
    for g in groups:
        try:
            g.remove()
        except OSError as e:
            first = first or e
    if first is not None:
        raise first
