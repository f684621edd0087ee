#include "bitdelta/delta_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bitdelta/error.h"

namespace bitdelta {

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

std::string_view alpha_mode_name(AlphaMode mode) { return mode == AlphaMode::Row ? "row" : "tensor"; }

AlphaMode alpha_mode_from_name(std::string_view name) {
  if (name == "row") return AlphaMode::Row;
  if (name == "tensor") return AlphaMode::Tensor;
  fail("unknown alpha mode '", name, "' (expected row or tensor)");
}

float CompressedWeight::alpha_of(uint64_t row) const {
  float a;
  std::memcpy(&a, alpha.data.data() + (alpha.shape[0] == 1 ? 0 : row) * 4, 4);
  return a;
}

DeltaFile::DeltaFile(const std::filesystem::path& path) : file_(path) {
  const std::string where = path.string();
  const auto& md = file_.metadata();
  auto get = [&](const char* key) {
    auto it = md.find(key);
    if (it == md.end()) fail(where, ": not a bitdelta delta file (metadata has no '", key, "')");
    return it->second;
  };
  if (get("format") != kDeltaFormat)
    fail(where, ": not a bitdelta delta file (metadata format is '", get("format"), "')");
  if (get("format_version") != kDeltaFormatVersion)
    fail(where, ": unsupported bitdelta format_version '", get("format_version"), "' (this build reads ",
         kDeltaFormatVersion, ")");
  base_fingerprint_ = get("base_fingerprint");
  try {
    alpha_mode_ = alpha_mode_from_name(get("alpha_mode"));
  } catch (const Error& e) {
    fail(where, ": ", e.what());
  }

  for (const auto& t : file_.tensors()) {
    const std::string at = where + ": tensor '" + t.name + "'";
    if (ends_with(t.name, kSignSuffix)) {
      const std::string name = t.name.substr(0, t.name.size() - std::strlen(kSignSuffix));
      const TensorInfo* a = file_.find(name + kAlphaSuffix);
      if (!a) fail(at, ": has no matching '", name, kAlphaSuffix, "'");
      if (t.dtype != DType::U8 || t.shape.size() != 2)
        fail(at, ": sign bits must be U8 [out, ceil(in/8)], got ", dtype_name(t.dtype), " ", shape_str(t.shape));
      const uint64_t expect_alpha = alpha_mode_ == AlphaMode::Row ? t.shape[0] : 1;
      if (a->dtype != DType::F32 || a->shape.size() != 1 || a->shape[0] != expect_alpha)
        fail(where, ": tensor '", a->name, "': alpha must be F32 [", expect_alpha, "] for alpha_mode ",
             alpha_mode_name(alpha_mode_), ", got ", dtype_name(a->dtype), " ", shape_str(a->shape));
      CompressedWeight w{name, file_.view(t), file_.view(*a)};
      for (uint64_t i = 0; i < expect_alpha; ++i)
        if (!std::isfinite(w.alpha_of(i))) fail(where, ": tensor '", a->name, "': alpha[", i, "] is not finite");
      compressed_.push_back(std::move(w));
    } else if (ends_with(t.name, kAlphaSuffix)) {
      const std::string name = t.name.substr(0, t.name.size() - std::strlen(kAlphaSuffix));
      if (!file_.find(name + kSignSuffix)) fail(at, ": has no matching '", name, kSignSuffix, "'");
    } else {
      whole_.push_back({t.name, file_.view(t)});
    }
  }
}

std::string DeltaFile::meta(const std::string& key) const {
  auto it = metadata().find(key);
  return it == metadata().end() ? "" : it->second;
}

const CompressedWeight* DeltaFile::find_compressed(std::string_view name) const {
  auto it = std::lower_bound(compressed_.begin(), compressed_.end(), name,
                             [](const CompressedWeight& w, std::string_view n) { return w.name < n; });
  return it != compressed_.end() && it->name == name ? &*it : nullptr;
}

const WholeParam* DeltaFile::find_whole(std::string_view name) const {
  auto it = std::lower_bound(whole_.begin(), whole_.end(), name,
                             [](const WholeParam& w, std::string_view n) { return w.name < n; });
  return it != whole_.end() && it->name == name ? &*it : nullptr;
}

void DeltaFile::check_against(const Checkpoint& base) const {
  const std::string where = path().string();
  for (const auto& w : compressed_) {
    if (!base.contains(w.name))
      fail(where, ": tensor '", w.name, "' is not in the base ", base.dir().string());
    const auto& b = base.info(w.name);
    if (b.shape.size() != 2 || !is_float(b.dtype))
      fail(where, ": tensor '", w.name, "': base weight is ", dtype_name(b.dtype), " ", shape_str(b.shape),
           ", not a 2-D floating weight");
    if (w.signs.shape[0] != b.shape[0] || w.signs.shape[1] != sign_row_bytes(b.shape[1]))
      fail(where, ": tensor '", w.name, kSignSuffix, "': shape ", shape_str(w.signs.shape), " does not fit base weight ",
           shape_str(b.shape), " (expected [", b.shape[0], ", ", sign_row_bytes(b.shape[1]), "])");
  }
  for (const auto& p : whole_) {
    if (!base.contains(p.name)) fail(where, ": tensor '", p.name, "' is not in the base ", base.dir().string());
    const auto& b = base.info(p.name);
    if (b.shape != p.value.shape)
      fail(where, ": tensor '", p.name, "': shape ", shape_str(p.value.shape), " differs from the base's ",
           shape_str(b.shape));
    if (b.dtype != p.value.dtype && !(is_float(b.dtype) && is_float(p.value.dtype)))
      fail(where, ": tensor '", p.name, "': dtype ", dtype_name(p.value.dtype), " cannot replace the base's ",
           dtype_name(b.dtype));
  }
}

}  // namespace bitdelta
