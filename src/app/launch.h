// The `moetrain launch` subcommand (N local workers of this binary, fail-fast), the servers a
// run may need beside its workers (`rdzv-server`, the elastic agents' store; `lighthouse`,
// the quorum of live fault tolerance) and the hidden `moetrain comm-selftest` (rendezvous
// from the launcher's variables, then a few checked collectives: a quick test of a
// machine's or cluster's setup).
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace moetrain::app {

// Adds these subcommands to `app`. The returned function, called after parsing, runs the one
// that was given and returns its exit status, or -1 when none was.
std::function<int()> add_launch_commands(CLI::App& app);

}  // namespace moetrain::app
