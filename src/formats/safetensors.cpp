#include "bitdelta/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "bitdelta/error.h"

namespace bitdelta {

using nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

uint64_t read_u64_le(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | uint64_t(p[i]);
  return v;
}

uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) fail(what, ": size overflows");
  return a * b;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : file_(path) {
  const std::string where = path.string();
  const auto bytes = file_.bytes();
  if (bytes.size() < 8) fail(where, ": truncated safetensors file (", bytes.size(), " bytes, no header length)");
  const uint64_t header_len = read_u64_le(bytes.data());
  if (header_len > bytes.size() - 8) {
    // A header that starts as one does ('{') is a file cut short; anything else is another kind of file.
    const bool json_start = bytes.size() > 8 && bytes[8] == std::byte{'{'};
    fail(where, json_start ? ": truncated safetensors file" : ": not a safetensors file", " (header length ",
         header_len, " exceeds file size ", bytes.size(), ")");
  }
  if (header_len > kMaxHeaderBytes) fail(where, ": header length ", header_len, " is implausibly large");
  data_start_ = 8 + header_len;
  const uint64_t data_size = bytes.size() - data_start_;

  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(bytes.data()) + 8,
                         reinterpret_cast<const char*>(bytes.data()) + data_start_);
  } catch (const json::exception& e) {
    fail(where, ": header is not valid JSON (", e.what(), ")");
  }
  if (!header.is_object()) fail(where, ": header is not a JSON object");

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(where, ": __metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) fail(where, ": __metadata__ value of '", key, "' is not a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string at = where + ": tensor '" + name + "'";
    if (!entry.is_object()) fail(at, ": entry is not an object");
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) fail(at, ": missing dtype");
    if (!entry.contains("shape") || !entry["shape"].is_array()) fail(at, ": missing shape");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2)
      fail(at, ": data_offsets must be [begin, end]");
    TensorInfo t;
    t.name = name;
    const auto dtype_text = entry["dtype"].get<std::string>();
    const auto dtype = dtype_from_name(dtype_text);
    if (!dtype) fail(at, ": unknown dtype '", dtype_text, "'");
    t.dtype = *dtype;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
        fail(at, ": shape entries must be non-negative integers");
      t.shape.push_back(d.get<uint64_t>());
    }
    for (const auto& o : entry["data_offsets"])
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<int64_t>() >= 0))
        fail(at, ": data_offsets must be non-negative integers");
    t.begin = entry["data_offsets"][0].get<uint64_t>();
    t.end = entry["data_offsets"][1].get<uint64_t>();
    if (t.begin > t.end) fail(at, ": data_offsets begin ", t.begin, " > end ", t.end);
    if (t.end > data_size)
      fail(at, ": data_offsets [", t.begin, ", ", t.end, "] lie outside the data section (", data_size,
           " bytes; file truncated?)");
    uint64_t expected = dtype_size(t.dtype);
    for (uint64_t d : t.shape) expected = checked_mul(expected, d, at);
    if (expected != t.bytes())
      fail(at, ": shape ", shape_str(t.shape), " x ", dtype_name(t.dtype), " needs ", expected,
           " bytes but data_offsets span ", t.bytes());
    tensors_.push_back(std::move(t));
  }

  // No two tensors may share bytes.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](auto* a, auto* b) { return a->begin < b->begin || (a->begin == b->begin && a->end < b->end); });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto* prev = by_offset[i - 1];
    const auto* cur = by_offset[i];
    if (cur->begin < prev->end && cur->bytes() > 0 && prev->bytes() > 0)
      fail(where, ": tensors '", prev->name, "' and '", cur->name, "' overlap (", prev->begin, "..",
           prev->end, " and ", cur->begin, "..", cur->end, ")");
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  const auto* t = find(name);
  if (!t) fail(path().string(), ": no tensor '", name, "'");
  return *t;
}

TensorView SafetensorsFile::view(const TensorInfo& t) const {
  return {t.dtype, t.shape, file_.bytes().subspan(data_start_ + t.begin, t.bytes())};
}

void SafetensorsFile::read(const TensorInfo& t, uint64_t offset, uint64_t len, std::byte* dst) const {
  if (offset > t.bytes() || len > t.bytes() - offset) fail(path().string(), ": tensor '", t.name, "': read out of range");
  file_.read(data_start_ + t.begin + offset, len, dst);
}

// ---------------------------------------------------------------------------------------------

struct SafetensorsWriter::Output {
  int fd = -1;
  std::vector<std::byte> buffer;

  ~Output() {
    if (fd >= 0) ::close(fd);
  }
};

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, Metadata metadata)
    : path_(std::move(path)), metadata_(std::move(metadata)), out_(std::make_unique<Output>()) {
  temp_path_ = path_;
  temp_path_ += ".tmp-" + std::to_string(::getpid());
  out_->fd = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_->fd < 0) fail(path_.string(), ": cannot create output file: ", std::strerror(errno));
  out_->buffer.reserve(8u << 20);
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!finished_) {
    out_.reset();
    std::error_code ec;
    std::filesystem::remove(temp_path_, ec);
  }
}

size_t SafetensorsWriter::add(std::string name, DType dtype, Shape shape) {
  if (header_bytes_) fail(path_.string(), ": tensor '", name, "' declared after the header was written");
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.begin = tensors_.empty() ? 0 : tensors_.back().end;
  t.end = t.begin + numel(t.shape) * dtype_size(dtype);
  for (const auto& other : tensors_)
    if (other.name == t.name) fail(path_.string(), ": tensor '", t.name, "' declared twice");
  tensors_.push_back(std::move(t));
  return tensors_.size() - 1;
}

void SafetensorsWriter::begin() {
  json header = json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  for (const auto& t : tensors_)
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned
  std::byte len[8];
  for (int i = 0; i < 8; ++i) len[i] = std::byte((uint64_t(text.size()) >> (8 * i)) & 0xff);
  header_bytes_ = 8 + text.size();
  out_->buffer.insert(out_->buffer.end(), len, len + 8);
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  out_->buffer.insert(out_->buffer.end(), p, p + text.size());
  current_ = 0;
}

static void write_all(int fd, const std::byte* p, size_t n, const std::filesystem::path& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path.string(), ": write failed: ", std::strerror(errno));
    }
    p += w;
    n -= size_t(w);
  }
}

void SafetensorsWriter::write(std::span<const std::byte> bytes) {
  if (!header_bytes_) fail(path_.string(), ": data written before the header");
  if (!placed_.empty()) fail(path_.string(), ": write after write_at");
  const uint64_t total = tensors_.empty() ? 0 : tensors_.back().end;
  if (offset_ + bytes.size() > total)
    fail(path_.string(), ": more data written than the declared tensors hold");
  offset_ += bytes.size();
  while (current_ < tensors_.size() && tensors_[current_].end <= offset_) ++current_;
  auto& buf = out_->buffer;
  if (buf.size() + bytes.size() > buf.capacity()) {
    write_all(out_->fd, buf.data(), buf.size(), temp_path_);
    buf.clear();
  }
  if (bytes.size() >= buf.capacity()) {
    write_all(out_->fd, bytes.data(), bytes.size(), temp_path_);
  } else {
    buf.insert(buf.end(), bytes.begin(), bytes.end());
  }
}

void SafetensorsWriter::write_at(size_t index, uint64_t offset, std::span<const std::byte> bytes) {
  if (!header_bytes_) fail(path_.string(), ": data written before the header");
  if (offset_ != 0) fail(path_.string(), ": write_at after write");
  if (index >= tensors_.size()) fail(path_.string(), ": write_at: no tensor ", index);
  const TensorInfo& t = tensors_[index];
  if (offset > t.bytes() || bytes.size() > t.bytes() - offset)
    fail(path_.string(), ": tensor '", t.name, "': write of ", bytes.size(), " bytes at ", offset, " passes its end");
  if (placed_.empty()) {  // the header first, where write() would have put it
    placed_.assign(tensors_.size(), 0);
    write_all(out_->fd, out_->buffer.data(), out_->buffer.size(), temp_path_);
    out_->buffer.clear();
  }
  off_t at = off_t(header_bytes_ + t.begin + offset);
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t w = ::pwrite(out_->fd, bytes.data() + done, bytes.size() - done, at);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path_.string(), ": write failed: ", std::strerror(errno));
    }
    done += size_t(w);
    at += w;
  }
  placed_[index] += bytes.size();
}

void SafetensorsWriter::finish() {
  if (!header_bytes_) begin();
  if (!placed_.empty()) {
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (placed_[i] != tensors_[i].bytes())
        fail(path_.string(), ": tensor '", tensors_[i].name, "' incomplete (", placed_[i], " of ",
             tensors_[i].bytes(), " bytes written)");
  } else if (const uint64_t total = tensors_.empty() ? 0 : tensors_.back().end; offset_ != total) {
    fail(path_.string(), ": tensor '", tensors_[current_].name, "' incomplete (", offset_, " of ", total,
         " data bytes written)");
  }
  write_all(out_->fd, out_->buffer.data(), out_->buffer.size(), temp_path_);
  out_->buffer.clear();
  if (::close(out_->fd) != 0) {
    out_->fd = -1;
    fail(path_.string(), ": close failed: ", std::strerror(errno));
  }
  out_->fd = -1;
  std::error_code ec;
  std::filesystem::rename(temp_path_, path_, ec);
  if (ec) fail(path_.string(), ": cannot rename temp file into place: ", ec.message());
  finished_ = true;
}

}  // namespace bitdelta
