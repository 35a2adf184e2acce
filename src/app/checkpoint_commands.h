// The `moetrain convert` subcommand (Hugging Face folder <-> moetrain checkpoint) and
// `moetrain score` (logits and loss of a token sequence under a saved model).
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace moetrain::app {

// Adds both subcommands to `app`. The returned function, called after parsing, runs the one
// that was given and returns its exit status, or -1 when neither was.
std::function<int()> add_checkpoint_commands(CLI::App& app);

}  // namespace moetrain::app
