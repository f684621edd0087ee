#include "bitdelta/tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "bitdelta/checkpoint.h"
#include "bitdelta/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/utf8.h"

namespace bitdelta {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kModelFile = "tokenizer.model";
constexpr const char* kJsonFile = "tokenizer.json";
constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space

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

Tokenizer::Tokenizer(const fs::path& checkpoint_dir) : model_path_(checkpoint_dir / kModelFile) {
  std::error_code ec;
  int32_t own_bos = -1, own_eos = -1;  // what the tokenizer file itself says
  if (fs::is_regular_file(model_path_, ec)) {
    sp_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
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
    own_bos = sp_->bos_id();
    own_eos = sp_->eos_id();
  } else if (fs::is_regular_file(checkpoint_dir / kJsonFile, ec)) {
    model_path_ = checkpoint_dir / kJsonFile;
    bpe_ = std::make_unique<ByteLevelBpe>(model_path_);
    kinds_.resize(bpe_->vocab_size());
    for (size_t i = 0; i < kinds_.size(); ++i) {
      const auto id = int32_t(i);
      kinds_[i] = bpe_->is_unused(id)    ? Kind::kUnused
                  : bpe_->is_special(id) ? Kind::kControl
                                         : Kind::kNormal;
    }
    if (!bpe_->prefix().empty()) own_bos = bpe_->prefix().front();
  } else {
    fail(checkpoint_dir.string(), ": no tokenizer (a checkpoint directory needs a SentencePiece ",
         kModelFile, " or a byte-level BPE ", kJsonFile, ")");
  }
  const size_t size = kinds_.size();

  // generation_config.json is what generation uses; config.json is the older place for the ids.
  SpecialIds special;
  for (const char* name : {"config.json", "generation_config.json"})
    if (fs::exists(checkpoint_dir / name, ec)) read_special_ids(checkpoint_dir / name, special);
  if (special.bos && !valid_id(*special.bos))
    fail(special.bos_file.string(), ": bos_token_id ", *special.bos,
         " is outside the tokenizer's vocabulary of ", size, " ids");
  bos_id_ = special.bos ? *special.bos : own_bos;
  // SentencePiece puts BOS first whenever it has one; tokenizer.json when its template says so;
  // tokenizer_config.json's add_bos_token, where it is set, decides (as in transformers).
  adds_bos_ = bpe_ ? !bpe_->prefix().empty() : bos_id_ >= 0;
  if (const fs::path tc = checkpoint_dir / "tokenizer_config.json"; fs::exists(tc, ec)) {
    const json config = read_json_file(tc);
    if (config.is_object() && config.contains("add_bos_token") &&
        !config["add_bos_token"].is_null()) {
      if (!config["add_bos_token"].is_boolean())
        fail(tc.string(), ": add_bos_token must be true or false, got ",
             config["add_bos_token"].dump());
      adds_bos_ = config["add_bos_token"].get<bool>();
      if (adds_bos_ && bos_id_ < 0)
        fail(tc.string(), ": add_bos_token is true but the tokenizer has no BOS id (set bos_token_id "
                          "in config.json)");
    }
  }
  if (!special.eos && own_eos >= 0) special.eos = std::vector<int32_t>{own_eos};
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
  if (add_bos && bos_id_ < 0)
    fail(model_path_.string(), ": BOS requested but the tokenizer defines no BOS id");
  std::vector<int32_t> out;
  if (add_bos) out.push_back(bos_id_);
  if (bpe_) {
    const auto ids = bpe_->encode(text);
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
  }
  std::vector<int> ids;
  if (const auto status = sp_->Encode(text, &ids); !status.ok())
    fail(model_path_.string(), ": cannot encode text of ", text.size(), " bytes (",
         status.ToString(), ")");
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  for (const int32_t id : ids) check_id(id);
  if (bpe_) {
    std::string bytes;
    for (const int32_t id : ids) bytes += bpe_->bytes(id);  // empty for special and unused ids
    return utf8::lossy(bytes);
  }
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
  return bpe_ ? bpe_->spelling(id) : sp_->IdToPiece(id);
}

std::string Tokenizer::token_text(int32_t id) const {
  std::string p = piece(id);
  if (kind(id) == Kind::kControl) return p;
  if (bpe_) return bpe_->bytes(id);
  if (kind(id) == Kind::kByte) return std::string(1, char(byte_value(id)));
  std::string out;
  for (size_t i = 0; i < p.size();) {
    if (p.compare(i, kSpaceSymbol.size(), kSpaceSymbol) == 0) {
      out += ' ';
      i += kSpaceSymbol.size();
    } else {
      out += p[i++];
    }
  }
  return out;
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
  std::string bytes;
  for (size_t i = n - run; i < n; ++i) bytes += char(tokenizer_->byte_value(window_[i]));
  return utf8::unfinished_suffix(bytes);
}

std::string StreamDecoder::push(int32_t id) {
  tokenizer_->check_id(id);
  if (tokenizer_->bpe_) {
    // Every token is its bytes: send all but an unfinished character's, which wait for the rest.
    held_ += tokenizer_->bpe_->bytes(id);
    const size_t keep = held_.size() - utf8::unfinished_suffix(held_);
    std::string out = utf8::lossy(std::string_view(held_).substr(0, keep));
    held_.erase(0, keep);
    return out;
  }
  window_.push_back(id);
  const size_t end = window_.size() - unfinished_tail();
  if (end <= done_) return {};

  std::string text = tokenizer_->decode(std::span(window_).first(end));
  // Everything before `done_` decodes the same with more ids after it (a complete character or a
  // non-byte piece ends there), so `text` extends `text_`. The cut is a guard: SentencePiece's
  // output is whole characters.
  const size_t keep = text.size() - utf8::unfinished_suffix(text);
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
  if (tokenizer_->bpe_) {
    std::string out = utf8::lossy(held_);  // an unfinished character becomes U+FFFD, as in decode
    held_.clear();
    return out;
  }
  const std::string text = tokenizer_->decode(window_);
  std::string out = text.size() > text_.size() ? text.substr(text_.size()) : std::string();
  window_.clear();
  done_ = 0;
  text_.clear();
  return out;
}

}  // namespace bitdelta
