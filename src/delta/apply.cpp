#include "bitdelta/apply.h"

#include <unistd.h>

#include <fstream>
#include <vector>

#include "bitdelta/error.h"
#include "bitdelta/fingerprint.h"
#include "bitdelta/thread_pool.h"

namespace bitdelta {

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kChunkBytes = 32u << 20;

// Removes a directory tree on scope exit unless released.
class TempDir {
 public:
  explicit TempDir(fs::path p) : path_(std::move(p)) {}
  ~TempDir() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  void release() { path_.clear(); }

 private:
  fs::path path_;
};

bool is_weight_file(const fs::path& p) {
  return p.extension() == ".safetensors" || p.filename() == "model.safetensors.index.json";
}

}  // namespace

void reconstruct_rows(const TensorView& base, const CompressedWeight& w, uint64_t row_begin, uint64_t row_end,
                      std::byte* dst) {
  const uint64_t cols = base.shape[1];
  const uint64_t esize = dtype_size(base.dtype);
  std::vector<float> row(cols);
  for (uint64_t r = row_begin; r < row_end; ++r) {
    to_f32(base.dtype, base.data.data() + r * cols * esize, row.data(), cols);
    const float a = w.alpha_of(r);
    const uint8_t* bits = w.sign_row(r);
    for (uint64_t c = 0; c < cols; ++c) row[c] += (bits[c / 8] >> (c % 8)) & 1 ? a : -a;
    from_f32(base.dtype, row.data(), dst + (r - row_begin) * cols * esize, cols);
  }
}

void apply_delta(const Checkpoint& base, const DeltaFile& delta, const fs::path& out_dir,
                 const ApplyOptions& options) {
  const std::string base_fp = fingerprint(base);
  if (base_fp != delta.base_fingerprint() && !options.force)
    fail(delta.path().string(), ": made for a base with fingerprint ", delta.base_fingerprint(), ", but ",
         base.dir().string(), " has fingerprint ", base_fp, " (use --force to apply anyway)");
  delta.check_against(base);

  std::error_code ec;
  if (fs::exists(out_dir, ec) && !(fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec)))
    fail(out_dir.string(), ": output directory exists and is not empty");
  fs::path temp = out_dir;
  temp += ".tmp-" + std::to_string(::getpid());
  fs::remove_all(temp, ec);
  if (!fs::create_directories(temp, ec) || ec)
    fail(out_dir.string(), ": cannot create output directory: ", ec ? ec.message() : "unknown error");
  TempDir guard(temp);

  // config, tokenizer and every other non-weight file come from the base.
  for (const auto& entry : fs::directory_iterator(base.dir())) {
    if (!entry.is_regular_file() || is_weight_file(entry.path())) continue;
    fs::copy_file(entry.path(), temp / entry.path().filename(), ec);
    if (ec) fail(entry.path().string(), ": cannot copy into ", out_dir.string(), ": ", ec.message());
  }
  if (fs::exists(base.dir() / "model.safetensors.index.json"))
    fs::copy_file(base.dir() / "model.safetensors.index.json", temp / "model.safetensors.index.json");

  ThreadPool pool(options.threads);
  const size_t total = base.tensor_names().size();
  size_t done = 0;
  std::vector<std::byte> buffer;
  for (const auto& shard_name : base.shard_names()) {  // same shard layout as the base
    const auto& shard = base.shard(shard_name);
    SafetensorsWriter writer(temp / shard_name, {{"format", "pt"}});
    std::vector<const TensorInfo*> tensors;
    for (const auto& t : shard.tensors())
      if (base.contains(t.name) && base.file_of(t.name).path() == shard.path()) tensors.push_back(&t);
    for (const auto* t : tensors) writer.add(t->name, t->dtype, t->shape);
    writer.begin();
    for (const auto* t : tensors) {
      const auto view = shard.view(*t);
      if (const auto* w = delta.find_compressed(t->name)) {
        const uint64_t rows = t->shape[0];
        const uint64_t row_bytes = t->shape[1] * dtype_size(t->dtype);
        const uint64_t chunk = std::max<uint64_t>(1, kChunkBytes / std::max<uint64_t>(1, row_bytes));
        for (uint64_t r0 = 0; r0 < rows; r0 += chunk) {
          const uint64_t nr = std::min(chunk, rows - r0);
          buffer.resize(nr * row_bytes);
          pool.parallel_for(nr, [&](size_t b, size_t e) {
            reconstruct_rows(view, *w, r0 + b, r0 + e, buffer.data() + b * row_bytes);
          });
          writer.write(buffer);
        }
      } else if (const auto* p = delta.find_whole(t->name)) {
        if (p->value.dtype == t->dtype) {
          writer.write(p->value.data);
        } else {  // check_against allowed only float -> float
          std::vector<float> f32(p->value.numel());
          to_f32(p->value.dtype, p->value.data.data(), f32.data(), f32.size());
          buffer.resize(t->bytes());
          from_f32(t->dtype, f32.data(), buffer.data(), f32.size());
          writer.write(buffer);
        }
      } else {
        writer.write(view.data);
      }
      if (options.on_progress) options.on_progress(++done, total);
    }
    writer.finish();
  }

  if (fs::exists(out_dir, ec)) fs::remove(out_dir, ec);  // an empty directory
  fs::rename(temp, out_dir, ec);
  if (ec) fail(out_dir.string(), ": cannot move the finished checkpoint into place: ", ec.message());
  guard.release();
}

}  // namespace bitdelta
