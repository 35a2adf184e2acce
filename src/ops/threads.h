// How many CPU threads the CPU ops use (OpenMP loops and OpenBLAS alike).
#pragma once

namespace moetrain::ops {
// n <= 0 means all cores. Results are bitwise reproducible for a fixed n.
void set_cpu_threads(int n);
int cpu_threads();
}  // namespace moetrain::ops
