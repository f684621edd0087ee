// End to end on a CUDA device (issue 6): a synthetic model (make_synthetic: DIR/base and
// DIR/deltas/v*.bitdelta) served with its variants mixed.
//   bench_gpu_e2e DIR [--prompt 512] [--decode 32] [--batch 32] [--requests 20] [--graphs 1] [--out FILE.json]
// (--batch takes a list too, 4,8,16,32: the batch-B cases of 4. for each, in one process.)
// Measures, in this order:
//   1. the device's copy bandwidth (the roofline), host→device bandwidth from pinned memory, and
//      the disk's read speed (a delta file dropped from the page cache, then read);
//   2. the cold load of one delta (dropped from the page cache): file → pinned → device, then the
//      same delta again from the pinned host tier;
//   3. GPU memory with the base and every variant resident, against full copies;
//   4. decode tokens/s: batch 1 (base, one variant), batch B (base alone; all variants mixed),
//      after prompts of `prompt` tokens; bytes per step against the copy-bandwidth roofline;
//   5. TTFT p50/p99 per variant and for the base through the engine, one request at a time.
// --graphs 0 launches every decode step's kernels one by one (ModelOptions::cuda_graphs); by default
// a step whose batch is the step before's is captured as a CUDA graph and replayed after.
// --profile-case NAME runs only the decode cases whose name contains NAME (then stops), with their
// fourth step between cudaProfilerStart and cudaProfilerStop: `ncu --profile-from-start off` then
// times each kernel of one decode step. With --profile-what prompt, the first sequence's prompt (one
// step of `prompt` rows) is profiled instead.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cuda/device_model.h"
#include "bitdelta/engine.h"
#include "bitdelta/error.h"
#include "bitdelta/mapped_file.h"
#include "bitdelta/model.h"

namespace fs = std::filesystem;
using namespace bitdelta;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, size_t(p / 100.0 * double(v.size() - 1) + 0.5));
  return v[i];
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(what, ": ", cudaGetErrorString(e));
}

// Device-to-device copy of 2 GiB (bytes read + written per second) and pinned host → device of
// 1 GiB; medians of 5.
std::pair<double, double> copy_bandwidths() {
  const size_t n = size_t(1) << 30;
  void *a, *b, *h;
  check(cudaMalloc(&a, 2 * n), "cudaMalloc");
  check(cudaMalloc(&b, 2 * n), "cudaMalloc");
  check(cudaHostAlloc(&h, n, cudaHostAllocDefault), "cudaHostAlloc");
  std::memset(h, 1, n);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> d2d, h2d;
  for (int i = 0; i < 6; ++i) {
    float ms = 0;
    cudaEventRecord(e0);
    cudaMemcpy(b, a, 2 * n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
    if (i) d2d.push_back(2.0 * 2 * n / (ms * 1e-3));
    cudaEventRecord(e0);
    cudaMemcpy(a, h, n, cudaMemcpyHostToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
    if (i) h2d.push_back(double(n) / (ms * 1e-3));
  }
  cudaFree(a);
  cudaFree(b);
  cudaFreeHost(h);
  return {median(d2d), median(h2d)};
}

// Drops a file's pages from the page cache (written back first); false if the kernel kept them.
bool drop_from_page_cache(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return false;
  ::fsync(fd);
  const bool ok = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
  ::close(fd);
  return ok;
}

double read_file_speed(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) fail("cannot open ", p.string());
  std::vector<char> buf(size_t(8) << 20);
  const auto t0 = Clock::now();
  size_t total = 0;
  for (ssize_t got; (got = ::read(fd, buf.data(), buf.size())) > 0;) total += size_t(got);
  const double s = secs(t0, Clock::now());
  ::close(fd);
  return double(total) / s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: bench_gpu_e2e DIR [--prompt P] [--decode D] [--batch B[,B...]] [--requests N] [--graphs 0|1] [--out F] "
                 "[--profile-case NAME [--profile-what step|prompt]]\n");
    return 2;
  }
  const fs::path dir = argv[1];
  size_t prompt = 512, decode = 32, requests = 20, graphs = 1;
  std::vector<size_t> batches{32};
  std::string out_path, profile_case, profile_what = "step";
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--out") {
      out_path = argv[i + 1];
      continue;
    }
    if (k == "--profile-case") {
      profile_case = argv[i + 1];
      continue;
    }
    if (k == "--profile-what") {
      profile_what = argv[i + 1];
      if (profile_what != "step" && profile_what != "prompt") {
        std::fprintf(stderr, "bench_gpu_e2e: --profile-what takes step or prompt, not %s\n", argv[i + 1]);
        return 2;
      }
      continue;
    }
    if (k == "--batch") {
      batches.clear();
      for (const char* c = argv[i + 1]; *c;) {
        char* end = nullptr;
        const size_t b = std::strtoull(c, &end, 10);
        if (end == c || b == 0 || (*end && *end != ',')) {
          std::fprintf(stderr, "bench_gpu_e2e: --batch takes sizes > 0 separated by commas, not %s\n", argv[i + 1]);
          return 2;
        }
        batches.push_back(b);
        c = *end ? end + 1 : end;
      }
      continue;
    }
    const size_t v = std::strtoull(argv[i + 1], nullptr, 10);
    if (k == "--prompt") prompt = v;
    else if (k == "--decode") decode = v;
    else if (k == "--requests") requests = v;
    else if (k == "--graphs") graphs = v;
  }
  json out;
  std::vector<fs::path> deltas;  // DIR/deltas/v0.bitdelta, v1, ... in numeric order
  try {
    for (const auto& e : fs::directory_iterator(dir / "deltas")) deltas.push_back(e.path());
    std::sort(deltas.begin(), deltas.end(), [](const fs::path& a, const fs::path& b) {
      return std::stoi(a.stem().string().substr(1)) < std::stoi(b.stem().string().substr(1));
    });
    if (deltas.size() < 2) fail(dir.string(), "/deltas: need at least two delta files");
    const size_t nv = deltas.size();

    // 1. Bandwidths.
    const auto [d2d, h2d] = copy_bandwidths();
    const fs::path probe = deltas[nv - 1], cold = deltas[nv - 2];
    const bool dropped = drop_from_page_cache(probe);
    const double disk = read_file_speed(probe);
    std::printf("device copy bandwidth (read + write): %.0f GB/s; pinned host -> device: %.1f GB/s\n", d2d / 1e9,
                h2d / 1e9);
    std::printf("disk read of %s (%.0f MB, %s): %.2f GB/s\n", probe.filename().c_str(), double(fs::file_size(probe)) / 1e6,
                dropped ? "dropped from the page cache first" : "page cache NOT dropped", disk / 1e9);
    out["roofline_copy_GBps"] = d2d / 1e9;
    out["h2d_GBps"] = h2d / 1e9;
    out["disk_read_GBps"] = disk / 1e9;

    ModelOptions mo;
    mo.device = Device::Cuda;
    mo.threads = 8;
    mo.cuda_graphs = graphs != 0;
    const auto tb = Clock::now();
    Model model(dir / "base", mo);
    const double base_load = secs(tb, Clock::now());
    const auto& c = model.config();
    std::printf("model: %s, hidden %llu, %llu layers, vocab %llu, on %s; base loaded in %.1f s\n",
                c.architecture.c_str(), (unsigned long long)c.hidden, (unsigned long long)c.layers,
                (unsigned long long)c.vocab_size, model.device_model()->device_name().c_str(), base_load);

    // 2. Cold load of one delta, then again from the pinned host tier.
    drop_from_page_cache(cold);
    {
      const auto t0 = Clock::now();
      prefetch_file(cold);  // as the engine's loader does
      const double prefetch_s = secs(t0, Clock::now());
      auto delta = std::make_shared<const DeltaFile>(cold);
      auto p1 = model.prepare_variant("cold", delta);
      const double total = secs(t0, Clock::now());
      const double bytes = double(p1->upload.bytes);
      auto t1 = Clock::now();
      auto p2 = model.prepare_variant("cold2", delta);
      const double again = secs(t1, Clock::now());
      std::printf(
          "\ncold load of %s: %.0f MB on the device in %.3f s (prefetch request %.3f s, "
          "open + validate %.3f s, -> pinned %.3f s (the file paged in by %.3f s, the buffer "
          "pinned beside it in %.3f s), pinned -> device %.3f s = %.1f GB/s)\n",
          cold.filename().c_str(), bytes / 1e6, total, prefetch_s,
          total - prefetch_s - p1->upload.read_s - p1->upload.copy_s, p1->upload.read_s,
          p1->upload.page_s, p1->upload.pin_s, p1->upload.copy_s, bytes / p1->upload.copy_s / 1e9);
      std::printf(
          "  floor: disk %.3f s + host->device %.3f s; reload from the pinned host tier: %.3f s "
          "(hit: %s)\n",
          bytes / disk, bytes / h2d, again, p2->upload.host_hit ? "yes" : "no");
      out["cold_load"] = {{"bytes", bytes},
                          {"total_s", total},
                          {"prefetch_s", prefetch_s},
                          {"read_s", p1->upload.read_s},
                          {"copy_s", p1->upload.copy_s},
                          {"page_s", p1->upload.page_s},
                          {"pin_s", p1->upload.pin_s},
                          {"disk_floor_s", bytes / disk},
                          {"h2d_floor_s", bytes / h2d},
                          {"host_tier_reload_s", again},
                          {"host_hit", p2->upload.host_hit}};
    }

    // 3. Every variant resident.
    for (size_t i = 0; i < nv; ++i) model.add_variant("v" + std::to_string(i), deltas[i]);
    const auto mem = model.device_model()->memory();
    const double full = double(mem.base_bytes);
    std::printf("\nGPU memory: base %.2f GB + %zu variants %.2f GB = %.2f GB; %zu full copies would be %.1f GB (%.1fx); "
                "device in use %.1f of %.1f GB\n",
                full / 1e9, nv, double(mem.variant_bytes) / 1e9, (full + double(mem.variant_bytes)) / 1e9, nv,
                double(nv) * full / 1e9, double(nv) * full / (full + double(mem.variant_bytes)),
                double(mem.device_used) / 1e9, double(mem.device_total) / 1e9);
    out["memory"] = {{"base_bytes", mem.base_bytes}, {"variant_bytes", mem.variant_bytes}, {"variants", nv},
                     {"full_copies_bytes", double(nv) * full}, {"device_used", mem.device_used}};

    // 4. Decode.
    auto tokens_of = [&](size_t n, size_t seed) {
      std::vector<int32_t> t(n);
      for (size_t i = 0; i < n; ++i) t[i] = int32_t((seed * 7919 + i * 104729 + 3) % c.vocab_size);
      return t;
    };
    // Bytes one decode step must read: every linear of the base, the lm_head, each distinct
    // variant's signs and α, and the KV cache (below). Roofline: those bytes at the device-to-device copy rate (bytes read +
    // written per second), as bench/cuda/NOTES.md counts it.
    const double base_linear_bytes = [&] {
      double b = 0;
      for (const auto& L : model.variant(0).layers)
        for (const auto& t : L.linear) b += double(t.numel()) * 2;
      return b + double(c.vocab_size * c.hidden) * 2;
    }();
    const double delta_bytes = [&] {
      double b = 0;
      for (const auto& cw : model.variant(model.find_variant("v0")).delta->compressed())
        b += double(cw.signs.data.size() + cw.alpha.data.size());
      return b;
    }();
    std::printf("\n%-44s %10s %10s %10s %8s\n", ("decode (prompt " + std::to_string(prompt) + ")").c_str(), "step",
                "tokens/s", "GB/step", "of roof");
    struct DecodeCase {
      std::string name;
      std::vector<int> variants;  // one sequence each
    };
    const int v0 = model.find_variant("v0");
    std::vector<DecodeCase> cases{{"batch 1, base", {0}}, {"batch 1, one variant", {v0}}};
    for (size_t batch : batches) {
      std::vector<int> mixed, base_b, one_b;
      for (size_t i = 0; i < batch; ++i) {
        mixed.push_back(v0 + int(i % nv));
        base_b.push_back(0);
        one_b.push_back(v0);
      }
      const std::string b = "batch " + std::to_string(batch);
      cases.push_back({b + ", base", base_b});
      cases.push_back({b + ", one variant", one_b});
      cases.push_back({b + ", " + std::to_string(nv) + " variants mixed", mixed});
    }
    json dec = json::array();
    for (const auto& cs : cases) {
      const bool profiled = !profile_case.empty() && cs.name.find(profile_case) != std::string::npos;
      if (!profile_case.empty() && !profiled) continue;
      std::vector<Sequence> seqs;
      for (int v : cs.variants) seqs.push_back(model.new_sequence(v));
      for (size_t s = 0; s < seqs.size(); ++s) {  // prompts, one sequence per step
        const auto t = tokens_of(prompt, s);
        std::vector<ForwardRow> rows;
        for (size_t i = 0; i < t.size(); ++i) rows.push_back({&seqs[s], t[i], i + 1 == t.size()});
        const bool profile_prompt = profiled && profile_what == "prompt" && s == 0;
        if (profile_prompt) check(cudaProfilerStart(), "cudaProfilerStart");
        model.forward(rows);
        if (profile_prompt) check(cudaProfilerStop(), "cudaProfilerStop");
      }
      std::vector<double> times;
      const cuda::GraphStats g0 = model.device_model()->graph_stats();
      for (size_t step = 0; step < decode; ++step) {
        std::vector<ForwardRow> rows;
        for (size_t s = 0; s < seqs.size(); ++s) rows.push_back({&seqs[s], int32_t((s * 31 + step * 7) % 1000), true});
        const bool profile_step = profiled && profile_what == "step" && step == 3;
        if (profile_step) check(cudaProfilerStart(), "cudaProfilerStart");
        const auto t0 = Clock::now();
        model.forward(rows);
        if (step >= 2) times.push_back(secs(t0, Clock::now()));
        if (profile_step) check(cudaProfilerStop(), "cudaProfilerStop");
      }
      std::vector<int> distinct(cs.variants);
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      // Plus the KV cache attention reads (bf16 keys and values of every earlier position, all layers)
      // at the middle step.
      const double kv_bytes = double(seqs.size()) * double(prompt + decode / 2) * double(c.layers) * 2.0 *
                              double(c.kv_heads * c.head_dim) * 2.0;
      const double bytes =
          base_linear_bytes + kv_bytes +
          double(std::count_if(distinct.begin(), distinct.end(), [](int v) { return v > 0; })) * delta_bytes;
      const double t = median(times);
      std::printf("%-44s %8.2f ms %10.1f %10.2f %8.2f\n", cs.name.c_str(), t * 1e3, double(seqs.size()) / t, bytes / 1e9,
                  bytes / d2d / t);
      const cuda::GraphStats g1 = model.device_model()->graph_stats();
      std::printf("%-44s %llu captured, %llu replayed as CUDA graphs\n", "", (unsigned long long)(g1.captured - g0.captured),
                  (unsigned long long)(g1.replayed - g0.replayed));
      dec.push_back({{"case", cs.name}, {"step_s", t}, {"tokens_per_s", double(seqs.size()) / t}, {"bytes", bytes},
                     {"roofline_fraction", bytes / d2d / t}, {"graphs_captured", g1.captured - g0.captured},
                     {"graphs_replayed", g1.replayed - g0.replayed}});
    }
    out["decode"] = dec;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_e2e: %s\n", e.what());
    return 1;
  }

  if (!profile_case.empty()) return 0;
  // 5. TTFT through the engine (the Model above is gone: one base on the device).
  try {
    EngineOptions eo;
    eo.device = "cuda";
    eo.threads = 8;
    eo.max_batch_tokens = std::max<size_t>(512, prompt);
    Engine engine(dir / "base", eo);
    std::vector<std::string> names{eo.base_name};
    for (const auto& d : deltas) {
      names.push_back(d.stem().string());
      engine.add_variant(names.back(), d, true);
    }
    for (bool loading = true; loading;) {  // wait until every variant is resident
      loading = false;
      for (const auto& v : engine.variants()) loading = loading || v.state == "loading" || v.state == "cold";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::printf("\n%-10s %10s %10s   (TTFT of %zu-token prompts, %zu requests each, one at a time)\n", "model", "p50",
                "p99", prompt, requests);
    json ttft = json::array();
    std::map<std::string, std::vector<double>> samples;
    const auto vocab = engine.config().vocab_size;
    for (size_t round = 0; round <= requests; ++round)
      for (const auto& name : names) {
        GenerationRequest req;
        req.model = name;
        req.prompt.resize(prompt);
        for (size_t i = 0; i < prompt; ++i) req.prompt[i] = int32_t((round * 7919 + i * 104729 + 11) % std::min<uint64_t>(vocab, 4000));
        req.sampling.temperature = 0;
        req.stop.max_tokens = 1;
        req.stop_at_eos = false;
        std::promise<double> done;
        GenerationCallbacks cb;
        cb.on_done = [&](FinishReason, const Usage& u) { done.set_value(u.ttft_s); };
        cb.on_error = [&](const std::string& m, int) { done.set_exception(std::make_exception_ptr(Error(m))); };
        engine.submit(req, cb);
        const double t = done.get_future().get();
        if (round == 0) continue;  // warm-up
        samples[name].push_back(t);
        if (round == requests) {
          const auto& s = samples[name];
          std::printf("%-10s %8.1f ms %8.1f ms\n", name.c_str(), percentile(s, 50) * 1e3, percentile(s, 99) * 1e3);
          ttft.push_back({{"model", name}, {"p50_s", percentile(s, 50)}, {"p99_s", percentile(s, 99)}});
        }
      }
    out["ttft"] = ttft;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_e2e (ttft): %s\n", e.what());
    return 1;
  }
  if (!out_path.empty()) std::ofstream(out_path) << out.dump(2) << "\n";
  return 0;
}
