#include <gtest/gtest.h>

#include "bitdelta/fingerprint.h"
#include "test_util.h"

namespace bitdelta {
namespace {

struct Owned {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> bytes;
};

std::string fp(const std::vector<Owned>& ts) {
  std::vector<std::pair<std::string, TensorView>> views;
  for (const auto& t : ts) views.emplace_back(t.name, TensorView{t.dtype, t.shape, t.bytes});
  return fingerprint(views);
}

std::vector<Owned> sample() {
  std::vector<Owned> ts;
  for (size_t n : {size_t(100), size_t(3 * kFingerprintWindow), size_t(1 << 20)}) {
    Owned t{"t" + std::to_string(n), DType::U8, {n}, std::vector<std::byte>(n)};
    for (size_t i = 0; i < n; ++i) t.bytes[i] = std::byte((i * 2654435761u) >> 13);
    ts.push_back(std::move(t));
  }
  return ts;
}

TEST(Fingerprint, Is32HexDigitsAndOrderIndependent) {
  auto ts = sample();
  const auto a = fp(ts);
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  std::swap(ts[0], ts[2]);
  EXPECT_EQ(fp(ts), a);
}

TEST(Fingerprint, ChangesWhenAWindowByteChanges) {
  const auto base = fp(sample());
  const size_t n = 1 << 20, w = kFingerprintWindow;
  for (size_t pos : {size_t(0), w - 1, n / 2 - w / 2, n / 2 + w / 2 - 1, n - w, n - 1}) {
    auto ts = sample();
    ts[2].bytes[pos] ^= std::byte{1};
    EXPECT_NE(fp(ts), base) << "byte " << pos;
  }
  // Small tensors (<= 3 windows) are hashed whole.
  auto ts = sample();
  ts[1].bytes[w + 5] ^= std::byte{1};
  EXPECT_NE(fp(ts), base);
}

TEST(Fingerprint, IgnoresBytesOutsideTheWindows) {
  const auto base = fp(sample());
  const size_t n = 1 << 20, w = kFingerprintWindow;
  for (size_t pos : {w, w + 1000, n / 2 - w / 2 - 1, n / 2 + w / 2, n - w - 1}) {
    auto ts = sample();
    ts[2].bytes[pos] ^= std::byte{0xff};
    EXPECT_EQ(fp(ts), base) << "byte " << pos;
  }
}

TEST(Fingerprint, ChangesWithNameDtypeShape) {
  const auto base = fp(sample());
  auto a = sample();
  a[0].name = "renamed";
  EXPECT_NE(fp(a), base);
  auto b = sample();
  b[0].dtype = DType::I8;
  EXPECT_NE(fp(b), base);
  auto c = sample();
  c[0].shape = {10, 10};
  EXPECT_NE(fp(c), base);
}

}  // namespace
}  // namespace bitdelta
