// read_json_file: a whole JSON file, parsed, for every reader of a file a user hands in
// (config.json, tokenizer.json, a checkpoint's index): one place where "missing" and "not
// JSON" become an error that names the file.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace moetrain {

// Throws naming `path` when it cannot be opened or is not valid JSON (a syntax error, or a
// number too large for a double: nlohmann's out_of_range, which is not a parse_error).
nlohmann::json read_json_file(const std::string& path);

}  // namespace moetrain
