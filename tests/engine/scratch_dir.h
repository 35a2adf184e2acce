// ScratchDirTest: a GoogleTest fixture that gives each test a fresh folder of its own
// (removed afterwards), with helpers to write files there and to catch error messages.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "test_util.h"

class ScratchDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("moetrain_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // Writes `text` to `name` (folders created as needed); returns its path.
  std::string file(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = dir_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
  // The message of the moetrain::Error that f() throws; "" when it throws none.
  template <typename F>
  static std::string error_of(F&& f) {
    return moetrain::testing::error_of(std::forward<F>(f));
  }

  std::filesystem::path dir_;
};
