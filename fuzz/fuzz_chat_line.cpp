// libFuzzer harness: one line of a chat JSONL file (SFT data, engine/data/chat.h). Any input
// must end in a clear moetrain::Error naming its place or in messages of the known roles with
// an assistant among them.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"
#include "engine/data/chat.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const std::vector<moetrain::ChatMessage> m =
        moetrain::parse_chat_line(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz:1");
    bool assistant = false;
    for (const moetrain::ChatMessage& x : m) assistant |= x.role == "assistant";
    if (!assistant) std::abort();  // the reader promises an assistant message
  } catch (const moetrain::Error&) {
  }
  return 0;
}
