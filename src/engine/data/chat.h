// Chat data for supervised fine-tuning: one conversation per JSONL line, rendered with the
// ChatML template and tokenized with a mask of the tokens the model is trained on.
//
// A line is {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
// (other keys are ignored). ChatML renders each message as
//
//   <|im_start|>{role}\n{content}<|im_end|>\n
//
// with no default system prompt. The rendered text is tokenized as one string, exactly as
// tokenizing the output of Hugging Face's apply_chat_template would be (special tokens are
// cut out first, so <|im_start|> and <|im_end|> are single ids). A token is trained when its
// bytes overlap an assistant message's content or the <|im_end|> that closes it (so the model
// learns to stop); the "<|im_start|>assistant\n" header, the other roles' messages and the
// newlines between messages are context only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/data/tokenizer.h"

namespace moetrain {

struct ChatMessage {
  std::string role, content;
};

// One tokenized conversation: ids, and for each id whether it is trained.
struct ChatTokens {
  std::vector<int32_t> ids;
  std::vector<uint8_t> trained;
};

// Parses one JSONL line. `where` ("file:line") prefixes every error: malformed JSON, no
// "messages" list, a message that is not an object, an unknown role, a content that is not a
// string, no assistant message (nothing to train on).
std::vector<ChatMessage> parse_chat_line(std::string_view line, const std::string& where);

class ChatMlTemplate {
 public:
  // Throws when the tokenizer has no <|im_start|> or <|im_end|> token.
  explicit ChatMlTemplate(const Tokenizer& tokenizer);

  // The conversation as text, and the byte ranges [begin, end) that are trained.
  std::string render(const std::vector<ChatMessage>& messages, std::vector<std::pair<size_t, size_t>>* trained) const;
  // Rendered and tokenized; `where` prefixes errors (text the tokenizer refuses).
  ChatTokens tokenize(const std::vector<ChatMessage>& messages, const std::string& where) const;

 private:
  const Tokenizer& tok_;
  std::vector<int32_t> token_bytes_;  // bytes each id decodes to; -1 for ids without a token
};

}  // namespace moetrain
