#include "engine/data/chat.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain {
namespace {

constexpr const char* kImStart = "<|im_start|>";
constexpr const char* kImEnd = "<|im_end|>";

// The JSON library's message without its "[json.exception...] " prefix and without "line 1"
// (a JSONL line is parsed alone; the caller names the line).
std::string json_error(const std::exception& e) {
  std::string m = e.what();
  if (m.starts_with("[json.exception") && m.find("] ") != std::string::npos) m = m.substr(m.find("] ") + 2);
  if (const size_t at = m.find("at line 1, column"); at != std::string::npos) m.replace(at, 17, "at column");
  return m;
}

}  // namespace

std::vector<ChatMessage> parse_chat_line(std::string_view line, const std::string& where) {
  using nlohmann::json;
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    MT_THROW("{}: malformed JSON line: {}", where, json_error(e));
  }
  MT_CHECK(j.is_object() && j.contains("messages") && j["messages"].is_array(),
           "{}: expected a JSON object with a \"messages\" list of {{\"role\", \"content\"}} objects", where);
  const json& list = j["messages"];
  MT_CHECK(!list.empty(), "{}: \"messages\" is empty", where);
  std::vector<ChatMessage> out;
  bool assistant = false;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& m = list[i];
    MT_CHECK(m.is_object() && m.contains("role") && m.contains("content"),
             "{}: message {} is not an object with \"role\" and \"content\"", where, i + 1);
    MT_CHECK(m["role"].is_string(), "{}: message {}: \"role\" is not a string", where, i + 1);
    const std::string role = m["role"].get<std::string>();
    MT_CHECK(role == "system" || role == "user" || role == "assistant",
             "{}: message {} has unknown role \"{}\" (expected system, user or assistant)", where, i + 1, role);
    MT_CHECK(m["content"].is_string(), "{}: message {}: \"content\" is a {}, expected a string", where, i + 1,
             m["content"].type_name());
    assistant = assistant || role == "assistant";
    out.push_back({role, m["content"].get<std::string>()});
  }
  MT_CHECK(assistant, "{}: no assistant message: nothing to train on", where);
  return out;
}

ChatMlTemplate::ChatMlTemplate(const Tokenizer& tok) : tok_(tok) {
  for (const char* t : {kImStart, kImEnd}) {
    MT_CHECK(tok.token_to_id(t).has_value(),
             "[data].chat_template = \"chatml\" needs the special token {}, which the tokenizer ({}) does not have; "
             "use the tokenizer of a chat model (Qwen2/Qwen3 tokenizer.json)",
             t, tok.describe());
  }
  // The bytes of each id, to find where each token of a conversation lies in its text.
  token_bytes_.assign(static_cast<size_t>(tok.vocab_size()), -1);
  for (int32_t id = 0; id < static_cast<int32_t>(token_bytes_.size()); ++id) {
    try {
      token_bytes_[id] = static_cast<int32_t>(tok.decode(std::span<const int32_t>(&id, 1)).size());
    } catch (const Error&) {
      // an unused id (a gap before the added tokens)
    }
  }
}

std::string ChatMlTemplate::render(const std::vector<ChatMessage>& messages,
                                   std::vector<std::pair<size_t, size_t>>* trained) const {
  std::string text;
  for (const ChatMessage& m : messages) {
    text += kImStart;
    text += m.role;
    text += '\n';
    const size_t begin = text.size();
    text += m.content;
    text += kImEnd;
    if (trained && m.role == "assistant") trained->emplace_back(begin, text.size());
    text += '\n';
  }
  return text;
}

ChatTokens ChatMlTemplate::tokenize(const std::vector<ChatMessage>& messages, const std::string& where) const {
  std::vector<std::pair<size_t, size_t>> spans;
  const std::string text = render(messages, &spans);
  ChatTokens out;
  try {
    out.ids = tok_.encode(text);
  } catch (const Error& e) {
    MT_THROW("{}: {}", where, e.what());
  }
  // Walk the tokens' byte ranges; a token is trained when it overlaps a trained span.
  out.trained.assign(out.ids.size(), 0);
  size_t at = 0, span = 0;
  for (size_t i = 0; i < out.ids.size(); ++i) {
    const int32_t id = out.ids[i];
    const int32_t n = id >= 0 && id < static_cast<int32_t>(token_bytes_.size()) ? token_bytes_[id] : -1;
    MT_CHECK(n >= 0, "{}: the tokenizer produced id {}, which has no token", where, id);
    const size_t end = at + static_cast<size_t>(n);
    while (span < spans.size() && spans[span].second <= at) ++span;
    out.trained[i] = span < spans.size() && spans[span].first < end && at < spans[span].second;
    at = end;
  }
  MT_CHECK(at == text.size(),
           "{}: the tokens do not spell the text byte for byte ({} bytes for {}; an unknown byte mapped to "
           "unk_token?), so the assistant tokens cannot be found",
           where, at, text.size());
  return out;
}

}  // namespace moetrain
