// The BitDelta delta file, format v1 (docs/FORMAT.md): a safetensors file holding, for each
// compressed linear weight NAME, NAME.sign (U8 [out, ceil(in/8)], LSB first, 1 = +1) and
// NAME.alpha (F32 [out] or [1]); every other changed parameter whole under its own name.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "bitdelta/checkpoint.h"
#include "bitdelta/safetensors.h"

namespace bitdelta {

inline constexpr const char* kDeltaFormat = "bitdelta";
inline constexpr const char* kDeltaFormatVersion = "1";
inline constexpr const char* kSignSuffix = ".sign";
inline constexpr const char* kAlphaSuffix = ".alpha";

enum class AlphaMode { Row, Tensor };
std::string_view alpha_mode_name(AlphaMode mode);
AlphaMode alpha_mode_from_name(std::string_view name);  // throws on anything but row|tensor

inline uint64_t sign_row_bytes(uint64_t in) { return (in + 7) / 8; }

struct CompressedWeight {
  std::string name;  // the weight's name in the checkpoint, without suffix
  TensorView signs;  // U8 [out, ceil(in/8)]
  TensorView alpha;  // F32 [out] or [1]
  uint64_t out() const { return signs.shape[0]; }
  uint64_t row_bytes() const { return signs.shape[1]; }
  const uint8_t* sign_row(uint64_t r) const {
    return reinterpret_cast<const uint8_t*>(signs.data.data()) + r * row_bytes();
  }
  float alpha_of(uint64_t row) const;  // handles both α modes
};

struct WholeParam {
  std::string name;
  TensorView value;
};

class DeltaFile {
 public:
  // Opens and validates the structure: metadata, sign/alpha pairs, dtypes, shapes, finite α.
  explicit DeltaFile(const std::filesystem::path& path);

  const SafetensorsFile& file() const { return file_; }
  const std::filesystem::path& path() const { return file_.path(); }
  const Metadata& metadata() const { return file_.metadata(); }
  std::string meta(const std::string& key) const;  // "" if absent
  const std::string& base_fingerprint() const { return base_fingerprint_; }
  AlphaMode alpha_mode() const { return alpha_mode_; }

  const std::vector<CompressedWeight>& compressed() const { return compressed_; }  // sorted by name
  const std::vector<WholeParam>& whole() const { return whole_; }                  // sorted by name
  const CompressedWeight* find_compressed(std::string_view name) const;
  const WholeParam* find_whole(std::string_view name) const;

  // Checks every entry against the base's tensors (presence, shapes, dtypes); throws naming the
  // first tensor that does not fit. Does not compare fingerprints.
  void check_against(const Checkpoint& base) const;

 private:
  SafetensorsFile file_;
  std::string base_fingerprint_;
  AlphaMode alpha_mode_ = AlphaMode::Row;
  std::vector<CompressedWeight> compressed_;
  std::vector<WholeParam> whole_;
};

}  // namespace bitdelta
