// make_tokenizer: the tokenizer a config or command line names ([data].tokenizer,
// moetrain tokenize --tokenizer). "byte" is ByteTokenizer; anything else is a path to a
// Hugging Face tokenizer.json, or to a folder holding one (an HF model folder).
#pragma once

#include <memory>
#include <string>

#include "engine/data/tokenizer.h"

namespace moetrain {

// `eos_token` overrides the end-of-text token of a tokenizer.json (see BpeTokenizer); the
// byte tokenizer accepts only its own "<|endoftext|>". `source` names where `spec` came
// from, for errors ("[data].tokenizer", "--tokenizer").
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec, const std::string& eos_token = "",
                                          const std::string& source = "[data].tokenizer");

}  // namespace moetrain
