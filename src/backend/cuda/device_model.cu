#include "device_model.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <numeric>

#include "bitdelta/delta_file.h"
#include "bitdelta/error.h"
#include "bitdelta/model.h"
#include "cuda_check.cuh"
#include "delta_terms_beside.cuh"
#include "fused_gemm_mma.cuh"
#include "fused_linear_decode.cuh"
#include "fused_linear_prefill.cuh"
#include "fused_linear_stream.cuh"
#include "ops.cuh"
#include "stream_scratch.cuh"

namespace bitdelta::cuda {

using bf16 = __nv_bfloat16;

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("no usable CUDA device (") + cudaGetErrorString(e) + ")";
  if (n == 0) return "no CUDA device found";
  return "";
}

namespace {

constexpr size_t kAlign = 256;           // every tensor on the device starts 256-byte aligned
constexpr size_t kDecodeRows = 32;          // rows per fused decode call (its limit: one read of W for all)
// Rows of one weight (and delta) in a step from which a GEMM beats 16-row fused decode launches
// (each of which reads the weight again): for the base alone cuBLAS wins from 17 rows; with a delta
// the fused GEMM (sm_90a: W_eff formed in registers, W read once) wins from 17 rows too — at 17, 32
// and 48 rows it took 0.20–0.60× the time of the 16-row decode launches on all five layer shapes
// (bench/RESULTS.md, case c'). Where the sm_90a GEMM does not run, a variant's rows take a GEMM from
// 48: kFused, which there is the portable fused GEMM up to kPortableFusedRows rows and W_eff
// materialized (≈ 3× the weight's bytes) past them. The 48 was measured with materialize, which won
// from about there (7B-shaped decode at batch 32 of one variant: 16.1 ms through two fused launches
// per linear, 18.2 ms through W_eff + GEMM with kernel v6; bench/cuda/NOTES.md).
// Where a variant's rows (or the base's) are all the rows of a weight (nothing to share a decode
// launch's read of W with), a GEMM wins sooner. A variant: from 8 rows, where the fused GEMM took
// 0.81–1.00× the time of one fused decode launch at 8, 12 and 16 rows on all five shapes (run 100,
// case c', after the GEMM stopped zero-filling x's missing rows). The base: from 12 rows, where
// cuBLAS took 0.88–0.94× the decode kernel's time on four shapes and 0.99× on 4096 × 11008; at
// 8 rows the decode kernel was faster on two shapes (run 101).
// Where the streaming kernel runs (sm_90a) it takes up to 32 rows of the base in one read of W, and
// 2 to 32 rows of one variant alone with W_eff formed in its stages (form_weights): chained in the
// decode step to the kernels around it, both beat the GEMMs and the 1-bit path (NOTES.md, part 28;
// 7B-shaped steps, runs 262-263: the base 2-7% faster at batches 12-32, one variant 2-6%; the GQA
// shape, runs 264-266: one variant 1% faster at batch 2, 7% at 4, 5% at 8, 3.5% at 32). One row
// keeps the one-row kernel: W_eff took 5.13 ms against its 4.48 (run 266).
constexpr size_t kGemmRowsBase = 17, kGemmRowsFused = 17, kGemmRowsMaterialize = 48;
constexpr size_t kGemmRowsBaseAlone = 12, kGemmRowsFusedAlone = 8;
// Where the streaming kernel does not run, a variant alone takes the register kernel's W_eff form from
// the same 2 rows (one launch, W read once): at 2 rows it took 11-22% less time than the register
// kernel's combined form at all five benchmark shapes (run 280, NOTES.md part 30).
constexpr size_t kWeffRows = 2, kPortableGemmRowsAlone = 25, kPortableGemmRowsAloneTall = 17,
                 kPortableGemmTallN = 16384;
// There too, a gathered run of rows of several variants (or of the base and variants) takes cuBLAS
// for the base of all its rows and one launch of the delta terms (delta_terms.cuh) from this many
// rows, instead of register-kernel launches that each read W and the variants' bits. The 7B mixed
// step of 14 variants on the compute_80 build, the register kernel against this, alternated twice
// (runs 301, 303; NOTES.md part 33): batch 16 11.71 / 11.88 → 10.37 / 10.40 ms, 12 11.04 / 11.06 →
// 9.52 / 9.65, 8 8.38 / 8.41 → 7.95 / 7.93, 6 8.00 / 8.05 → 7.40 / 7.31, 4 6.78 / 6.78 → 6.65 /
// 6.70; at batch 2 the register kernel won (5.79 / 5.85 against 6.03 / 6.06). At batch 3 (run 308,
// NOTES.md part 34) 6.62 / 6.65 → 6.56 / 6.56 ms.
constexpr size_t kDeltaTermsRows = 3;
// Where the streaming kernel runs, gathered rows with a delta among them take that route too, from
// the same kDeltaTermsRows (the base and the delta terms side by side on two streams since part 40:
// linear() below; the base through cuBLAS until part 56, since then through the streaming kernel
// with no delta); rows of the base alone keep the streaming kernel up to 32.
// Until part 38 rows past 32 went in 32-row chunks, each reading W again (run 327: batch 48 18.94 /
// 19.09 → 16.32 / 16.20 ms, 64 20.88 / 20.84 → 19.35 / 19.19 on the normal build); until part 40 the
// streaming kernel took up to 32 gathered rows in one launch. The 7B mixed step of 14 variants, the
// normal build, the streaming kernel against the two streams (run 342, alternated twice, NOTES.md
// part 40): batch 8 6.97 / 6.95 → 6.45 / 6.40 ms, 16 9.02 / 9.19 → 8.74 / 8.60, 32 11.49 / 11.51 →
// 11.09 / 10.99.
// Where it does not run, from kPortableGemmRowsAlone rows a variant alone goes to PrefillLinear's
// kFused: the portable fused GEMM (fused_gemm_mma.cuh) up to kPortableFusedRows rows, materialize past
// them. Its time is about flat in the rows (W read once, memory-bound), while the W_eff form's grows
// with them:
// run 322 (compute_80 build, the engine's four shapes, `--few-rows`) had the GEMM at 0.72-1.00×
// the W_eff form's bytes per second at 2-16 rows, 0.83-1.13× at 17, 0.84-1.16× at 24 and
// 0.95-1.31× at 32 (gate|up gains most; q|k|v still loses 5% at 32); the 7B-shaped step of one
// variant at batch 16 6.93 / 6.96 → 7.58 / 7.61 ms with the GEMM from 9 rows, at batch 32 9.89 /
// 9.92 → 9.10 / 9.12 with it from 17. So from 25, between the measured 24 (per layer +1%) and 32
// (−10%); but a weight of kPortableGemmTallN rows or more (gate|up, 22016 rows at 7B) from 17,
// where its GEMM took 0.86-0.89× the W_eff form's time at 17-24 rows (1.13-1.16× its bytes/s). Run
// 326, this per-shape rule against 25 for all, alternated twice: compute_80 build batch 17 7.89 /
// 8.00 → 7.74 / 7.75 ms, 20 8.17 / 8.21 → 7.95 / 7.88, 24 8.61 / 8.58 → 8.25 / 8.31; compute_90
// build batch 20 7.80 / 7.81 → 7.61 / 7.61, 24 8.21 / 8.32 → 7.94 / 7.93. Earlier, at 32 rows the
// portable GEMM took 0.44–0.74× the time of what ran past 32 rows before the W_eff form (cuBLAS on
// the base, then the delta-only launches; run 287, the five layer shapes), and at 33–64 rows
// 0.46–0.61× materialize's (run 293, the engine's shapes). The 7B-shaped step at batch 48 of one
// variant on the compute_80 build: 16.67 ms materializing (run 287), 8.15 with it (run 294; the base
// 6.64).
// `portable`: it takes every linear's K. In mixed steps a variant's rows still take a GEMM from 48.
// (DeviceModel::Impl::gemm_rows passes the device's answers.)
size_t gemm_rows(bool with_delta, bool fused, bool alone, bool streams, bool portable, int N) {
  if (streams && !with_delta) return kDecodeRows + 1;
  if (alone && !with_delta) return kGemmRowsBaseAlone;
  if (alone && fused) return kGemmRowsFusedAlone;
  if (alone && portable) {
    return size_t(N) >= kPortableGemmTallN ? kPortableGemmRowsAloneTall : kPortableGemmRowsAlone;
  }
  return !with_delta ? kGemmRowsBase : fused ? kGemmRowsFused : kGemmRowsMaterialize;
}
constexpr size_t kPrefillScratch = size_t(16) << 20;  // W_eff chunk elements (×2 buffers, bf16)

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The device and the compute stream; everything allocated is freed in stream order on it, so a
// buffer dropped between steps is reused only after the steps that read it.
// `beside`: a second stream for a linear's delta terms beside its base within a step
// (delta_terms_beside.cuh), forked from the compute stream and joined back.
struct Context {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<DeltaTermsBeside> beside;
  std::atomic<uint64_t> variant_bytes{0};  // the base's and every uploaded variant's device buffers
  ~Context() {
    beside.reset();
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
  }
};

void* device_alloc(size_t bytes, cudaStream_t stream, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, std::max<size_t>(bytes, 1), stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail("out of GPU memory: ", what, " needs ", bytes >> 20, " MiB, ", free_b >> 20, " MiB free of ", total_b >> 20,
         " MiB (", cudaGetErrorString(e), ")");
  }
  return p;
}

// A pinned host copy of one variant's device tensors, laid out exactly as on the device. Its pages
// are mapped at once and pinned by pin(), chunk by chunk, on a thread of their own while the file's
// bytes are written into them: on H100 hosts cudaHostAlloc of a 7B delta's 816 MB took 0.32-0.46 s,
// as long as the file's read, and the copy into the buffer could only start after it (run 389).
// Each chunk is registered on its own (portable: pinned for every context, whichever thread frees
// it), so copies to the device go chunk by chunk.
struct PinnedPack {
  static constexpr size_t kChunk = size_t(64) << 20;
  PinnedPack(const PinnedPack&) = delete;
  PinnedPack& operator=(const PinnedPack&) = delete;
  void* host = nullptr;
  size_t bytes = 0;
  explicit PinnedPack(size_t n) : bytes(n) {
    const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    mapped_ = (std::max<size_t>(n, 1) + page - 1) / page * page;
    void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail("cannot map ", n >> 20, " MiB of host memory for a delta: ", std::strerror(errno));
    ::madvise(p, mapped_, MADV_DONTFORK);  // no copy-on-write of pinned pages in a child (advice only)
    host = p;
  }
  ~PinnedPack() {
    for (size_t i = 0; i < pinned_; ++i) cudaHostUnregister(static_cast<std::byte*>(host) + i * kChunk);
    ::munmap(host, mapped_);
  }
  // Pins every chunk, front to back; throws naming the size that could not be pinned.
  void pin() {
    for (size_t at = pinned_ * kChunk; at < mapped_; at += kChunk, ++pinned_) {
      if (cudaHostRegister(static_cast<std::byte*>(host) + at, std::min(kChunk, mapped_ - at),
                           cudaHostRegisterPortable) != cudaSuccess) {
        cudaGetLastError();
        fail("cannot pin ", bytes >> 20, " MiB of host memory for a delta");
      }
    }
  }
  // Queues the copy of all its bytes to dst on stream s (after pin()).
  void copy_to(void* dst, cudaStream_t s) const {
    for (size_t at = 0; at < bytes; at += kChunk)
      BITDELTA_CUDA_CHECK(cudaMemcpyAsync(static_cast<std::byte*>(dst) + at, static_cast<const std::byte*>(host) + at,
                                          std::min(kChunk, bytes - at), cudaMemcpyHostToDevice, s));
  }

 private:
  size_t mapped_ = 0;
  size_t pinned_ = 0;  // chunks registered
};

// The host tier: pinned copies of recently loaded deltas under a byte budget, least recently used
// dropped first (never one that an upload is reading).
class HostTier {
 public:
  explicit HostTier(uint64_t budget) : budget_(budget) {}
  std::shared_ptr<PinnedPack> get(const std::string& key) {
    std::lock_guard lock(mutex_);
    for (auto it = lru_.begin(); it != lru_.end(); ++it)
      if (it->first == key) {
        lru_.splice(lru_.begin(), lru_, it);
        return it->second;
      }
    return nullptr;
  }
  void put(const std::string& key, std::shared_ptr<PinnedPack> pack) {
    std::lock_guard lock(mutex_);
    lru_.emplace_front(key, std::move(pack));
    uint64_t total = 0;
    for (auto& [_, p] : lru_) total += p->bytes;
    for (auto it = std::prev(lru_.end()); total > budget_ && it != lru_.begin();) {
      auto victim = it--;
      if (victim->second.use_count() > 1) continue;
      total -= victim->second->bytes;
      lru_.erase(victim);
    }
  }

 private:
  std::mutex mutex_;
  uint64_t budget_;
  std::list<std::pair<std::string, std::shared_ptr<PinnedPack>>> lru_;
};

// A delta file's identity for the host tier: path, size and modification time.
std::string file_key(const std::filesystem::path& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return "";
  return str(std::filesystem::absolute(path).string(), ':', st.st_size, ':', st.st_mtim.tv_sec, '.',
             st.st_mtim.tv_nsec);
}

}  // namespace

struct LinearOnDevice {
  const bf16* w = nullptr;
  DeltaRef delta;  // device pointers
};

class DeviceVariant {
 public:
  DeviceVariant() = default;
  DeviceVariant(const DeviceVariant&) = delete;  // owns its buffer
  DeviceVariant& operator=(const DeviceVariant&) = delete;
  std::shared_ptr<Context> ctx;
  void* buffer = nullptr;
  size_t bytes = 0;
  const bf16* embed = nullptr;
  const bf16* lm_head = nullptr;
  const float* norms = nullptr;
  const float* bias = nullptr;
  std::vector<std::array<LinearOnDevice, kLinearCount>> layers;
  // Per layer: q|k|v and gate|up as one matrix each (w == nullptr: its parts are not back to back).
  std::vector<std::array<LinearOnDevice, 2>> fused;
  ~DeviceVariant() {
    if (buffer) {
      cudaFreeAsync(buffer, ctx->stream);
      ctx->variant_bytes -= bytes;
    }
  }
};

class DeviceKV {
 public:
  DeviceKV() = default;
  DeviceKV(const DeviceKV&) = delete;  // owns its buffer
  DeviceKV& operator=(const DeviceKV&) = delete;
  std::shared_ptr<Context> ctx;
  bf16* data = nullptr;
  size_t capacity = 0;  // positions
  ~DeviceKV() {
    if (data) cudaFreeAsync(data, ctx->stream);
  }
};

namespace {

// One tensor a variant needs on the device: where it comes from on the host, and which pointer of
// the DeviceVariant it becomes.
struct Item {
  const void* src;
  DType src_dtype;
  size_t count;  // elements
  DType dst_dtype;
  const void** slot;
  size_t offset = 0;
  int pack_n = 0, pack_k = 0;  // sign bits of an [N, K] delta: packed on the device (pack_signs)
  size_t device_bytes() const {
    return pack_n ? packed_signs_bytes(pack_n, pack_k) : count * dtype_size(dst_dtype);
  }
};

// Writes one item's device bytes (converted to its device dtype) to dst.
void fill(const Item& it, void* dst) {
  if (it.src_dtype == it.dst_dtype) {
    std::memcpy(dst, it.src, it.count * dtype_size(it.dst_dtype));
    return;
  }
  std::vector<float> tmp(it.count);
  to_f32(it.src_dtype, static_cast<const std::byte*>(it.src), tmp.data(), it.count);
  from_f32(it.dst_dtype, tmp.data(), static_cast<std::byte*>(dst), it.count);
}

// Linears that read the same input, laid out back to back (weights, then signs, then α) so that
// one launch can run each group of several as one matrix: q|k|v and gate|up (DeviceVariant::fused).
constexpr int kGroups[4][3] = {{kQ, kK, kV}, {kO, -1, -1}, {kGate, kUp, -1}, {kDown, -1, -1}};
constexpr int kFusedGroups[2] = {0, 2};  // indices into kGroups

// The items of a variant, in a fixed order (so a cached pinned pack of the same file lines up):
// every tensor that differs from the base's (all of them for the base itself), its signs and α,
// then its norms and biases as float32 blocks (built into norms/bias). Shared tensors point at the
// base's device copy. Returns the total device bytes.

size_t plan(const ModelConfig& c, const VariantWeights& v, const VariantWeights* base, const DeviceVariant* base_dev,
            DeviceVariant& dv, std::vector<float>& norms, std::vector<float>& bias, std::deque<std::vector<float>>& alphas,
            std::vector<Item>& items) {
  const size_t H = c.hidden, L = c.layers, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  auto add = [&](const void* src, DType src_dtype, size_t count, DType dst_dtype, const void** slot) {
    items.push_back({src, src_dtype, count, dst_dtype, slot});
  };
  auto matrix = [&](const TensorView& t, const TensorView* shared_with, const bf16* shared_dev, const bf16** slot) {
    if (shared_with && t.data.data() == shared_with->data.data()) {
      *slot = shared_dev;
      return;
    }
    add(t.data.data(), t.dtype, t.numel(), DType::BF16, reinterpret_cast<const void**>(slot));
  };
  matrix(v.embed, base ? &base->embed : nullptr, base_dev ? base_dev->embed : nullptr, &dv.embed);
  if (c.tie_embeddings) {
    dv.lm_head = nullptr;  // set after upload: the same as embed
  } else {
    matrix(v.lm_head, base ? &base->lm_head : nullptr, base_dev ? base_dev->lm_head : nullptr, &dv.lm_head);
  }
  dv.layers.resize(L);
  for (size_t l = 0; l < L; ++l)
    for (const auto& group : kGroups) {
      for (int k : group) {
        if (k < 0) continue;
        matrix(v.layers[l].linear[size_t(k)], base ? &base->layers[l].linear[size_t(k)] : nullptr,
               base_dev ? base_dev->layers[l][size_t(k)].w : nullptr, &dv.layers[l][size_t(k)].w);
      }
      for (int k : group) {
        const DeltaRef& d = k < 0 ? DeltaRef{} : v.layers[l].delta[size_t(k)];
        if (!d.signs) continue;
        const Shape& s = v.layers[l].linear[size_t(k)].shape;
        add(d.signs, DType::U8, s[0] * ((s[1] + 7) / 8), DType::U8,
            reinterpret_cast<const void**>(&dv.layers[l][size_t(k)].delta.signs));
        items.back().pack_n = int(s[0]);
        items.back().pack_k = int(s[1]);
      }
      for (int k : group) {
        const DeltaRef& d = k < 0 ? DeltaRef{} : v.layers[l].delta[size_t(k)];
        if (!d.signs) continue;
        const size_t N = v.layers[l].linear[size_t(k)].shape[0];
        auto& lin = dv.layers[l][size_t(k)];
        lin.delta.alpha_per_row = true;  // one α per tensor is spread over its rows on the device
        const void* src = d.alpha;
        if (!d.alpha_per_row) {
          float a;
          std::memcpy(&a, d.alpha, 4);
          src = alphas.emplace_back(N, a).data();
        }
        add(src, DType::F32, N, DType::F32, reinterpret_cast<const void**>(&lin.delta.alpha));
      }
    }
  norms.assign((2 * L + 1) * H, 0.0f);
  for (size_t l = 0; l < L; ++l) {
    std::copy(v.layers[l].attn_norm.begin(), v.layers[l].attn_norm.end(), norms.begin() + long((2 * l) * H));
    std::copy(v.layers[l].mlp_norm.begin(), v.layers[l].mlp_norm.end(), norms.begin() + long((2 * l + 1) * H));
  }
  std::copy(v.final_norm.begin(), v.final_norm.end(), norms.begin() + long(2 * L * H));
  add(norms.data(), DType::F32, norms.size(), DType::F32, reinterpret_cast<const void**>(&dv.norms));
  if (c.qkv_bias || c.o_bias) {
    const size_t stride = q + 2 * kv + H;
    bias.assign(L * stride, 0.0f);
    const size_t at[4] = {0, q, q + kv, q + 2 * kv};
    for (size_t l = 0; l < L; ++l)
      for (int k = kQ; k <= kO; ++k) {
        const auto& b = v.layers[l].bias[size_t(k)];
        std::copy(b.begin(), b.end(), bias.begin() + long(l * stride + at[k]));
      }
    add(bias.data(), DType::F32, bias.size(), DType::F32, reinterpret_cast<const void**>(&dv.bias));
  }
  size_t total = 0;
  for (auto& it : items) {
    it.offset = total;
    total += align_up(it.device_bytes());
  }
  return total;
}

// Points the variant's slots into its device buffer, then finds the groups that can run fused: the
// parts' weights back to back and, with a delta, their signs and α too (v: the variant's shapes).
void bind_slots(DeviceVariant& dv, const std::vector<Item>& items, const VariantWeights& v, bool tied) {
  for (const auto& it : items) *it.slot = static_cast<const std::byte*>(dv.buffer) + it.offset;
  if (tied) dv.lm_head = dv.embed;
  dv.fused.assign(dv.layers.size(), {});
  for (size_t l = 0; l < dv.layers.size(); ++l) {
    const auto& L = dv.layers[l];
    for (size_t f = 0; f < 2; ++f) {
      const int* group = kGroups[kFusedGroups[f]];
      const bool with_delta = L[size_t(group[0])].delta.signs != nullptr;
      bool ok = true;
      for (int i = 1; i < 3 && group[i] >= 0; ++i) {
        const auto &a = L[size_t(group[i - 1])], &b = L[size_t(group[i])];
        const Shape& s = v.layers[l].linear[size_t(group[i - 1])].shape;  // [N, K] of part i − 1
        ok = ok && b.w == a.w + s[0] * s[1] && (b.delta.signs != nullptr) == with_delta;
        // Packed signs of parts with whole 16-row groups, back to back, are the packed signs of the group.
        if (with_delta)
          ok = ok && s[0] % 16 == 0 && b.delta.signs == a.delta.signs + packed_signs_bytes(int(s[0]), int(s[1])) &&
               b.delta.alpha == a.delta.alpha + s[0];
      }
      if (ok) dv.fused[l][f] = L[size_t(group[0])];
    }
  }
}

// The device buffer holds each sign item's file bytes at its offset (as the pinned pack does); this
// rewrites them in the packed layout the kernels read, through a scratch copy, on `stream`.
void pack_items(const std::vector<Item>& items, void* buffer, cudaStream_t stream) {
  size_t most = 0;
  for (const auto& it : items)
    if (it.pack_n) most = std::max(most, it.count);
  if (most == 0) return;
  auto* scratch = static_cast<uint8_t*>(device_alloc(most, stream, "a delta's sign bits while packing"));
  for (const auto& it : items) {
    if (!it.pack_n) continue;
    auto* at = static_cast<uint8_t*>(buffer) + it.offset;
    BITDELTA_CUDA_CHECK(cudaMemcpyAsync(scratch, at, it.count, cudaMemcpyDeviceToDevice, stream));
    pack_signs(scratch, it.pack_n, it.pack_k, at, stream);
  }
  BITDELTA_CUDA_CHECK(cudaFreeAsync(scratch, stream));
}

}  // namespace

struct DeviceModel::Impl {
  ModelConfig c;
  std::shared_ptr<Context> ctx = std::make_shared<Context>();
  std::vector<std::shared_ptr<DeviceVariant>> variants;  // by model id; [0] the base
  const VariantWeights* base_cpu = nullptr;  // the CPU model's base (shared tensors are its views)
  const DeviceVariant* base_dev = nullptr;   // == variants[0], read by uploads on other threads
  float* inv_freq = nullptr;
  std::unique_ptr<PrefillLinear> prefill;
  // Whether the streaming kernel takes every linear's K on this device (the device buffers are 256-byte
  // aligned, so its operands fit): decided once here rather than queried per linear call.
  bool streams = false;
  // Where the sm_90a GEMM does not run: whether the portable fused GEMM takes every linear's K.
  bool portable_gemm = false;
  // Rows of one weight (and delta) from which a GEMM takes them, on this device.
  size_t gemm_rows(bool with_delta, bool alone, int N = 0) const {
    return cuda::gemm_rows(with_delta, prefill->fused_available(), alone, streams, portable_gemm,
                           N);
  }
  mutable HostTier host_tier;
  std::string name;

  // Step scratch, grown on demand.
  size_t cap_rows = 0;
  std::byte* scratch = nullptr;
  float *x = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *gate = nullptr, *up = nullptr,
        *down = nullptr, *logits = nullptr;
  bf16 *h = nullptr, *attn = nullptr, *act = nullptr;
  RowDesc* rows_dev = nullptr;
  int* map_dev = nullptr;
  int2* tiles_dev = nullptr;
  // Pinned staging for the step's row descriptors and its logits.
  void* host_in = nullptr;
  size_t host_in_bytes = 0;
  float* host_logits = nullptr;
  size_t host_logits_elems = 0;

  // Decode steps replayed as CUDA graphs (forward). A step's launches are decided by its key: the
  // rows' variants in their sorted order, the rows that want logits, the attention tiles and split,
  // and (for all graphs together) the buffers they address: the step scratch (scratch_version), the
  // installed variants (variants_version) and stream_scratch's buffers. A graph is captured when a
  // step has the key of the step before it (a batch that stays, as decoding batches do) and replayed
  // while it is among the kStepGraphs most recently used.
  static constexpr size_t kStepGraphs = 8;
  struct StepGraph {
    std::vector<uintptr_t> key;
    cudaGraphExec_t exec = nullptr;
    uint64_t last_used = 0;
  };
  bool graphs_enabled = true;
  std::vector<StepGraph> step_graphs;
  std::vector<uintptr_t> last_key, failed_key;  // the step before's; one whose capture failed
  uint64_t scratch_version = 0, variants_version = 0, steps = 0;
  std::array<uint64_t, 3> graphs_made_at{};  // the versions the graphs were captured under
  GraphStats graph_stats;

  void drop_graphs() {
    for (auto& g : step_graphs) cudaGraphExecDestroy(g.exec);
    step_graphs.clear();
    last_key.clear();
    failed_key.clear();
  }

  // What the graphs' launches address besides the key: the step buffers, the variants, stream_scratch.
  std::array<uint64_t, 3> buffer_versions() const {
    return {scratch_version, variants_version, stream_scratch_generation()};
  }

  // Runs a step's launches (`issue`, on ctx->stream) under `key`: replays its graph if one is cached,
  // captures one if the step before had the same key, else launches them one by one.
  template <typename Issue>
  void launch_step(std::vector<uintptr_t> key, Issue&& issue) {
    const std::array<uint64_t, 3> version = buffer_versions();
    if (version != graphs_made_at) {
      drop_graphs();
      graphs_made_at = version;
    }
    ++steps;
    auto found = std::find_if(step_graphs.begin(), step_graphs.end(), [&](const auto& g) { return g.key == key; });
    if (found != step_graphs.end()) {
      found->last_used = steps;
      BITDELTA_CUDA_CHECK(cudaGraphLaunch(found->exec, ctx->stream));
      ++graph_stats.replayed;
    } else if (key == last_key && key != failed_key) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      bool captured = false;
      BITDELTA_CUDA_CHECK(cudaStreamBeginCapture(ctx->stream, cudaStreamCaptureModeRelaxed));
      try {
        issue();
        captured = true;
      } catch (...) {  // (ends the capture below, then runs launched: an error there is thrown)
      }
      const cudaError_t ended = cudaStreamEndCapture(ctx->stream, &graph);
      if (captured && ended == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess &&
          buffer_versions() == version) {
        if (step_graphs.size() == kStepGraphs) {  // the least recently used goes
          auto lru = std::min_element(step_graphs.begin(), step_graphs.end(),
                                      [](const auto& x, const auto& y) { return x.last_used < y.last_used; });
          cudaGraphExecDestroy(lru->exec);
          step_graphs.erase(lru);
        }
        step_graphs.push_back({key, exec, steps});
        BITDELTA_CUDA_CHECK(cudaGraphLaunch(exec, ctx->stream));
        ++graph_stats.captured;
      } else {
        if (exec) cudaGraphExecDestroy(exec);
        (void)cudaGetLastError();
        failed_key = key;
        issue();
      }
      if (graph) cudaGraphDestroy(graph);
    } else {
      issue();
    }
    last_key = std::move(key);
  }

  Impl(const ModelConfig& config, const DeviceOptions& o)
      : c(config), host_tier(o.host_cache_bytes), graphs_enabled(o.graphs) {}
  ~Impl() {
    if (ctx->stream) cudaStreamSynchronize(ctx->stream);
    drop_graphs();
    variants.clear();
    prefill.reset();
    if (scratch) cudaFreeAsync(scratch, ctx->stream);
    if (inv_freq) cudaFreeAsync(inv_freq, ctx->stream);
    if (ctx->stream) cudaStreamSynchronize(ctx->stream);
    if (host_in) cudaFreeHost(host_in);
    if (host_logits) cudaFreeHost(host_logits);
  }

  void ensure_scratch(size_t rows) {
    if (rows <= cap_rows) return;
    const size_t R = std::max(rows, cap_rows * 2), H = c.hidden, I = c.intermediate;
    const size_t qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim, V = c.vocab_size;
    const size_t sizes[] = {R * H * 4,  R * (qd + 2 * kvd) * 4, R * kvd * 4, R * kvd * 4, R * H * 4,
                            R * 2 * I * 4,  R * I * 4,  R * H * 4,   R * V * 4,   R * std::max({H, qd}) * 2,
                            R * qd * 2, R * I * 2,  R * sizeof(RowDesc), R * 4, R * sizeof(int2)};
    size_t total = 0;
    for (size_t s : sizes) total += align_up(s);
    if (scratch) cudaFreeAsync(scratch, ctx->stream);
    scratch = static_cast<std::byte*>(device_alloc(total, ctx->stream, "step activations"));
    ++scratch_version;
    std::byte* p = scratch;
    auto take = [&](size_t s) {
      std::byte* r = p;
      p += align_up(s);
      return r;
    };
    x = reinterpret_cast<float*>(take(sizes[0]));
    q = reinterpret_cast<float*>(take(sizes[1]));
    k = reinterpret_cast<float*>(take(sizes[2]));
    v = reinterpret_cast<float*>(take(sizes[3]));
    o = reinterpret_cast<float*>(take(sizes[4]));
    gate = reinterpret_cast<float*>(take(sizes[5]));
    up = reinterpret_cast<float*>(take(sizes[6]));
    down = reinterpret_cast<float*>(take(sizes[7]));
    logits = reinterpret_cast<float*>(take(sizes[8]));
    h = reinterpret_cast<bf16*>(take(sizes[9]));
    attn = reinterpret_cast<bf16*>(take(sizes[10]));
    act = reinterpret_cast<bf16*>(take(sizes[11]));
    rows_dev = reinterpret_cast<RowDesc*>(take(sizes[12]));
    map_dev = reinterpret_cast<int*>(take(sizes[13]));
    tiles_dev = reinterpret_cast<int2*>(take(sizes[14]));
    cap_rows = R;
    const size_t in_bytes = R * (sizeof(RowDesc) + 4 + sizeof(int2)) + 8;
    if (in_bytes > host_in_bytes) {
      BITDELTA_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
      if (host_in) cudaFreeHost(host_in);
      BITDELTA_CUDA_CHECK(cudaHostAlloc(&host_in, in_bytes, cudaHostAllocDefault));
      host_in_bytes = in_bytes;
    }
  }

  // y[rows, N] = x[rows, K] · W_effᵀ for rows that each name their weight and delta. Consecutive
  // rows with the same weight form a segment; inside it a variant with ≥ gemm_rows() rows goes
  // through a GEMM (cuBLAS for the base, the fused GEMM for a delta), the others through the fused decode
  // kernel, up to 32 rows (of any variants) per call, which reads the base once per launch (the
  // streaming kernel takes all 32 in one; elsewhere, the register kernel takes fewer than
  // kDeltaTermsRows). From kDeltaTermsRows rows with a delta among them, one launch takes the base
  // of all of them (the streaming kernel with no delta where it runs, else cuBLAS) and, beside it on
  // the side stream, launches of up to 32 rows the delta terms.
  // Those terms go to a buffer of their own, [rows, N], zeros but for the gathered rows. With
  // `terms` the caller takes it apart (*terms, or null where no row took that route) and the kernel
  // that consumes y adds it as it reads y; without, y += it here (ops.cuh add_to). The buffer is
  // the step's until the next linear.
  void linear(const std::vector<const LinearOnDevice*>& lin, const bf16* xin, int K, float* y, int N,
              const float** terms = nullptr) {
    const size_t R = lin.size();
    std::vector<DeltaRef> deltas;
    float* t = nullptr;  // the delta terms' buffer, once the side stream is forked
    size_t t_lo = R, t_hi = 0;  // the rows it may hold terms of
    for (size_t a = 0; a < R;) {
      auto same_weight = [&](size_t i) { return lin[i]->w == lin[a]->w; };
      auto run_end = [&](size_t i) {  // end of the run of rows with row i's weight and signs
        size_t e = i;
        while (e < R && lin[e]->w == lin[i]->w && lin[e]->delta.signs == lin[i]->delta.signs) ++e;
        return e;
      };
      const size_t e = run_end(a);
      const bool alone = (a == 0 || !same_weight(a - 1)) && (e == R || !same_weight(e));  // the whole segment
      if (alone && lin[a]->delta.signs && e - a >= kWeffRows && e - a <= kDecodeRows &&
          (streams || !portable_gemm || e - a < gemm_rows(true, true, N))) {
        // One variant: W_eff formed in the streaming kernel's stages, or elsewhere in the register
        // kernel's registers (below the portable GEMM's rows); all the rows in one launch.
        deltas.assign(e - a, lin[a]->delta);
        DecodeOptions o;
        o.form_weights = true;
        fused_linear_decode(lin[a]->w, N, K, xin + a * size_t(K), int(e - a), deltas, y + a * size_t(N), ctx->stream, o);
        a = e;
        continue;
      }
      if (e - a >= gemm_rows(lin[a]->delta.signs, alone, N)) {
        const auto method = lin[a]->delta.signs ? PrefillMethod::kFused : PrefillMethod::kBaseOnly;
        prefill->run(method, lin[a]->w, N, K, xin + a * size_t(K), int(e - a), lin[a]->delta, y + a * size_t(N));
        a = e;
        continue;
      }
      // Small runs: the rows of this weight up to the next run that takes a GEMM (the runs that
      // take one are sorted first, so these are usually the rest of the step).
      size_t b = a;
      while (b < R && same_weight(b)) {
        const size_t re = run_end(b);
        if (re - b >= gemm_rows(lin[b]->delta.signs, false)) break;
        b = re;
      }
      bool any_delta = false;
      for (size_t i = a; i < b; ++i) any_delta = any_delta || lin[i]->delta.signs != nullptr;
      // (Rows of the base alone keep the streaming kernel where it runs; elsewhere the GEMM alone.)
      if (b - a >= kDeltaTermsRows && (any_delta || !streams)) {
        // The base of all of them in one launch (W read once), and beside it, on the side stream,
        // their delta terms into the buffer above by launches of up to 32 rows that each read their
        // variants' signs once, not W (delta_terms_beside.cuh); y and the terms meet after both
        // (above). Without the streaming kernel, against the register kernel: each of its
        // launches of 16 rows reads W again, and its delta slots are latency-bound (NOTES.md, parts
        // 29 and 33). With it, against its one launch of up to 32 rows (above, kDeltaTermsRows).
        // Side by side the base's reads of W and the terms' of the signs overlap:
        // the 7B mixed step of 14 variants against the GEMM and then the terms on one stream (run
        // 340, alternated twice, NOTES.md part 40): compute_80 build batch 8 7.46 / 7.50 → 6.78 /
        // 6.74 ms, 16 9.96 / 9.92 → 9.14 / 9.16, 32 12.22 / 12.00 → 11.57 / 11.46; normal build
        // batch 48 15.97 / 15.45 → 15.09 / 15.24, 64 19.22 / 18.89 → 18.96 / 18.73. The terms are
        // written alone, then added to y: fl(base + fl(α·t)), where on one stream base + α·t could be
        // one fused multiply-add (the same bound either way: the GPU tests).
        if (any_delta) {
          if (!t) {
            t = static_cast<float*>(stream_scratch(ScratchUse::kDeltaTerms, ctx->stream, R * size_t(N) * sizeof(float)));
            ctx->beside->fork(ctx->stream, t, R * size_t(N));
          }
          deltas.clear();
          for (size_t i = a; i < b; ++i) deltas.push_back(lin[i]->delta);
          ctx->beside->add_terms(lin[a]->w, N, K, xin + a * size_t(K), int(b - a), deltas, t + a * size_t(N));
          t_lo = std::min(t_lo, a), t_hi = std::max(t_hi, b);
        }
        // The base: where the streaming kernel runs, it with no delta (up to 32 rows), else cuBLAS. The
        // 7B mixed step of 14 variants (run 382, H100, 4 rounds alternated, medians), cuBLAS against
        // the streaming kernel: batch 4 7.445 → 6.89 ms, 8 8.70 → 8.40, 16 11.565 → 11.195, 32 13.85 →
        // 13.72. It runs on its own grid: on half or three quarters of the multiprocessors, leaving the
        // rest to the terms (the two kernels can't share one: run 378), it was 3-7% slower at batch 4,
        // level to 1.3% slower at 8 and 16, 1% faster at 32 (bench/cuda/NOTES.md, part 56).
        if (streams && b - a <= kDecodeRows) {
          deltas.assign(b - a, DeltaRef{});
          DecodeOptions o;
          o.kernel = DecodeKernel::kStream;
          fused_linear_decode(lin[a]->w, N, K, xin + a * size_t(K), int(b - a), deltas, y + a * size_t(N), ctx->stream,
                              o);
        } else {
          prefill->run(PrefillMethod::kBaseOnly, lin[a]->w, N, K, xin + a * size_t(K), int(b - a), DeltaRef{},
                       y + a * size_t(N));
        }
        a = b;
        continue;
      }
      // Else up to 32 of them in one decode call, which reads W once.
      b = std::min(b, a + kDecodeRows);
      deltas.clear();
      for (size_t i = a; i < b; ++i) deltas.push_back(lin[i]->delta);
      fused_linear_decode(lin[a]->w, N, K, xin + a * size_t(K), int(b - a), deltas, y + a * size_t(N), ctx->stream);
      a = b;
    }
    if (t) ctx->beside->join(ctx->stream);
    if (terms)
      *terms = t;
    else if (t)
      add_to(y + t_lo * size_t(N), t + t_lo * size_t(N), (t_hi - t_lo) * size_t(N), ctx->stream);
  }
};

DeviceModel::DeviceModel(const ModelConfig& config, const VariantWeights& base, std::span<const float> inv_freq,
                         const DeviceOptions& options)
    : impl_(std::make_unique<Impl>(config, options)) {
  auto& m = *impl_;
  if (const std::string why = unavailable_reason(); !why.empty()) fail("--device cuda: ", why);
  int count = 0;
  BITDELTA_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (options.device < 0 || options.device >= count)
    fail("--device cuda:", options.device, ": only ", count, " CUDA device(s)");
  m.ctx->device = options.device;
  BITDELTA_CUDA_CHECK(cudaSetDevice(options.device));
  cudaDeviceProp prop{};
  BITDELTA_CUDA_CHECK(cudaGetDeviceProperties(&prop, options.device));
  m.name = prop.name;
  if (config.head_dim > 256 || config.head_dim % 8)
    fail("--device cuda: head_dim ", config.head_dim, " unsupported (a multiple of 8, at most 256)");
  if (config.hidden > kMaxHidden)
    fail("--device cuda: hidden ", config.hidden, " unsupported (at most ", kMaxHidden, ")");
  // Freed stream-ordered memory stays in the pool: steps and loads re-allocate without the driver.
  cudaMemPool_t pool;
  BITDELTA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, options.device));
  uint64_t threshold = UINT64_MAX;
  BITDELTA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  BITDELTA_CUDA_CHECK(cudaStreamCreateWithFlags(&m.ctx->stream, cudaStreamNonBlocking));
  m.ctx->beside = std::make_unique<DeltaTermsBeside>();
  m.prefill = std::make_unique<PrefillLinear>(m.ctx->stream, kPrefillScratch);
  {
    const auto* aligned = reinterpret_cast<const bf16*>(uintptr_t(kAlign));  // not dereferenced
    m.streams = true;
    m.portable_gemm = !m.prefill->fused_available();
    for (const uint64_t K : {config.hidden, config.intermediate, uint64_t(config.heads) * config.head_dim}) {
      m.streams = m.streams && stream_kernel_supports(aligned, int(K), aligned);
      m.portable_gemm = m.portable_gemm && mma_gemm_supported(aligned, int(K), aligned, DeltaRef{});
    }
  }
  m.inv_freq = static_cast<float*>(device_alloc(inv_freq.size_bytes(), m.ctx->stream, "rotary frequencies"));
  BITDELTA_CUDA_CHECK(
      cudaMemcpyAsync(m.inv_freq, inv_freq.data(), inv_freq.size_bytes(), cudaMemcpyHostToDevice, m.ctx->stream));

  // The base: every tensor, copied item by item (converted to bf16 where the checkpoint is not).
  auto dv = std::make_shared<DeviceVariant>();
  dv->ctx = m.ctx;
  std::vector<float> norms, bias;
  std::deque<std::vector<float>> alphas;
  std::vector<Item> items;
  dv->bytes = plan(config, base, nullptr, nullptr, *dv, norms, bias, alphas, items);
  dv->buffer = device_alloc(dv->bytes, m.ctx->stream, "the base weights");
  m.ctx->variant_bytes += dv->bytes;
  std::vector<std::byte> tmp;
  for (const auto& it : items) {
    std::byte* dst = static_cast<std::byte*>(dv->buffer) + it.offset;
    const size_t n = it.count * dtype_size(it.dst_dtype);
    if (it.src_dtype == it.dst_dtype) {
      BITDELTA_CUDA_CHECK(cudaMemcpyAsync(dst, it.src, n, cudaMemcpyHostToDevice, m.ctx->stream));
    } else {
      BITDELTA_CUDA_CHECK(cudaStreamSynchronize(m.ctx->stream));
      tmp.resize(n);
      fill(it, tmp.data());
      BITDELTA_CUDA_CHECK(cudaMemcpyAsync(dst, tmp.data(), n, cudaMemcpyHostToDevice, m.ctx->stream));
    }
  }
  pack_items(items, dv->buffer, m.ctx->stream);
  BITDELTA_CUDA_CHECK(cudaStreamSynchronize(m.ctx->stream));
  bind_slots(*dv, items, base, config.tie_embeddings);
  m.variants.push_back(dv);
  m.base_cpu = &base;
  m.base_dev = dv.get();
}

DeviceModel::~DeviceModel() = default;

std::string DeviceModel::device_name() const { return impl_->name; }

std::shared_ptr<DeviceVariant> DeviceModel::upload(const VariantWeights& weights, const DeltaFile& delta,
                                                   UploadStats* stats) const {
  auto& m = *impl_;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  BITDELTA_CUDA_CHECK(cudaSetDevice(m.ctx->device));
  auto dv = std::make_shared<DeviceVariant>();
  dv->ctx = m.ctx;
  std::vector<float> norms, bias;
  std::deque<std::vector<float>> alphas;
  std::vector<Item> items;
  dv->bytes = plan(m.c, weights, m.base_cpu, m.base_dev, *dv, norms, bias, alphas, items);
  // Host tier: the pinned copy of this file's device bytes, or a new one read from the file.
  const std::string key = file_key(delta.path());
  std::shared_ptr<PinnedPack> pack = key.empty() ? nullptr : m.host_tier.get(key);
  const bool hit = pack && pack->bytes == dv->bytes;
  if (!hit) {
    // This thread pages the file in front to back while a second fills the new buffer, item by item
    // in file order, each as soon as its bytes are in, and a third pins the buffer's pages: the
    // fill and the pinning run behind the disk instead of after it. Allocating beside the read
    // (part 28) took a 7B delta's load from 0.87-0.91 s to 0.53-0.57 s against a disk read of
    // 0.49-0.51 s; pinning beside the fill, from 0.564-0.629 s to 0.520-0.547 s against floors (disk
    // read + host->device) of 0.50-0.60 s: the file's paging-in is now the load (run 389, an H100).
    const auto file = delta.file().mapped_bytes();
    SequentialPager pager(file);
    std::vector<const Item*> order;
    for (const auto& it : items) order.push_back(&it);
    std::sort(order.begin(), order.end(), [](const Item* a, const Item* b) {
      return reinterpret_cast<uintptr_t>(a->src) < reinterpret_cast<uintptr_t>(b->src);
    });
    auto p = std::make_shared<PinnedPack>(dv->bytes);
    double pin_s = 0;
    auto pinned = std::async(std::launch::async, [&, dev = m.ctx->device] {
      BITDELTA_CUDA_CHECK(cudaSetDevice(dev));
      const auto tp = Clock::now();
      p->pin();
      pin_s = std::chrono::duration<double>(Clock::now() - tp).count();
    });
    auto filled = std::async(std::launch::async, [&] {
      try {
        for (const Item* it : order) {
          pager.wait_for(it->src, it->count * dtype_size(it->src_dtype));
          fill(*it, static_cast<std::byte*>(p->host) + it->offset);
        }
      } catch (...) {
        pager.stop();  // nothing more to read for
        throw;
      }
    });
    pager.run();
    const double page_s = std::chrono::duration<double>(Clock::now() - t0).count();
    filled.get();  // if it throws, pinned's destructor still waits for the pinning thread
    pinned.get();
    pack = std::move(p);
    if (stats) stats->page_s = page_s, stats->pin_s = pin_s;
  }
  const auto t1 = Clock::now();
  // Device tier: its own stream, so the steps of other variants go on meanwhile.
  cudaStream_t s = nullptr;
  BITDELTA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  try {
    dv->buffer = device_alloc(dv->bytes, s, "a variant's delta");
    pack->copy_to(dv->buffer, s);
    pack_items(items, dv->buffer, s);
    BITDELTA_CUDA_CHECK(cudaStreamSynchronize(s));
  } catch (...) {
    if (dv->buffer) cudaFreeAsync(dv->buffer, s), dv->buffer = nullptr;
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    throw;
  }
  cudaStreamDestroy(s);
  m.ctx->variant_bytes += dv->bytes;
  bind_slots(*dv, items, weights, m.c.tie_embeddings);
  if (!hit && !key.empty()) m.host_tier.put(key, pack);
  if (stats) {
    stats->bytes = dv->bytes;
    stats->host_hit = hit;
    stats->read_s = std::chrono::duration<double>(t1 - t0).count();
    stats->copy_s = std::chrono::duration<double>(Clock::now() - t1).count();
  }
  return dv;
}

void DeviceModel::install(int id, std::shared_ptr<DeviceVariant> variant) {
  auto& vs = impl_->variants;
  if (id < 1) fail("cuda::DeviceModel::install: bad variant id ", id);
  if (size_t(id) >= vs.size()) vs.resize(size_t(id) + 1);
  vs[size_t(id)] = std::move(variant);
  ++impl_->variants_version;
}

void DeviceModel::remove(int id) {
  auto& vs = impl_->variants;
  if (id > 0 && size_t(id) < vs.size()) vs[size_t(id)].reset();
  ++impl_->variants_version;
}

GraphStats DeviceModel::graph_stats() const { return impl_->graph_stats; }

DeviceMemory DeviceModel::memory() const {
  const auto& ctx = *impl_->ctx;
  DeviceMemory m;
  m.base_bytes = impl_->variants[0]->bytes;
  m.variant_bytes = ctx.variant_bytes - m.base_bytes;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
    m.device_used = total_b - free_b;
    m.device_total = total_b;
  }
  return m;
}

uint64_t DeviceModel::kv_bytes(const DeviceKV& kv) const {
  // Each layer's keys and values for `capacity` positions (as forward lays them out).
  const auto& c = impl_->c;
  return uint64_t(kv.capacity) * c.layers * 2 * c.kv_heads * c.head_dim * sizeof(bf16);
}

std::shared_ptr<DeviceKV> DeviceModel::clone_kv(const DeviceKV& kv, size_t length) const {
  const auto& m = *impl_;
  const auto& c = m.c;
  BITDELTA_CUDA_CHECK(cudaSetDevice(m.ctx->device));
  auto copy = std::make_shared<DeviceKV>();
  copy->ctx = m.ctx;
  copy->data =
      static_cast<bf16*>(device_alloc(kv_bytes(kv), m.ctx->stream, "a sequence's KV cache"));
  copy->capacity = kv.capacity;
  // Each layer's keys and values (forward's layout: 2·layers runs of `capacity` positions): their
  // first `length` positions only, the rest of the copy left for the sequence to write.
  length = std::min(length, kv.capacity);
  const size_t row_bytes = size_t(c.kv_heads) * c.head_dim * sizeof(bf16);
  if (length > 0)
    BITDELTA_CUDA_CHECK(cudaMemcpy2DAsync(
        copy->data, kv.capacity * row_bytes, kv.data, kv.capacity * row_bytes, length * row_bytes,
        size_t(c.layers) * 2, cudaMemcpyDeviceToDevice, m.ctx->stream));
  return copy;
}

std::vector<float> DeviceModel::forward(std::span<const DeviceRow> in) {
  auto& m = *impl_;
  const auto& c = m.c;
  const size_t R = in.size();
  if (R == 0) return {};
  BITDELTA_CUDA_CHECK(cudaSetDevice(m.ctx->device));
  const int H = int(c.hidden), I = int(c.intermediate), L = int(c.layers), hd = int(c.head_dim);
  const int heads = int(c.heads), kvh = int(c.kv_heads), qd = heads * hd, kvd = kvh * hd, V = int(c.vocab_size);

  // Rows sorted by variant, the variants with many rows first (they take GEMMs), stable so that a
  // sequence's rows keep their order.
  std::vector<size_t> count(m.variants.size(), 0);
  for (const auto& r : in) {
    if (r.variant < 0 || size_t(r.variant) >= m.variants.size() || !m.variants[size_t(r.variant)])
      fail("cuda: no variant with id ", r.variant, " on the device");
    ++count[size_t(r.variant)];
  }
  std::vector<size_t> order(R);
  std::iota(order.begin(), order.end(), 0);
  auto key = [&](size_t r) {
    const size_t v = size_t(in[r].variant);
    const bool alone = count[v] == R;
    return std::pair<int, size_t>(count[v] >= m.gemm_rows(v != 0, alone) ? 0 : 1, v);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });

  // KV caches: created or grown (doubling; the valid prefix copied) to hold every row's position.
  std::map<std::shared_ptr<DeviceKV>*, size_t> need;
  for (const auto& r : in) need[r.kv] = std::max(need[r.kv], r.position + 1);
  const size_t per_pos = size_t(L) * 2 * kvd * sizeof(bf16), row_bytes = size_t(kvd) * sizeof(bf16);
  for (auto& [slot, n] : need) {
    auto& kv = *slot;
    if (kv && kv->capacity >= n) continue;
    // Doubling, but never past the model's context length (a sequence cannot grow beyond it).
    const size_t cap = std::max(n, std::min<size_t>(std::max<size_t>(kv ? 2 * kv->capacity : 0, 16), c.max_position));
    auto fresh = std::make_shared<DeviceKV>();
    fresh->ctx = m.ctx;
    fresh->data = static_cast<bf16*>(device_alloc(cap * per_pos, m.ctx->stream, "a sequence's KV cache"));
    fresh->capacity = cap;
    if (kv)  // each layer's keys and values: the old capacity's rows to the start of the new one's
      BITDELTA_CUDA_CHECK(cudaMemcpy2DAsync(fresh->data, cap * row_bytes, kv->data, kv->capacity * row_bytes,
                                            kv->capacity * row_bytes, size_t(L) * 2, cudaMemcpyDeviceToDevice,
                                            m.ctx->stream));
    kv = fresh;
  }

  m.ensure_scratch(R);
  // Row descriptors (sorted order) and the rows that want logits.
  auto* desc = static_cast<RowDesc*>(m.host_in);
  auto* map = reinterpret_cast<int*>(desc + R);
  std::vector<const DeviceVariant*> var(R);
  std::vector<size_t> want_sorted;  // sorted positions of rows that want logits
  for (size_t i = 0; i < R; ++i) {
    const DeviceRow& r = in[order[i]];
    var[i] = m.variants[size_t(r.variant)].get();
    desc[i] = {r.token, int32_t(r.position), int32_t((*r.kv)->capacity), (*r.kv)->data, var[i]->embed, var[i]->norms,
               var[i]->bias};
    if (r.want_logits) want_sorted.push_back(i);
  }
  const size_t W = want_sorted.size();
  for (size_t j = 0; j < W; ++j) map[j] = int(want_sorted[j]);
  // Attention: runs of rows of one sequence at consecutive positions. Runs of kPromptRunRows or more
  // (prompts) go to attention_prompt (GEMMs on the tensor cores); the others are cut into tiles of up
  // to kAttnTile rows for the attention kernels.
  auto* tiles = reinterpret_cast<int2*>(map + R + (R & 1));  // 8-byte aligned
  int n_tiles = 0, max_tile = 0, max_position = 0;
  std::vector<int2> prompt_runs;  // (first row, rows)
  for (size_t i = 0; i < R;) {
    size_t e = i + 1;
    while (e < R && desc[e].kv == desc[i].kv && desc[e].position == desc[e - 1].position + 1) ++e;
    if (e - i >= size_t(kPromptRunRows)) {
      prompt_runs.push_back(make_int2(int(i), int(e - i)));
    } else {
      for (size_t t = i; t < e; t += kAttnTile) {
        const int rows_t = int(std::min(e - t, size_t(kAttnTile)));
        tiles[n_tiles++] = make_int2(int(t), rows_t);
        max_tile = std::max(max_tile, rows_t);
        max_position = std::max(max_position, int(desc[t + size_t(rows_t) - 1].position));
      }
    }
    i = e;
  }
  BITDELTA_CUDA_CHECK(
      cudaMemcpyAsync(m.rows_dev, desc, R * sizeof(RowDesc), cudaMemcpyHostToDevice, m.ctx->stream));
  BITDELTA_CUDA_CHECK(
      cudaMemcpyAsync(m.tiles_dev, tiles, size_t(n_tiles) * sizeof(int2), cudaMemcpyHostToDevice, m.ctx->stream));
  if (W > 0) BITDELTA_CUDA_CHECK(cudaMemcpyAsync(m.map_dev, map, W * 4, cudaMemcpyHostToDevice, m.ctx->stream));

  std::vector<const LinearOnDevice*> lin(R);
  // A linear whose output one kernel consumes takes its delta terms apart (terms: Impl::linear),
  // for that kernel to add; the rest have them added to their output. Against add_to after each
  // join, the 7B mixed step (run 343, alternated twice, NOTES.md part 41): normal build batch 8
  // 6.45 / 6.51 → 6.38 / 6.35 ms, 64 19.15 / 19.10 → 18.52 / 18.57, 32 level; compute_80 build
  // batch 8 6.68 / 6.81 → 6.48 / 6.50, 32 11.63 / 11.73 → 11.43 / 11.38.
  auto linear = [&](int layer, int kind, const bf16* xin, int K, float* y, int N, const float** terms = nullptr) {
    for (size_t i = 0; i < R; ++i) lin[i] = &var[i]->layers[size_t(layer)][size_t(kind)];
    m.linear(lin, xin, K, y, N, terms);
  };
  // q|k|v (fused group 0) or gate|up (1) as one launch when every row's variant has it fused.
  auto fused_linear = [&](int layer, int group, const bf16* xin, int K, float* y, int N, const float** terms) {
    *terms = nullptr;
    for (size_t i = 0; i < R; ++i) {
      lin[i] = &var[i]->fused[size_t(layer)][size_t(group)];
      if (!lin[i]->w) return false;
    }
    m.linear(lin, xin, K, y, N, terms);
    return true;
  };
  const float eps = float(c.rms_eps), scale = 1.0f / std::sqrt(float(hd));
  const int bias_stride = qd + 2 * kvd + H;
  cudaStream_t s = m.ctx->stream;
  // The step's launches (after the copies above, which every step makes).
  const auto issue = [&] {
    embed_rows(m.rows_dev, int(R), H, m.x, s);
    const float* terms = nullptr;  // the delta terms of the last linear, for its consumer
    for (int l = 0; l < L; ++l) {
      add_rmsnorm(m.x, l ? m.down : nullptr, m.rows_dev, nullptr, int(R), H, 2 * l * H, -1, eps, m.h, s, terms);
      if (fused_linear(l, 0, m.h, H, m.q, qd + 2 * kvd, &terms)) {
        bias_rope_store(m.q, m.q + qd, m.q + qd + kvd, qd + 2 * kvd, qd + 2 * kvd, m.rows_dev, int(R), l, heads, kvh,
                        hd, H, m.inv_freq, s, terms);
        attention(m.q, qd + 2 * kvd, m.rows_dev, m.tiles_dev, n_tiles, max_tile, max_position, l, heads, kvh, hd, scale, m.attn, s);
        for (const int2 run : prompt_runs)
          attention_prompt(m.prefill->handle(), m.q, qd + 2 * kvd, desc[run.x], run.x, run.y, l, heads, kvh, hd, scale,
                           m.attn, s);
      } else {
        linear(l, kQ, m.h, H, m.q, qd);
        linear(l, kK, m.h, H, m.k, kvd);
        linear(l, kV, m.h, H, m.v, kvd);
        bias_rope_store(m.q, m.k, m.v, qd, kvd, m.rows_dev, int(R), l, heads, kvh, hd, H, m.inv_freq, s);
        attention(m.q, qd, m.rows_dev, m.tiles_dev, n_tiles, max_tile, max_position, l, heads, kvh, hd, scale, m.attn, s);
        for (const int2 run : prompt_runs)
          attention_prompt(m.prefill->handle(), m.q, qd, desc[run.x], run.x, run.y, l, heads, kvh, hd, scale, m.attn, s);
      }
      linear(l, kO, m.attn, qd, m.o, H, &terms);
      add_rmsnorm(m.x, m.o, m.rows_dev, nullptr, int(R), H, (2 * l + 1) * H,
                  c.o_bias ? l * bias_stride + qd + 2 * kvd : -1, eps, m.h, s, terms);
      if (fused_linear(l, 1, m.h, H, m.gate, 2 * I, &terms)) {
        swiglu(m.gate, m.gate + I, 2 * I, int(R), I, m.act, s, terms);
      } else {
        linear(l, kGate, m.h, H, m.gate, I);
        linear(l, kUp, m.h, H, m.up, I);
        swiglu(m.gate, m.up, I, int(R), I, m.act, s);
      }
      linear(l, kDown, m.act, I, m.down, H, &terms);
    }
    if (W > 0) {
      add_rmsnorm(m.x, m.down, m.rows_dev, m.map_dev, int(W), H, 2 * L * H, -1, eps, m.h, s, terms);
      std::vector<LinearOnDevice> heads_lin(W);
      std::vector<const LinearOnDevice*> hl(W);
      for (size_t j = 0; j < W; ++j) {
        heads_lin[j].w = var[want_sorted[j]]->lm_head;
        hl[j] = &heads_lin[j];
      }
      m.linear(hl, m.h, H, m.logits, V);
    }
  };
  if (m.graphs_enabled && prompt_runs.empty()) {
    // The key of this step's launches (see Impl): rows, tiles and attention split, each row's variant,
    // the rows that want logits.
    std::vector<uintptr_t> key{R, W, uintptr_t(n_tiles), uintptr_t(max_tile)};
    for (int v : attention_shape(n_tiles, max_tile, max_position, heads, kvh, hd)) key.push_back(uintptr_t(v));
    for (const DeviceVariant* v : var) key.push_back(reinterpret_cast<uintptr_t>(v));
    for (size_t j : want_sorted) key.push_back(j);
    m.launch_step(std::move(key), issue);
  } else {
    issue();
  }
  std::vector<float> out;
  if (W > 0) {
    if (W * size_t(V) > m.host_logits_elems) {
      BITDELTA_CUDA_CHECK(cudaStreamSynchronize(s));
      if (m.host_logits) cudaFreeHost(m.host_logits);
      m.host_logits = nullptr;
      BITDELTA_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&m.host_logits), W * size_t(V) * 4, 0));
      m.host_logits_elems = W * size_t(V);
    }
    BITDELTA_CUDA_CHECK(
        cudaMemcpyAsync(m.host_logits, m.logits, W * size_t(V) * 4, cudaMemcpyDeviceToHost, s));
    BITDELTA_CUDA_CHECK(cudaStreamSynchronize(s));
    // Back to the callers' row order.
    std::vector<size_t> rank(R, 0);
    for (size_t j = 0; j < W; ++j) rank[order[want_sorted[j]]] = j + 1;
    out.resize(W * size_t(V));
    size_t next = 0;
    for (size_t r = 0; r < R; ++r)
      if (rank[r]) std::memcpy(&out[next++ * size_t(V)], &m.host_logits[(rank[r] - 1) * size_t(V)], size_t(V) * 4);
  } else {
    BITDELTA_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return out;
}

}  // namespace bitdelta::cuda
