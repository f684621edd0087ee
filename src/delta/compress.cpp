#include "bitdelta/compress.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <regex>
#include <thread>

#include "bitdelta/error.h"
#include "bitdelta/fingerprint.h"
#include "bitdelta/thread_pool.h"
#include "compress_kernel.h"

namespace bitdelta {

namespace fs = std::filesystem;

namespace {

// Input is streamed in chunks of about this many bytes (base + fine-tune). Measured on the 2-core
// machine (bench/RESULTS.md): 1-4 MB chunks stay in cache between the read and the arithmetic and
// beat 16-32 MB chunks by ~30%.
constexpr uint64_t kChunkBytes = 2u << 20;

enum class Action { Compress, Whole, Omit };

struct Planned {
  std::string name;
  Action action;
};

std::string where(const Checkpoint& c, const std::string& name) {
  return c.file_of(name).path().string() + ": tensor '" + name + "'";
}

// Compared through pread in chunks: cheaper than faulting the pages of a mapping, and bounded.
bool same_bytes(const Checkpoint& base, const Checkpoint& ft, const std::string& name) {
  const auto& bi = base.info(name);
  const auto& fi = ft.info(name);
  thread_local std::vector<std::byte> a, b;
  const uint64_t step = kChunkBytes / 2;
  a.resize(std::min(step, bi.bytes()));
  b.resize(a.size());
  for (uint64_t off = 0; off < bi.bytes(); off += step) {
    const uint64_t len = std::min(step, bi.bytes() - off);
    base.file_of(name).read(bi, off, len, a.data());
    ft.file_of(name).read(fi, off, len, b.data());
    if (std::memcmp(a.data(), b.data(), len) != 0) return false;
  }
  return true;
}

// One piece of input: a byte range of a tensor in the fine-tune, and the same range in the base
// (unless only the fine-tune's bytes are needed, for parameters stored whole).
struct ChunkJob {
  const SafetensorsFile* base_file;
  const SafetensorsFile* ft_file;
  const TensorInfo* base_info;
  const TensorInfo* ft_info;
  uint64_t offset, len;
  bool need_base;
};

// Reads chunks with pread on a background thread, one chunk ahead of the compute, into two
// alternating buffers: the disk (or page-cache copy) and the arithmetic overlap, and memory stays
// at two chunks whatever the model size.
class Prefetcher {
 public:
  struct Chunk {
    std::span<const std::byte> base, ft;
  };

  explicit Prefetcher(std::vector<ChunkJob> jobs) : jobs_(std::move(jobs)), thread_([this] { run(); }) {}
  ~Prefetcher() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // The next chunk, in job order; valid until the following call.
  Chunk next() {
    std::unique_lock lock(mutex_);
    if (consumed_ > 0) ++released_;  // the previous chunk's buffer may be refilled
    cv_.notify_all();
    cv_.wait(lock, [&] { return read_ > consumed_ || error_; });
    if (error_ && read_ <= consumed_) std::rethrow_exception(error_);
    Slot& slot = slots_[consumed_ % 2];
    const ChunkJob& job = jobs_[consumed_++];
    return {std::span<const std::byte>(slot.base.data(), job.need_base ? job.len : 0),
            std::span<const std::byte>(slot.ft.data(), job.len)};
  }

 private:
  struct Slot {
    std::vector<std::byte> base, ft;
  };

  void run() {
    try {
      for (size_t i = 0; i < jobs_.size(); ++i) {
        {
          std::unique_lock lock(mutex_);
          cv_.wait(lock, [&] { return stop_ || i < released_ + 2; });  // slot i % 2 is free
          if (stop_) return;
        }
        const ChunkJob& job = jobs_[i];
        Slot& slot = slots_[i % 2];
        slot.ft.resize(std::max<size_t>(slot.ft.size(), job.len));
        job.ft_file->read(*job.ft_info, job.offset, job.len, slot.ft.data());
        if (job.need_base) {
          slot.base.resize(std::max<size_t>(slot.base.size(), job.len));
          job.base_file->read(*job.base_info, job.offset, job.len, slot.base.data());
        }
        std::lock_guard lock(mutex_);
        ++read_;
        cv_.notify_all();
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      cv_.notify_all();
    }
  }

  std::vector<ChunkJob> jobs_;
  Slot slots_[2];
  std::mutex mutex_;
  std::condition_variable cv_;
  size_t read_ = 0, consumed_ = 0, released_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace

bool is_block_linear(const std::string& name, const TensorInfo& info) {
  static const std::regex block_weight(R"((^|\.)(layers|layer|h|blocks)\.[0-9]+\..+\.weight$)");
  return info.shape.size() == 2 && is_float(info.dtype) && std::regex_search(name, block_weight);
}

CompressReport compress(const Checkpoint& base, const Checkpoint& ft, const fs::path& out,
                        const CompressOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  CompressReport report;

  // 1. Plan: both sides hold the same tensors with the same dtypes and shapes.
  for (const auto& name : base.tensor_names())
    if (!ft.contains(name))
      fail(ft.dir().string(), ": tensor '", name, "' is missing from the fine-tune (present in the base)");
  for (const auto& name : ft.tensor_names())
    if (!base.contains(name))
      fail(base.dir().string(), ": tensor '", name, "' is missing from the base (present in the fine-tune)");
  std::vector<Planned> plan;
  CompressProgress progress;
  for (const auto& name : base.tensor_names()) {
    const auto& b = base.info(name);
    const auto& f = ft.info(name);
    if (b.dtype != f.dtype)
      fail(where(ft, name), ": dtype ", dtype_name(f.dtype), " differs from the base's ", dtype_name(b.dtype));
    if (b.shape != f.shape)
      fail(where(ft, name), ": shape ", shape_str(f.shape), " differs from the base's ", shape_str(b.shape));
    report.base_bytes += b.bytes();
    report.finetuned_bytes += f.bytes();
    const bool linear = is_block_linear(name, b);
    plan.push_back({name, linear ? Action::Compress : Action::Whole});
    progress.bytes_total += 2 * b.bytes();
  }
  progress.tensors_total = plan.size();

  // Unchanged parameters are omitted; this reads only the non-linear ones (embeddings, norms).
  for (auto& p : plan) {
    if (p.action != Action::Whole) continue;
    if (same_bytes(base, ft, p.name)) p.action = Action::Omit;
    const uint64_t bytes = 2 * base.info(p.name).bytes();
    if (p.action == Action::Omit) {
      progress.bytes_done += bytes;
      ++progress.tensors_done;
    }
  }

  Metadata md{{"format", kDeltaFormat},
              {"format_version", kDeltaFormatVersion},
              {"base_fingerprint", fingerprint(base)},
              {"finetuned_fingerprint", fingerprint(ft)},
              {"alpha_mode", std::string(alpha_mode_name(options.alpha_mode))},
              {"alpha_source", "mean_abs"},
              {"architecture", ft.architecture()},
              {"created_by", options.created_by}};
  for (const auto& p : plan) {
    report.compressed += p.action == Action::Compress;
    report.whole += p.action == Action::Whole;
    report.omitted += p.action == Action::Omit;
  }
  md["compressed_tensors"] = std::to_string(report.compressed);
  md["whole_tensors"] = std::to_string(report.whole);
  md["finetuned_bytes"] = std::to_string(report.finetuned_bytes);

  // Every α first, then the signs and whole tensors: a loader checks the α when it opens the file
  // (DeltaFile), and then reads only the file's head, not one scattered page per tensor before it
  // can start on the rest. α is known only after its tensor's signs, so the data go in by position.
  SafetensorsWriter writer(out, md);
  std::vector<size_t> alpha_at(plan.size()), data_at(plan.size());  // writer indices
  for (size_t i = 0; i < plan.size(); ++i)
    if (plan[i].action == Action::Compress)
      alpha_at[i] = writer.add(plan[i].name + kAlphaSuffix, DType::F32,
                               {options.alpha_mode == AlphaMode::Row ? base.info(plan[i].name).shape[0] : uint64_t(1)});
  for (size_t i = 0; i < plan.size(); ++i) {
    const auto& info = base.info(plan[i].name);
    if (plan[i].action == Action::Compress)
      data_at[i] = writer.add(plan[i].name + kSignSuffix, DType::U8, {info.shape[0], sign_row_bytes(info.shape[1])});
    else if (plan[i].action == Action::Whole)
      data_at[i] = writer.add(plan[i].name, info.dtype, info.shape);
  }
  writer.begin();

  // 2. Stream: the same chunk order for the reader thread and for the compute below.
  auto chunk_bytes_of = [](const TensorInfo& info, Action action) -> uint64_t {
    if (action == Action::Whole || info.shape[1] == 0) return kChunkBytes;
    const uint64_t row_in = info.shape[1] * dtype_size(info.dtype);
    return std::max<uint64_t>(1, kChunkBytes / 2 / row_in) * row_in;  // whole rows, both sides
  };
  std::vector<ChunkJob> jobs;
  for (const auto& p : plan) {
    if (p.action == Action::Omit) continue;
    const auto& bfile = base.file_of(p.name);
    const auto& ffile = ft.file_of(p.name);
    const auto& binfo = bfile.info(p.name);
    const uint64_t step = chunk_bytes_of(binfo, p.action);
    for (uint64_t off = 0; off < binfo.bytes(); off += step)
      jobs.push_back({&bfile, &ffile, &binfo, &ffile.info(p.name), off, std::min(step, binfo.bytes() - off),
                      p.action == Action::Compress});
  }
  Prefetcher reader(std::move(jobs));

  ThreadPool pool(options.threads);
  std::vector<uint8_t> signs;
  std::vector<RowSums> sums;
  for (size_t pi = 0; pi < plan.size(); ++pi) {
    const auto& p = plan[pi];
    if (p.action == Action::Omit) continue;
    const auto& binfo = base.info(p.name);
    const uint64_t step = chunk_bytes_of(binfo, p.action);

    if (p.action == Action::Whole) {
      for (uint64_t off = 0; off < binfo.bytes(); off += step) writer.write_at(data_at[pi], off, reader.next().ft);
      progress.bytes_done += 2 * binfo.bytes();
      ++progress.tensors_done;
      if (options.on_progress) options.on_progress(progress);
      continue;
    }

    const uint64_t rows = binfo.shape[0], cols = binfo.shape[1];
    const uint64_t row_in = cols * dtype_size(binfo.dtype);
    const uint64_t row_out = sign_row_bytes(cols);
    const uint64_t chunk_rows = cols ? step / row_in : rows;
    sums.assign(rows, {});
    for (uint64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const uint64_t nr = std::min(chunk_rows, rows - r0);
      const auto chunk = cols ? reader.next() : Prefetcher::Chunk{};
      signs.resize(nr * row_out);
      pool.parallel_for(nr, [&](size_t begin, size_t end) {
        thread_local std::vector<float> b32, f32;
        b32.resize(cols);
        f32.resize(cols);
        for (size_t i = begin; i < end; ++i) {
          to_f32(binfo.dtype, chunk.base.data() + i * row_in, b32.data(), cols);
          to_f32(binfo.dtype, chunk.ft.data() + i * row_in, f32.data(), cols);
          sums[r0 + i] = compress_row(b32.data(), f32.data(), cols, signs.data() + i * row_out);
        }
      });
      writer.write_at(data_at[pi], r0 * row_out, std::as_bytes(std::span(signs)));
      progress.bytes_done += 2 * nr * row_in;
      if (options.on_progress) options.on_progress(progress);
    }

    // α and the error ‖Δ − α·S‖² = ΣΔ² − 2α·Σ|Δ| + n·α² (since S·Δ = |Δ| elementwise).
    double total_abs = 0, total_sq = 0;
    for (const auto& s : sums) {
      total_abs += s.abs;
      total_sq += s.sq;
    }
    if (!std::isfinite(total_abs) || !std::isfinite(total_sq))
      fail(where(ft, p.name), ": base or fine-tune holds NaN or infinite values");
    std::vector<float> alpha;
    double err2 = 0;
    if (options.alpha_mode == AlphaMode::Row) {
      alpha.resize(rows);
      for (uint64_t r = 0; r < rows; ++r) {
        alpha[r] = cols ? float(sums[r].abs / double(cols)) : 0.0f;
        const double a = alpha[r];
        err2 += sums[r].sq - 2 * a * sums[r].abs + double(cols) * a * a;
      }
    } else {
      const double n = double(rows) * double(cols);
      alpha.assign(1, n > 0 ? float(total_abs / n) : 0.0f);
      const double a = alpha[0];
      err2 = total_sq - 2 * a * total_abs + n * a * a;
    }
    writer.write_at(alpha_at[pi], 0, std::as_bytes(std::span(alpha)));
    report.errors.push_back({p.name, binfo.shape, total_sq > 0 ? std::sqrt(std::max(0.0, err2) / total_sq) : 0.0});
    ++progress.tensors_done;
    if (options.on_progress) options.on_progress(progress);
  }
  writer.finish();
  report.output_bytes = fs::file_size(out);
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace bitdelta
