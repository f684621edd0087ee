#include "bitdelta/compress.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <regex>

#include "bitdelta/error.h"
#include "bitdelta/fingerprint.h"
#include "bitdelta/thread_pool.h"
#include "compress_kernel.h"

namespace bitdelta {

namespace fs = std::filesystem;

namespace {

// Rows are processed in chunks of about this many input bytes (base + fine-tune): small enough to
// bound memory, large enough to keep both threads busy and the disk streaming.
constexpr uint64_t kChunkBytes = 32u << 20;

enum class Action { Compress, Whole, Omit };

struct Planned {
  std::string name;
  Action action;
};

std::string where(const Checkpoint& c, const std::string& name) {
  return c.file_of(name).path().string() + ": tensor '" + name + "'";
}

bool same_bytes(const Checkpoint& base, const Checkpoint& ft, const std::string& name) {
  const auto& bi = base.info(name);
  const auto& fi = ft.info(name);
  const auto a = base.tensor(name).data;
  const auto b = ft.tensor(name).data;
  bool same = true;
  for (uint64_t off = 0; off < a.size() && same; off += kChunkBytes) {
    const uint64_t len = std::min<uint64_t>(kChunkBytes, a.size() - off);
    same = std::memcmp(a.data() + off, b.data() + off, len) == 0;
    base.file_of(name).release(bi, off, len);
    ft.file_of(name).release(fi, off, len);
  }
  return same;
}

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

  SafetensorsWriter writer(out, md);
  for (const auto& p : plan) {
    const auto& info = base.info(p.name);
    if (p.action == Action::Compress) {
      writer.add(p.name + kSignSuffix, DType::U8, {info.shape[0], sign_row_bytes(info.shape[1])});
      writer.add(p.name + kAlphaSuffix, DType::F32,
                 {options.alpha_mode == AlphaMode::Row ? info.shape[0] : uint64_t(1)});
    } else if (p.action == Action::Whole) {
      writer.add(p.name, info.dtype, info.shape);
    }
  }
  writer.begin();

  // 2. Stream.
  ThreadPool pool(options.threads);
  std::vector<uint8_t> signs;
  std::vector<RowSums> sums;
  for (const auto& p : plan) {
    if (p.action == Action::Omit) continue;
    const auto& bfile = base.file_of(p.name);
    const auto& ffile = ft.file_of(p.name);
    const auto& binfo = bfile.info(p.name);
    const auto& finfo = ffile.info(p.name);
    const auto bview = bfile.view(binfo);
    const auto fview = ffile.view(finfo);

    if (p.action == Action::Whole) {
      for (uint64_t off = 0; off < fview.data.size(); off += kChunkBytes) {
        const uint64_t len = std::min<uint64_t>(kChunkBytes, fview.data.size() - off);
        writer.write(fview.data.subspan(off, len));
        ffile.release(finfo, off, len);
      }
      progress.bytes_done += 2 * binfo.bytes();
      ++progress.tensors_done;
      if (options.on_progress) options.on_progress(progress);
      continue;
    }

    const uint64_t rows = binfo.shape[0], cols = binfo.shape[1];
    const uint64_t esize = dtype_size(binfo.dtype);
    const uint64_t row_in = cols * esize;
    const uint64_t row_out = sign_row_bytes(cols);
    const uint64_t chunk_rows = std::max<uint64_t>(1, kChunkBytes / std::max<uint64_t>(1, 2 * row_in));
    sums.assign(rows, {});
    for (uint64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
      const uint64_t nr = std::min(chunk_rows, rows - r0);
      if (r0 + nr < rows) {  // start reading the next chunk while this one is computed
        bfile.will_need(binfo, (r0 + nr) * row_in, chunk_rows * row_in);
        ffile.will_need(finfo, (r0 + nr) * row_in, chunk_rows * row_in);
      }
      signs.resize(nr * row_out);
      pool.parallel_for(nr, [&](size_t begin, size_t end) {
        thread_local std::vector<float> b32, f32;
        b32.resize(cols);
        f32.resize(cols);
        for (size_t i = begin; i < end; ++i) {
          const uint64_t r = r0 + i;
          to_f32(binfo.dtype, bview.data.data() + r * row_in, b32.data(), cols);
          to_f32(finfo.dtype, fview.data.data() + r * row_in, f32.data(), cols);
          sums[r] = compress_row(b32.data(), f32.data(), cols, signs.data() + i * row_out);
        }
      });
      writer.write(std::as_bytes(std::span(signs)));
      bfile.release(binfo, r0 * row_in, nr * row_in);
      ffile.release(finfo, r0 * row_in, nr * row_in);
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
    writer.write(std::as_bytes(std::span(alpha)));
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
