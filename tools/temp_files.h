// What the tool keeps under $TMPDIR while it runs (the local launcher's rendezvous folder, train's
// progress log and plot folder) is named after its owner process:
//   $TMPDIR/mlacp-<what>-<pid>-<start>...     <start>: the owner's start time (/proc/<pid>/stat)
// Each owner removes its own when it ends; one killed by SIGKILL cannot, so the next launch
// removes every such entry of this user whose owner is gone: no process with that pid, a zombie,
// or one that started at another time (the pid reused). TMPDIR is assumed private to this host and
// PID namespace (a process elsewhere with the same pid would not be seen).
#pragma once

#include <string>

namespace mlacp::tools {

// $TMPDIR, or /tmp when it is unset or empty.
std::string temp_dir();
// temp_dir()/mlacp-<what>-<pid>-<start>: the start of a name this process owns (`what`: letters).
std::string owned_temp_path(const std::string& what);
// Removes (recursively) the entries of temp_dir() named by owned_temp_path whose owner is gone
// and which belong to this user. Never throws; what cannot be removed stays.
void remove_stale_temp_files();

}  // namespace mlacp::tools
