// How the op benchmarks time GPU work: CUDA events on the current stream around each
// iteration's body (reported as Google Benchmark's manual time), and a rate counter from
// the total (TFLOP/s for FLOPs, TB/s for bytes).
#pragma once

#include <benchmark/benchmark.h>

#include "core/cuda_runtime.h"

namespace moetrain {

// Runs `body` once per iteration; returns the total milliseconds.
template <typename F>
double time_iterations(benchmark::State& state, F&& body) {
  cuda::Event start = cuda::create_event(), stop = cuda::create_event();
  double ms_total = 0;
  for (auto _ : state) {
    cuda::record_event(start, cuda::current_stream());
    body();
    cuda::record_event(stop, cuda::current_stream());
    const double ms = cuda::elapsed_ms(start, stop);
    state.SetIterationTime(ms / 1e3);
    ms_total += ms;
  }
  cuda::destroy_event(start);
  cuda::destroy_event(stop);
  return ms_total;
}

// counters[name] = amount per iteration / time, in units of 1e12 per second.
inline void set_rate(benchmark::State& state, const char* name, double amount, double ms_total) {
  state.counters[name] = benchmark::Counter(amount * state.iterations() / (ms_total / 1e3) / 1e12);
}

}  // namespace moetrain
