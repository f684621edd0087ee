#include <gtest/gtest.h>

#include <cstring>
#include <chrono>
#include <fstream>
#include <thread>
#include <vector>
#include <unistd.h>

#include "bitdelta/error.h"
#include "bitdelta/mapped_file.h"
#include "bitdelta/safetensors.h"
#include "test_util.h"

namespace bitdelta {
namespace {

using test::TempDir;

// Builds a file byte by byte, independently of SafetensorsWriter.
std::string raw_file(const std::string& header, const std::string& data, uint64_t claimed_len = ~0ull) {
  const uint64_t len = claimed_len == ~0ull ? header.size() : claimed_len;
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((len >> (8 * i)) & 0xff);
  return out + header + data;
}

void write_raw(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

std::string error_of(const std::filesystem::path& p) {
  try {
    SafetensorsFile f(p);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, ReadsHandBuiltFileZeroCopy) {
  TempDir dir;
  std::string data(4 * 2 + 3, '\0');
  const float vals[2] = {1.5f, -2.25f};
  std::memcpy(data.data(), vals, 8);
  data[8] = 7, data[9] = 8, data[10] = 9;
  write_raw(dir / "a.safetensors",
            raw_file(R"({"__metadata__":{"k":"v"},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},)"
                     R"("a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}})",
                     data));
  SafetensorsFile f(dir / "a.safetensors");
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "a");  // sorted by name
  EXPECT_EQ(f.metadata().at("k"), "v");
  const auto a = f.view("a");
  EXPECT_EQ(a.dtype, DType::F32);
  EXPECT_EQ(a.shape, (Shape{1, 2}));
  float got[2];
  std::memcpy(got, a.data.data(), 8);
  EXPECT_EQ(got[0], 1.5f);
  EXPECT_EQ(got[1], -2.25f);
  EXPECT_EQ(f.view("b").data[2], std::byte{9});
  EXPECT_EQ(f.find("c"), nullptr);
}

TEST(Safetensors, WriterRoundTripAllDtypes) {
  TempDir dir;
  test::TensorMap m;
  for (DType t : {DType::BF16, DType::F16, DType::F32, DType::U8, DType::I32}) {
    test::HostTensor h{t, {3, 5}, std::vector<std::byte>(15 * dtype_size(t))};
    for (size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = std::byte(i * 37 + size_t(t));
    m[std::string(dtype_name(t))] = h;
  }
  m["empty"] = {DType::F32, {0, 4}, {}};
  test::write_safetensors(dir / "w.safetensors", m, {{"format", "pt"}, {"x", "y"}});
  SafetensorsFile f(dir / "w.safetensors");
  EXPECT_EQ(f.metadata().at("x"), "y");
  for (const auto& [name, h] : m) {
    const auto v = f.view(name);
    EXPECT_EQ(v.dtype, h.dtype);
    EXPECT_EQ(v.shape, h.shape);
    ASSERT_EQ(v.data.size(), h.bytes.size());
    EXPECT_EQ(std::memcmp(v.data.data(), h.bytes.data(), h.bytes.size()), 0) << name;
  }
  // The data section starts 8-byte aligned.
  uint64_t data_bytes = 0;
  for (const auto& [name, h] : m) data_bytes += h.bytes.size();
  EXPECT_EQ((f.file_size() - data_bytes) % 8, 0u);
}

TEST(Safetensors, WriterLeavesNothingWhenUnfinished) {
  TempDir dir;
  {
    SafetensorsWriter w(dir / "x.safetensors", {});
    w.add("t", DType::F32, {4});
    w.begin();
    w.write(std::vector<std::byte>(8));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  SafetensorsWriter w(dir / "y.safetensors", {});
  w.add("t", DType::F32, {4});
  w.begin();
  w.write(std::vector<std::byte>(8));
  EXPECT_THROW(w.finish(), Error);  // incomplete tensor
  EXPECT_FALSE(std::filesystem::exists(dir / "y.safetensors"));
  EXPECT_THROW(w.write(std::vector<std::byte>(16)), Error);  // more than declared
}

// write_at: tensors filled in any order and in pieces make the same file as write() in order; a
// write past a tensor's end, a tensor left short, and mixing the two forms fail naming the file.
TEST(Safetensors, WriterPlacesTensorsByPosition) {
  TempDir dir;
  std::vector<std::byte> a(12), b(5), c(20);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::byte(i + 1);
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::byte(100 + i);
  for (size_t i = 0; i < c.size(); ++i) c[i] = std::byte(200 - i);
  const Metadata md{{"k", "v"}};
  const auto declare = [](SafetensorsWriter& w) {
    EXPECT_EQ(w.add("c", DType::U8, {20}), 0u);
    EXPECT_EQ(w.add("a", DType::F32, {3}), 1u);
    EXPECT_EQ(w.add("b", DType::U8, {5}), 2u);
    w.begin();
  };
  {
    SafetensorsWriter w(dir / "seq.safetensors", md);
    declare(w);
    w.write(c), w.write(a), w.write(b);
    w.finish();
  }
  {
    SafetensorsWriter w(dir / "pos.safetensors", md);
    declare(w);
    const std::span<const std::byte> cs(c);
    w.write_at(2, 0, b);
    w.write_at(0, 13, cs.subspan(13));
    w.write_at(1, 0, a);
    w.write_at(0, 0, cs.first(13));
    w.finish();
  }
  const auto bytes_of = [](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes_of(dir / "pos.safetensors"), bytes_of(dir / "seq.safetensors"));
  SafetensorsFile f(dir / "pos.safetensors");
  EXPECT_EQ(std::memcmp(f.view("a").data.data(), a.data(), a.size()), 0);

  const auto message = [&](auto&& body) {
    try {
      SafetensorsWriter w(dir / "bad.safetensors", md);
      declare(w);
      body(w);
      w.finish();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message([&](SafetensorsWriter& w) { w.write_at(2, 1, b); }).find("passes its end"), std::string::npos);
  EXPECT_NE(message([&](SafetensorsWriter& w) { w.write_at(2, 0, b), w.write_at(1, 0, a); }).find("tensor 'c' incomplete"),
            std::string::npos);
  EXPECT_NE(message([&](SafetensorsWriter& w) { w.write_at(2, 0, b), w.write(c); }).find("write after write_at"),
            std::string::npos);
  EXPECT_NE(message([&](SafetensorsWriter& w) { w.write(c), w.write_at(2, 0, b); }).find("write_at after write"),
            std::string::npos);
  EXPECT_NE(message([&](SafetensorsWriter& w) { w.write_at(3, 0, b); }).find("no tensor 3"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.safetensors"));
}

TEST(Safetensors, UnwritablePathFailsNamingIt) {
  TempDir dir;
  test::write_text(dir / "file", "x");
  try {
    SafetensorsWriter w(dir / "file" / "out.safetensors", {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out.safetensors"), std::string::npos) << e.what();
  }
}

struct BadCase {
  const char* label;
  std::string bytes;
  const char* expect;  // substring of the message
};

TEST(Safetensors, RejectsMalformedFilesNamingFileAndTensor) {
  TempDir dir;
  const std::string good_data(16, '\1');
  const std::vector<BadCase> cases = {
      {"empty", "", "truncated"},
      {"short", std::string(5, '\0'), "truncated"},
      {"header_too_long", raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x", 4096),
       "truncated safetensors file (header length 4096 exceeds file size"},
      {"not_safetensors", std::string("# a text file, not safetensors at all\n"), "not a safetensors file (header length"},
      {"bad_json", raw_file(R"({"a":{"dtype":)", good_data), "not valid JSON"},
      {"not_object", raw_file(R"([1,2])", good_data), "not a JSON object"},
      {"unknown_dtype", raw_file(R"({"w":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}})", good_data),
       "tensor 'w': unknown dtype 'Q4'"},
      {"lying_offsets", raw_file(R"({"w":{"dtype":"U8","shape":[32],"data_offsets":[0,32]}})", good_data),
       "tensor 'w': data_offsets [0, 32] lie outside"},
      {"reversed_offsets", raw_file(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", good_data),
       "tensor 'w': data_offsets begin 8 > end 4"},
      {"size_mismatch", raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", good_data),
       "tensor 'w': shape [3] x F32 needs 12 bytes but data_offsets span 16"},
      {"overlap",
       raw_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                good_data),
       "tensors 'a' and 'b' overlap"},
      {"negative_shape", raw_file(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", good_data),
       "tensor 'w': shape entries"},
      {"missing_offsets", raw_file(R"({"w":{"dtype":"U8","shape":[1]}})", good_data), "tensor 'w': data_offsets"},
      {"overflow", raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", good_data),
       "tensor 'w': size overflows"},
  };
  for (const auto& c : cases) {
    const auto path = dir / (std::string(c.label) + ".safetensors");
    write_raw(path, c.bytes);
    const std::string msg = error_of(path);
    EXPECT_NE(msg.find(path.string()), std::string::npos) << c.label << ": " << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.label << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << c.label;
  }
}

TEST(Safetensors, TruncatedDataIsCaught) {
  TempDir dir;
  test::TensorMap m{{"w", test::HostTensor::from_floats(DType::F32, {64}, test::random_floats(64, 3))}};
  test::write_safetensors(dir / "t.safetensors", m);
  std::filesystem::resize_file(dir / "t.safetensors", std::filesystem::file_size(dir / "t.safetensors") - 10);
  EXPECT_NE(error_of(dir / "t.safetensors").find("tensor 'w': data_offsets"), std::string::npos);
}

// Resident pages of this process (/proc/self/statm), in bytes.
size_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t total = 0, resident = 0;
  f >> total >> resident;
  return resident * size_t(::sysconf(_SC_PAGESIZE));
}

// A 64 MiB file of varied bytes for the page tests; returns its contents.
constexpr size_t kBigFile = size_t(64) << 20;
std::string write_big_file(const std::filesystem::path& p) {
  std::string data(kBigFile, '\0');
  for (size_t i = 0; i < kBigFile; ++i) data[i] = char((i * 2654435761u) >> 13);
  write_raw(p, data);
  return data;
}

// release_pages (used after the CPU engine repacks a delta's signs): the mapped pages leave this
// process's resident memory, and reading them again gives the same bytes.
TEST(MappedFile, ReleasedPagesLeaveResidentMemoryAndReadBackTheSame) {
  TempDir dir;
  write_big_file(dir / "big.bin");
  const MappedFile m(dir / "big.bin");
  const auto sum = [&] {
    uint64_t s = 0;
    for (size_t i = 0; i < m.size(); i += 64) s += uint64_t(m.bytes()[i]) * (i + 1);
    return s;
  };
  const uint64_t first = sum();  // faults every page in
  const size_t touched = resident_bytes();
  release_pages(m.bytes());
  const size_t released = resident_bytes();
  EXPECT_GT(touched, released + (size_t(48) << 20)) << "touched " << touched << ", after release " << released;
  EXPECT_EQ(sum(), first);
}

// populate_pages (used before a delta's upload copies it into pinned memory): every page of the
// range is mapped into this process without being touched, with the file's bytes; an empty range is
// a no-op.
TEST(MappedFile, PopulatedPagesAreResidentWithTheFilesBytes) {
  TempDir dir;
  const std::string data = write_big_file(dir / "big.bin");
  const MappedFile m(dir / "big.bin");
  populate_pages(m.bytes().subspan(0, 0));
  const size_t before = resident_bytes();
  populate_pages(m.bytes());
  const size_t after = resident_bytes();
  EXPECT_GT(after, before + (size_t(48) << 20)) << "before " << before << ", after populate " << after;
  EXPECT_EQ(std::memcmp(m.bytes().data(), data.data(), kBigFile), 0);
}

// SequentialPager (used by a delta's upload to copy each tensor as soon as the disk has read it):
// a waiter returns only once its range is paged in, whatever the order of the threads; the bytes it
// then reads are the file's; ranges outside the mapping and empty ranges never wait.
TEST(SequentialPager, WaitersReturnOnlyOnceTheirBytesArePagedIn) {
  TempDir dir;
  const std::string data = write_big_file(dir / "big.bin");
  const MappedFile m(dir / "big.bin");
  SequentialPager pager(m.bytes(), size_t(1) << 20);
  const std::vector<char> elsewhere(100);
  pager.wait_for(elsewhere.data(), elsewhere.size());  // before run(): would hang if it waited
  pager.wait_for(m.bytes().data() + kBigFile / 2, 0);
  EXPECT_EQ(pager.done(), 0u);
  // Ranges in file order, of sizes that straddle chunk boundaries, the last one ending at the end.
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t at = 0, n = 777; at < kBigFile; at += n, n = n * 3 + 4099)
    ranges.push_back({at, std::min(n, kBigFile - at)});
  std::string copy(kBigFile, '\0');
  std::vector<size_t> short_of;  // ranges whose wait returned before the pager had reached their end
  std::thread consumer([&] {
    for (const auto& [at, n] : ranges) {
      pager.wait_for(m.bytes().data() + at, n);
      if (pager.done() < at + n) short_of.push_back(at);
      std::memcpy(copy.data() + at, m.bytes().data() + at, n);
    }
  });
  // The consumer is waiting for its first range before anything is paged in (a wait that did not
  // wait would be seen below, whatever the sleep's length).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  pager.run();
  consumer.join();
  EXPECT_TRUE(short_of.empty()) << short_of.size() << " ranges returned early, the first at " << short_of[0];
  EXPECT_EQ(pager.done(), kBigFile);
  EXPECT_EQ(std::memcmp(copy.data(), data.data(), kBigFile), 0);
}

// stop() (a loader whose buffer could not be allocated): run() reads nothing more, and a waiter on
// bytes never paged in returns instead of hanging.
TEST(SequentialPager, StopEndsTheRunAndReleasesWaiters) {
  TempDir dir;
  write_big_file(dir / "big.bin");
  const MappedFile m(dir / "big.bin");
  SequentialPager pager(m.bytes(), size_t(1) << 20);
  std::thread waiter([&] { pager.wait_for(m.bytes().data() + kBigFile - 1, 1); });
  pager.stop();
  waiter.join();
  pager.run();
  EXPECT_EQ(pager.done(), 0u);
  SequentialPager empty(m.bytes().subspan(0, 0));
  empty.run();
  EXPECT_EQ(empty.done(), 0u);
}

}  // namespace
}  // namespace bitdelta
