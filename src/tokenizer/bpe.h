// A byte-level BPE tokenizer read from a Hugging Face `tokenizer.json` (the format of GPT-2,
// Llama 3, Qwen2 ...): added tokens, pre-tokenizer, merges and the post-processor's
// leading special tokens. Used by Tokenizer when a checkpoint has no SentencePiece model.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace bitdelta {

class ByteLevelBpe {
 public:
  // Throws Error naming the file and the field on anything it cannot read or does not support
  // (another model type, a Metaspace pre-tokenizer, a merge of unknown tokens, a bad regex ...).
  explicit ByteLevelBpe(const std::filesystem::path& file);
  ~ByteLevelBpe();
  ByteLevelBpe(ByteLevelBpe&&) noexcept;
  ByteLevelBpe& operator=(ByteLevelBpe&&) noexcept;

  // The ids of `text` (any bytes: malformed UTF-8 is read as U+FFFD), without the post-processor's
  // special tokens. Safe to call from many threads at once.
  std::vector<int32_t> encode(std::string_view text) const;

  size_t vocab_size() const { return tokens_.size(); }  // the largest id + 1
  // The vocabulary's spelling of a token ("Ġthe", "<|eot_id|>"; "" for an id no token has).
  const std::string& spelling(int32_t id) const { return tokens_[size_t(id)].spelling; }
  // The bytes the token stands for in a decode; special tokens stand for none.
  const std::string& bytes(int32_t id) const { return tokens_[size_t(id)].bytes; }
  bool is_special(int32_t id) const { return tokens_[size_t(id)].special; }
  bool is_unused(int32_t id) const { return tokens_[size_t(id)].unused; }
  // The special tokens the post-processor puts before a text (Llama 3: <|begin_of_text|>).
  const std::vector<int32_t>& prefix() const { return prefix_; }

 private:
  struct Token {
    std::string spelling, bytes;
    bool special = false, unused = true;
  };
  struct Added {
    std::string content;
    int32_t id;
    bool lstrip, rstrip;
  };
  struct Step;    // one pre-tokenizer step
  struct Reader;  // the fields of the file, with its name for errors
  struct Merge {
    uint32_t rank;
    int32_t result;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return uint64_t(uint32_t(left)) << 32 | uint32_t(right);
  }

  Token& token(int32_t id);  // grows the table to hold id
  void read_model(const Reader& r, const nlohmann::json& model);
  void read_added(const Reader& r, const nlohmann::json& added);
  static void check_normalizer(const Reader& r, const nlohmann::json& n, const std::string& field);
  void read_pre_tokenizer(const Reader& r, const nlohmann::json& p, const std::string& field);
  void read_post_processor(const Reader& r, const nlohmann::json& p, const std::string& field);

  void pre_tokenize(std::string_view piece, std::vector<std::string>& words) const;
  void merge_word(std::string_view word, std::vector<int32_t>& ids) const;

  std::filesystem::path file_;
  std::vector<Token> tokens_;
  std::unordered_map<std::string, int32_t> vocab_;  // spelling -> id (model vocabulary only)
  std::unordered_map<uint64_t, Merge> merges_;      // (left id, right id) -> rank and result
  std::vector<Added> added_;                        // longest content first
  std::vector<Step> steps_;
  int32_t byte_ids_[256];       // the token of each byte
  bool added_first_[256] = {};  // bytes an added token starts with
  bool ignore_merges_ = false;
  std::vector<int32_t> prefix_;
};

}  // namespace bitdelta
