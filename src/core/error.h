// moetrain::Error is the one exception type of the project. Its message names the
// thing that is wrong (file, key, tensor) and what was expected; `where` records the
// source location of the check that fired, for bug reports.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace moetrain {

class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file, int line)
      : std::runtime_error(std::move(message)), file_(file), line_(line) {}
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  const char* file_;
  int line_;
};

[[noreturn]] inline void throw_error(const char* file, int line, std::string message) {
  throw Error(std::move(message), file, line);
}

}  // namespace moetrain

// Throws moetrain::Error with a formatted message.
#define MT_THROW(...) ::moetrain::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))

// MT_CHECK(cond, "tensor {} expected ...", name): throws when cond is false.
#define MT_CHECK(cond, ...)                                                      \
  do {                                                                           \
    if (!(cond)) [[unlikely]] {                                                  \
      ::moetrain::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__));   \
    }                                                                            \
  } while (0)
