// The dashboard of `moetrain plot`: one PNG of a run's metrics.jsonl (several runs overlaid,
// each its colour): loss and validation loss, learning rate, gradient norm, tokens/s,
// TFLOP/s, memory, the busiest expert's load over the mean, and a heatmap of that load per
// MoE layer over the steps (the first run's). Drawn with cairo (Debian's libcairo2).
#pragma once

#include <string>
#include <vector>

namespace moetrain {

// One run's series, read from <dir>/metrics.jsonl (the steps of every process that appended
// to it, in file order).
struct RunSeries {
  std::string name;  // the folder's name, for the legend
  std::vector<double> step, loss, lr, grad_norm, tokens_per_s, tflops, peak_gb, reserved_gb, load;
  std::vector<double> val_step, val_loss;
  std::vector<std::vector<double>> layer_load;  // [step][MoE layer]: busiest expert / mean
};

// Errors name the file and line that cannot be read; a run without steps is an error too.
RunSeries read_run(const std::string& dir);

// Writes the dashboard of `runs` (at least one) to `png` (its folder must exist).
void write_dashboard(const std::vector<RunSeries>& runs, const std::string& png);

}  // namespace moetrain
