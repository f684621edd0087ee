#include "bitdelta/tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "bitdelta/checkpoint.h"
#include "bitdelta/error.h"

namespace bitdelta {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kModelFile = "tokenizer.model";
constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// Length of the UTF-8 sequence a byte starts: 1 for ASCII, continuation and invalid lead bytes
// (a decoder consumes those one at a time, whatever follows them).
size_t utf8_length(uint8_t lead) {
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 1;
}

// Bytes at the end of `bytes` that start a character the next bytes might still complete.
template <typename ByteAt>
size_t unfinished_suffix(size_t n, ByteAt byte_at) {
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    const uint8_t b = byte_at(n - k);
    if ((b & 0xC0) == 0x80) continue;  // continuation: the lead is further back
    return utf8_length(b) > k ? k : 0;
  }
  return 0;
}

int32_t token_id(const fs::path& file, const char* field, const json& value) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > INT32_MAX)
    fail(file.string(), ": ", field, " must be a non-negative integer or a list of them, got ",
         value.dump());
  return static_cast<int32_t>(value.get<int64_t>());
}

// BOS/EOS ids configured by JSON files, each with the file it came from (for error messages).
struct SpecialIds {
  std::optional<int32_t> bos;
  std::optional<std::vector<int32_t>> eos;
  fs::path bos_file, eos_file;
};

// Applies `bos_token_id` / `eos_token_id` of one JSON file, where present and not null.
void read_special_ids(const fs::path& file, SpecialIds& ids_out) {
  const json config = read_json_file(file);
  if (!config.is_object()) fail(file.string(), ": not a JSON object");
  if (config.contains("bos_token_id") && !config["bos_token_id"].is_null()) {
    ids_out.bos = token_id(file, "bos_token_id", config["bos_token_id"]);
    ids_out.bos_file = file;
  }
  if (config.contains("eos_token_id") && !config["eos_token_id"].is_null()) {
    const json& value = config["eos_token_id"];
    std::vector<int32_t> ids;
    if (value.is_array()) {
      for (const json& v : value) ids.push_back(token_id(file, "eos_token_id", v));
    } else {
      ids.push_back(token_id(file, "eos_token_id", value));
    }
    ids_out.eos = std::move(ids);
    ids_out.eos_file = file;
  }
}

}  // namespace

Tokenizer::Tokenizer(const fs::path& checkpoint_dir)
    : model_path_(checkpoint_dir / kModelFile),
      sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  std::error_code ec;
  if (!fs::is_regular_file(model_path_, ec))
    fail(model_path_.string(), ": missing (a checkpoint directory needs a SentencePiece ",
         kModelFile, ")");
  if (const auto status = sp_->Load(model_path_.string()); !status.ok())
    fail(model_path_.string(), ": not a valid SentencePiece model (", status.ToString(), ")");
  const int size = sp_->GetPieceSize();
  if (size <= 0) fail(model_path_.string(), ": SentencePiece model has an empty vocabulary");

  kinds_.resize(size_t(size));
  bytes_.assign(size_t(size), 0);
  visible_.assign(size_t(size), 0);
  for (int id = 0; id < size; ++id) {
    const size_t i = size_t(id);
    const std::string& p = sp_->IdToPiece(id);
    if (sp_->IsControl(id)) {
      kinds_[i] = Kind::kControl;
    } else if (sp_->IsUnknown(id)) {
      kinds_[i] = Kind::kUnknown;
      visible_[i] = 1;  // decodes to " ⁇ "
    } else if (sp_->IsUnused(id)) {
      kinds_[i] = Kind::kUnused;
    } else if (sp_->IsByte(id)) {
      kinds_[i] = Kind::kByte;
      // Byte pieces are spelled <0xNN>.
      if (p.size() != 6 || p.compare(0, 3, "<0x") != 0 || p[5] != '>')
        fail(model_path_.string(), ": byte piece ", id, " is spelled '", p, "', expected <0xNN>");
      bytes_[i] = static_cast<uint8_t>(std::stoi(p.substr(3, 2), nullptr, 16));
    } else {
      kinds_[i] = Kind::kNormal;
      // At the start of a decode SentencePiece drops one leading space symbol.
      const bool leading_space = p.compare(0, kSpaceSymbol.size(), kSpaceSymbol) == 0;
      visible_[i] = p.size() > (leading_space ? kSpaceSymbol.size() : 0);
    }
  }

  // generation_config.json is what generation uses; config.json is the older place for the ids.
  SpecialIds special;
  for (const char* name : {"config.json", "generation_config.json"})
    if (fs::exists(checkpoint_dir / name, ec)) read_special_ids(checkpoint_dir / name, special);
  if (special.bos && !valid_id(*special.bos))
    fail(special.bos_file.string(), ": bos_token_id ", *special.bos,
         " is outside the tokenizer's vocabulary of ", size, " ids");
  bos_id_ = special.bos ? *special.bos : sp_->bos_id();
  if (!special.eos && sp_->eos_id() >= 0) special.eos = std::vector<int32_t>{sp_->eos_id()};
  for (const int32_t id : special.eos.value_or(std::vector<int32_t>{})) {
    if (!valid_id(id))
      fail(special.eos_file.string(), ": eos_token_id ", id,
           " is outside the tokenizer's vocabulary of ", size, " ids");
    if (std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) eos_ids_.push_back(id);
  }
}

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

void Tokenizer::check_id(int32_t id) const {
  if (!valid_id(id))
    fail("token id ", id, " is outside the tokenizer's vocabulary of ", vocab_size(), " ids (",
         model_path_.string(), ")");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int> ids;
  if (const auto status = sp_->Encode(text, &ids); !status.ok())
    fail(model_path_.string(), ": cannot encode text of ", text.size(), " bytes (",
         status.ToString(), ")");
  if (!add_bos) return ids;
  if (bos_id_ < 0)
    fail(model_path_.string(), ": BOS requested but the tokenizer defines no BOS id");
  std::vector<int32_t> out;
  out.reserve(ids.size() + 1);
  out.push_back(bos_id_);
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  for (const int32_t id : ids) check_id(id);
  std::string text;
  if (const auto status = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
      !status.ok())
    fail(model_path_.string(), ": cannot decode ", ids.size(), " ids (", status.ToString(), ")");
  return text;
}

bool Tokenizer::is_eos(int32_t id) const {
  return std::find(eos_ids_.begin(), eos_ids_.end(), id) != eos_ids_.end();
}

std::string Tokenizer::piece(int32_t id) const {
  check_id(id);
  return sp_->IdToPiece(id);
}

bool Tokenizer::is_control(int32_t id) const {
  check_id(id);
  return kind(id) == Kind::kControl;
}

// --- StreamDecoder
// ---------------------------------------------------------------------------------

// Byte pieces at the end of the window that begin a character still missing bytes.
size_t StreamDecoder::unfinished_tail() const {
  const size_t n = window_.size();
  size_t run = 0;
  while (run < 3 && run < n && tokenizer_->kind(window_[n - 1 - run]) == Tokenizer::Kind::kByte)
    ++run;
  return unfinished_suffix(run,
                           [&](size_t i) { return tokenizer_->byte_value(window_[n - run + i]); });
}

std::string StreamDecoder::push(int32_t id) {
  tokenizer_->check_id(id);
  window_.push_back(id);
  const size_t end = window_.size() - unfinished_tail();
  if (end <= done_) return {};

  std::string text = tokenizer_->decode(std::span(window_).first(end));
  // Everything before `done_` decodes the same with more ids after it (a complete character or a
  // non-byte piece ends there), so `text` extends `text_`. The cut is a guard: SentencePiece's
  // output is whole characters.
  const size_t keep =
      text.size() - unfinished_suffix(text.size(), [&](size_t i) { return uint8_t(text[i]); });
  std::string out =
      keep > text_.size() ? text.substr(text_.size(), keep - text_.size()) : std::string();
  const bool whole = keep == text.size();
  text.resize(std::max(keep, text_.size()));
  text_ = std::move(text);
  if (!whole) return out;  // (never: guard only)

  // Move the anchor to where this token's text began, if a decode starting there shows text at
  // once: a byte piece there starts a character, and other pieces must be visible on their own.
  const size_t anchor = done_;
  done_ = end;
  if (anchor == 0 || anchor >= end) return out;
  const int32_t first = window_[anchor];
  const bool ok =
      tokenizer_->kind(first) == Tokenizer::Kind::kByte || tokenizer_->starts_visible(first);
  if (!ok) return out;
  window_.erase(window_.begin(), window_.begin() + std::ptrdiff_t(anchor));
  done_ -= anchor;
  text_ = tokenizer_->decode(std::span(window_).first(done_));
  return out;
}

std::string StreamDecoder::finish() {
  const std::string text = tokenizer_->decode(window_);
  std::string out = text.size() > text_.size() ? text.substr(text_.size()) : std::string();
  window_.clear();
  done_ = 0;
  text_.clear();
  return out;
}

}  // namespace bitdelta
