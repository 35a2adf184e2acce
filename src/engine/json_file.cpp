#include "engine/json_file.h"

#include <fstream>

#include "core/error.h"

namespace moetrain {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.is_open(), "{}: cannot open (does it exist?)", path);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("{}: not valid JSON: {}", path, e.what());
  }
}

}  // namespace moetrain
