#include "bitdelta/fingerprint.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "bitdelta/error.h"

namespace bitdelta {

namespace {

void put_u64(XXH3_state_t* state, uint64_t v) {
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = (unsigned char)((v >> (8 * i)) & 0xff);
  XXH3_128bits_update(state, le, 8);
}

void put_string(XXH3_state_t* state, std::string_view s) {
  put_u64(state, s.size());
  XXH3_128bits_update(state, s.data(), s.size());
}

}  // namespace

std::string fingerprint(std::vector<std::pair<std::string, TensorView>> tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (!state || XXH3_128bits_reset(state.get()) != XXH_OK) fail("fingerprint: cannot create hash state");
  for (const auto& [name, t] : tensors) {
    put_string(state.get(), name);
    put_string(state.get(), dtype_name(t.dtype));
    put_u64(state.get(), t.shape.size());
    for (uint64_t d : t.shape) put_u64(state.get(), d);
    const uint64_t n = t.data.size();
    put_u64(state.get(), n);
    // Windows: [0, W), [n/2 - W/2, n/2 + W/2), [n - W, n), clipped to the tensor and merged where
    // they overlap, so a tensor of at most 3W bytes is hashed whole.
    const uint64_t w = kFingerprintWindow;
    if (n <= 3 * w) {
      XXH3_128bits_update(state.get(), t.data.data(), n);
    } else {
      const uint64_t mid = n / 2 - w / 2;
      XXH3_128bits_update(state.get(), t.data.data(), w);
      XXH3_128bits_update(state.get(), t.data.data() + mid, w);
      XXH3_128bits_update(state.get(), t.data.data() + n - w, w);
    }
  }
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(state.get()));
  std::string hex(32, '0');
  for (int i = 0; i < 16; ++i) std::snprintf(&hex[2 * i], 3, "%02x", canon.digest[i]);
  return hex;
}

}  // namespace bitdelta

namespace bitdelta {

std::string fingerprint(const Checkpoint& checkpoint) {
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const auto& name : checkpoint.tensor_names()) tensors.emplace_back(name, checkpoint.tensor(name));
  return fingerprint(std::move(tensors));
}

}  // namespace bitdelta
