# The two commands a newcomer needs (see README.md):
#   make train   install what is missing, build Release, train the default tiny model on the CPU
#   make test    build and run the whole test suite
BUILD ?= build
JOBS ?= $(shell nproc)
CONFIG ?= configs/tiny.toml

.PHONY: all deps build train test test-asan test-tsan fuzz clean

all: build

deps:
	@scripts/install-deps

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

train: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target moetrain
	$(BUILD)/moetrain train --config $(CONFIG)
	$(BUILD)/moetrain plot $$($(BUILD)/moetrain train --config $(CONFIG) --print-config | sed -n '/^\[metrics\]/,/^\[/s/^dir = "\(.*\)"/\1/p')

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The CPU code under AddressSanitizer + UndefinedBehaviorSanitizer (GCC's), every CPU test;
# a finding fails the test that hit it (docs/hardening.md). CUDA is left out: nvcc's host code
# is not instrumented, and the GPU tests skip on the CPU anyway.
SANITIZER_ENV = ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=1 \
	LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/sanitizer/lsan.supp:print_suppressions=0 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/scripts/sanitizer/tsan.supp
# -O1 -g1: line numbers in the reports at a fraction of -O2 -g's compile time.
SANITIZER_CMAKE = -G Ninja -DCMAKE_BUILD_TYPE=Sanitize -DCMAKE_CXX_FLAGS_SANITIZE="-O1 -g1" -DMOETRAIN_CUDA=OFF
SANITIZER_TARGETS = moetrain test_core test_ops test_comm test_engine test_app test_chaos
test-asan: deps
	cmake -S . -B build-asan $(SANITIZER_CMAKE) -DMOETRAIN_SANITIZE=address,undefined
	cmake --build build-asan -j $(JOBS) --target $(SANITIZER_TARGETS)
	cd build-asan && $(SANITIZER_ENV) ctest --output-on-failure -j $(JOBS) --timeout 1500

# The threaded parts under ThreadSanitizer: the checkpoint writer, tokenize's workers, the
# launcher and rendezvous stores, the Gloo communicator, the metrics endpoint, the replica
# manager's bridge; unit tests only (whole runs of several processes are make test's and
# test-asan's). OpenMP runs one thread (libgomp is not instrumented). Not the lighthouse:
# gRPC's threads synchronise inside uninstrumented libgrpc, where TSan sees only races.
TSAN_TESTS = Checkpoint|Tokeniz|Launcher|Launch|Store|Rendezvous|Gloo|Prometheus|Quorum|ReplicaBridge
test-tsan: deps
	cmake -S . -B build-tsan $(SANITIZER_CMAKE) -DMOETRAIN_SANITIZE=thread
	cmake --build build-tsan -j $(JOBS) --target $(SANITIZER_TARGETS)
	cd build-tsan && OMP_NUM_THREADS=1 $(SANITIZER_ENV) ctest --output-on-failure -j $(JOBS) --timeout 1500 \
	  -R '$(TSAN_TESTS)' -E 'ParallelCli|Chaos|CliTest|TokenizeCli|Lighthouse'

# libFuzzer harnesses (fuzz/fuzz_*.cpp, clang's ASan + UBSan + libFuzzer), each run for
# FUZZ_SECONDS from its committed seed corpus (fuzz/corpus/<name>); no single allocation may
# exceed FUZZ_MALLOC_MB (a hostile header must not make moetrain allocate more). A crash
# leaves its input as build-fuzz/crash-* and fails the target.
FUZZ_SECONDS ?= 30
FUZZ_MALLOC_MB ?= 512
fuzz: deps
	CXX=clang++ cmake -S . -B build-fuzz $(SANITIZER_CMAKE) -DMOETRAIN_SANITIZE=fuzzer-no-link,address,undefined \
	  -DMOETRAIN_FUZZ=ON
	cmake --build build-fuzz -j $(JOBS) --target $$(cd fuzz && ls fuzz_*.cpp | sed 's/\.cpp$$//')
	@for h in $$(cd fuzz && ls fuzz_*.cpp | sed 's/\.cpp$$//'); do \
	  c=fuzz/corpus/$${h#fuzz_}; mkdir -p build-fuzz/corpus-$${h#fuzz_}; \
	  echo "fuzz: $$h for $(FUZZ_SECONDS) s (seeds $$c)"; \
	  (cd build-fuzz && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	    ./$$h -max_total_time=$(FUZZ_SECONDS) -malloc_limit_mb=$(FUZZ_MALLOC_MB) -rss_limit_mb=2048 \
	    -print_final_stats=1 corpus-$${h#fuzz_} ../$$c > $$h.log 2>&1); status=$$?; \
	  tail -n 12 build-fuzz/$$h.log; \
	  [ $$status -eq 0 ] || { echo "fuzz: $$h FAILED (build-fuzz/$$h.log, the input in build-fuzz/crash-*)"; exit 1; }; \
	done

clean:
	rm -rf $(BUILD)
