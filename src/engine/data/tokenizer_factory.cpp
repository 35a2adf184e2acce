#include "engine/data/tokenizer_factory.h"

#include <filesystem>

#include "core/error.h"
#include "engine/data/bpe_tokenizer.h"
#include "engine/data/byte_tokenizer.h"

namespace fs = std::filesystem;

namespace moetrain {

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec, const std::string& eos_token,
                                          const std::string& source) {
  MT_CHECK(!spec.empty(), "{} is empty: expected \"byte\" or the path of a tokenizer.json", source);
  if (spec == "byte") {
    auto tok = std::make_unique<ByteTokenizer>();
    MT_CHECK(eos_token.empty() || tok->token_to_id(eos_token) == tok->eos_id(),
             "{} = \"byte\": its end-of-text token is <|endoftext|>, not \"{}\"", source, eos_token);
    return tok;
  }
  std::error_code ec;
  fs::path path(spec);
  if (fs::is_directory(path, ec)) {
    path /= "tokenizer.json";
    MT_CHECK(fs::is_regular_file(path, ec), "{} = \"{}\": the folder has no tokenizer.json", source, spec);
  } else {
    MT_CHECK(fs::exists(path, ec), "{} = \"{}\": no such file or folder (expected \"byte\", a tokenizer.json or a "
             "folder holding one)", source, spec);
  }
  return std::make_unique<BpeTokenizer>(path.string(), eos_token);
}

}  // namespace moetrain
