# The two commands a newcomer needs (see README.md):
#   make train   install what is missing, build Release, train the default tiny model on the CPU
#   make test    build and run the whole test suite
BUILD ?= build
JOBS ?= $(shell nproc)
CONFIG ?= configs/tiny.toml

.PHONY: all deps build train test clean

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

clean:
	rm -rf $(BUILD)
