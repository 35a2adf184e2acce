#include "ops/threads.h"

#include <cblas.h>
#include <omp.h>

#include <thread>

namespace moetrain::ops {
void set_cpu_threads(int n) {
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}
int cpu_threads() { return omp_get_max_threads(); }
}  // namespace moetrain::ops
