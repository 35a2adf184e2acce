// Small helpers for reading a tokenizer.json whose errors name the file and the key path
// ("tokenizer.json: normalizer.normalizers[2] has no \"content\" key").
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "core/error.h"

namespace moetrain::json_keys {

inline const nlohmann::json& member(const nlohmann::json& obj, const char* key, const std::string& file,
                                    const std::string& where) {
  MT_CHECK(obj.is_object(), "{}: {} must be a JSON object", file, where);
  auto it = obj.find(key);
  MT_CHECK(it != obj.end(), "{}: {} has no \"{}\" key", file, where, key);
  return *it;
}

inline std::string string_at(const nlohmann::json& obj, const char* key, const std::string& file,
                             const std::string& where) {
  const nlohmann::json& v = member(obj, key, file, where);
  MT_CHECK(v.is_string(), "{}: {}.{} must be a string, not {}", file, where, key, v.type_name());
  return v.get<std::string>();
}

inline bool bool_or(const nlohmann::json& obj, const char* key, bool fallback, const std::string& file,
                    const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  MT_CHECK(it->is_boolean(), "{}: {}.{} must be true or false, not {}", file, where, key, it->dump());
  return it->get<bool>();
}

}  // namespace moetrain::json_keys
