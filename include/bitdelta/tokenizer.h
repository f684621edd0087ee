// Tokenizer of a Hugging Face checkpoint directory (SentencePiece `tokenizer.model`, or a
// byte-level BPE `tokenizer.json`), and a streaming detokenizer that turns generated ids into text
// pieces safe to send one at a time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace bitdelta {

class ByteLevelBpe;

// Const methods may be called from many threads at once (SentencePiece's encode and decode are).
class Tokenizer {
 public:
  // Loads `checkpoint_dir/tokenizer.model` (SentencePiece) or, where there is none,
  // `checkpoint_dir/tokenizer.json` (a byte-level BPE: GPT-2, Llama 3, Qwen2 ...). BOS/EOS come
  // from config.json (`bos_token_id`, `eos_token_id`, an int or a list), overridden field by field
  // by generation_config.json, and otherwise from the SentencePiece model, or the BOS that
  // tokenizer.json's post-processor puts first. Throws Error naming the file and field on a
  // missing, corrupt or unsupported file, or an id outside the vocabulary.
  explicit Tokenizer(const std::filesystem::path& checkpoint_dir);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Any byte string encodes (malformed UTF-8 becomes U+FFFD, unknown characters byte pieces or
  // <unk>). With add_bos the BOS id is prepended; throws if the tokenizer has none.
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;
  // Control tokens (BOS, EOS) decode to nothing. Throws Error naming an id outside [0, vocab_size).
  std::string decode(std::span<const int32_t> ids) const;

  int32_t bos_id() const { return bos_id_; }  // -1 if there is none
  // Whether the checkpoint's own tokenizer puts BOS before a text: tokenizer_config.json's
  // add_bos_token where set; otherwise SentencePiece when it has a BOS, tokenizer.json when its
  // post-processor puts one first (Llama 3 yes, Qwen2 no).
  bool adds_bos() const { return adds_bos_; }
  // Every id that ends generation (generation_config.json may list several); first is the primary.
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  bool is_eos(int32_t id) const;
  size_t vocab_size() const { return kinds_.size(); }
  bool valid_id(int32_t id) const { return id >= 0 && static_cast<size_t>(id) < kinds_.size(); }
  // The raw piece as the vocabulary spells it ("▁the", "<0xE2>", "<s>"; BPE: "Ġthe"); throws on
  // an id out of range.
  std::string piece(int32_t id) const;
  // The token on its own, as a logprobs listing shows it: the bytes it decodes to (SentencePiece's
  // ▁ as a space, a byte piece as its byte), control tokens as their piece.
  std::string token_text(int32_t id) const;
  bool is_control(int32_t id) const;  // BOS, EOS and other invisible tokens

  const std::filesystem::path& model_path() const { return model_path_; }

 private:
  friend class StreamDecoder;
  enum class Kind : uint8_t { kNormal, kControl, kUnknown, kUnused, kByte };

  void check_id(int32_t id) const;
  Kind kind(int32_t id) const { return kinds_[static_cast<size_t>(id)]; }
  uint8_t byte_value(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  // True if a decode starting at this (non-byte) piece yields text before any later piece, so the
  // later pieces decode exactly as they do in the whole sequence (see StreamDecoder).
  bool starts_visible(int32_t id) const { return visible_[static_cast<size_t>(id)] != 0; }

  std::filesystem::path model_path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;  // one of these two
  std::unique_ptr<ByteLevelBpe> bpe_;
  int32_t bos_id_ = -1;
  bool adds_bos_ = false;
  std::vector<int32_t> eos_ids_;
  std::vector<Kind> kinds_;       // per id
  std::vector<uint8_t> bytes_;    // per id: the byte of a byte-fallback piece <0xNN>
  std::vector<uint8_t> visible_;  // per id: see starts_visible()
};

// Streaming detokenizer for one sequence; it keeps a pointer to the tokenizer, which must outlive
// it. push() returns the text that became final with the token; the concatenation of every push()
// and the closing finish() equals Tokenizer::decode of all the ids. Text is never split inside a
// UTF-8 character: byte-fallback pieces of an unfinished character are held back until it completes
// (or until finish()).
//
// A byte-level BPE token always decodes to the same bytes, so there the decoder only holds back
// the bytes of an unfinished character.
//
// Why a window: SentencePiece drops the leading space of the first visible piece and assembles runs
// of byte pieces, so a token's text depends on what came before it. The decoder re-decodes ids from
// an anchor, the start of a piece whose decoded text is non-empty in any position, so every piece
// after the anchor decodes as it does in the whole sequence; it emits the difference to the text
// already emitted, then moves the anchor forward, keeping the work per token small.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}

  // Throws Error on an id outside the vocabulary (and then leaves the decoder unchanged).
  std::string push(int32_t id);
  // Flushes held-back bytes (an unfinished character decodes to U+FFFD, as in decode) and resets
  // the decoder for a new sequence.
  std::string finish();

 private:
  size_t unfinished_tail() const;

  const Tokenizer* tokenizer_;
  std::vector<int32_t> window_;  // ids from the anchor on
  size_t done_ = 0;              // window_[0, done_) are fully emitted
  std::string text_;             // decode(window_[0, done_)) as far as it has been emitted
  std::string held_;             // byte-level BPE: bytes of an unfinished character
};

}  // namespace bitdelta
