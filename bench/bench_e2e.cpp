// End to end on the CPU: prefill and decode tokens/s of a model, base alone vs one variant vs
// 8 variants in one batch. Bytes per decode step = every weight the step reads (base linears and
// lm_head once, plus each distinct variant's sign bits and α), against the read bandwidth this
// process measures first.
//   bench_e2e DIR [--threads N] [--prompt P] [--decode D]
// DIR holds base/ and deltas/v*.bitdelta (bench/make_synthetic DIR --finetune 0 --deltas 8 ...).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "bitdelta/model.h"

using namespace bitdelta;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double read_bandwidth(ThreadPool& pool) {
  std::vector<uint64_t> buf(size_t(1) << 27);
  std::iota(buf.begin(), buf.end(), 0);
  std::vector<uint64_t> sink(pool.size() * 8);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    pool.parallel_for(pool.size(), [&](size_t b, size_t e) {
      for (size_t t = b; t < e; ++t) {
        const size_t n = buf.size() / pool.size();
        uint64_t a = 0, c = 0;
        for (size_t i = t * n; i < (t + 1) * n; i += 2) a += buf[i], c += buf[i + 1];
        sink[t * 8] = a + c;
      }
    });
    best = std::max(best, double(buf.size() * 8) / seconds_since(t0));
  }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Bytes one decode step reads: base block linears + lm_head, and per distinct variant its deltas.
double step_bytes(const Model& m, const std::vector<int>& variants) {
  const auto& base = m.variant(0);
  double bytes = double(base.lm_head.data.size());
  for (const auto& L : base.layers)
    for (const auto& w : L.linear) bytes += double(w.data.size());
  std::vector<int> distinct(variants);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  for (int v : distinct)
    if (v > 0)
      for (const auto& c : m.variant(v).delta->compressed()) bytes += double(c.signs.data.size() + c.alpha.data.size());
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_e2e DIR [--threads N] [--prompt P] [--decode D]\n");
    return 2;
  }
  const fs::path dir = argv[1];
  size_t threads = 2, prompt = 64, decode = 16;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const size_t v = std::strtoull(argv[i + 1], nullptr, 10);
    if (k == "--threads") threads = v;
    else if (k == "--prompt") prompt = v;
    else if (k == "--decode") decode = v;
  }
  try {
    Model model(dir / "base", threads);
    std::vector<fs::path> deltas;
    for (const auto& e : fs::directory_iterator(dir / "deltas")) deltas.push_back(e.path());
    std::sort(deltas.begin(), deltas.end());
    for (size_t i = 0; i < deltas.size(); ++i) model.add_variant("v" + std::to_string(i), deltas[i]);
    const auto& c = model.config();
    const double bw = read_bandwidth(model.pool());
    std::printf("model: %s, hidden %llu, %llu layers, vocab %llu; %zu variants; %zu threads\n", c.architecture.c_str(),
                (unsigned long long)c.hidden, (unsigned long long)c.layers, (unsigned long long)c.vocab_size,
                deltas.size(), threads);
    std::printf("measured read bandwidth (%zu threads): %.2f GB/s\n\n", threads, bw / 1e9);

    auto tokens_of = [&](size_t n, size_t seed) {
      std::vector<int32_t> t(n);
      for (size_t i = 0; i < n; ++i) t[i] = int32_t((seed * 7919 + i * 104729) % c.vocab_size);
      return t;
    };

    // Prefill: `prompt` tokens in one step: one sequence of the base, one of a variant, and 8
    // sequences of prompt/8 tokens from 8 distinct variants.
    std::printf("%-40s %10s %12s\n", "prefill (one step)", "time", "tokens/s");
    struct PrefillCase {
      std::string name;
      std::vector<int> variants;
    };
    std::vector<PrefillCase> pre{{std::to_string(prompt) + " tokens, base", {0}},
                                 {std::to_string(prompt) + " tokens, one variant", {1}}};
    if (deltas.size() >= 8) pre.push_back({std::to_string(prompt) + " tokens, 8 variants x " + std::to_string(prompt / 8), {1, 2, 3, 4, 5, 6, 7, 8}});
    {  // warm-up: fault the weights in, start the threads
      auto seq = model.new_sequence(0);
      std::vector<ForwardRow> rows;
      for (int32_t t : tokens_of(32, 99)) rows.push_back({&seq, t, false});
      model.forward(rows);
    }
    for (const auto& pc : pre) {
      std::vector<double> t;
      for (int rep = 0; rep < 2; ++rep) {
        std::vector<Sequence> seqs;
        for (int v : pc.variants) seqs.push_back(model.new_sequence(v));
        std::vector<ForwardRow> rows;
        const size_t each = prompt / pc.variants.size();
        for (size_t s = 0; s < seqs.size(); ++s) {
          const auto toks = tokens_of(each, s + size_t(rep));
          for (size_t i = 0; i < toks.size(); ++i) rows.push_back({&seqs[s], toks[i], i + 1 == toks.size()});
        }
        const auto t0 = Clock::now();
        model.forward(rows);
        t.push_back(seconds_since(t0));
      }
      std::printf("%-40s %8.3f s %12.1f\n", pc.name.c_str(), median(t), double(prompt) / median(t));
    }

    // Decode: B sequences, one row each per step.
    struct Case {
      const char* name;
      std::vector<int> variants;
    };
    std::vector<Case> cases{{"batch 1, base", {0}}, {"batch 1, one variant", {1}}, {"batch 8, base", std::vector<int>(8, 0)}};
    if (deltas.size() >= 8) cases.push_back({"batch 8, 8 distinct variants", {1, 2, 3, 4, 5, 6, 7, 8}});
    std::printf("\n%-40s %10s %12s %10s %10s %9s\n", "decode", "step", "tokens/s", "MB/step", "GB/s", "roofline");
    for (const auto& cs : cases) {
      std::vector<Sequence> seqs;
      for (int v : cs.variants) seqs.push_back(model.new_sequence(v));
      std::vector<ForwardRow> rows;
      for (size_t s = 0; s < seqs.size(); ++s)
        for (int32_t t : tokens_of(16, s)) rows.push_back({&seqs[s], t, false});
      model.forward(rows);
      std::vector<double> steps;
      for (size_t d = 0; d < decode; ++d) {
        rows.clear();
        for (size_t s = 0; s < seqs.size(); ++s) rows.push_back({&seqs[s], int32_t((d * 31 + s) % c.vocab_size), true});
        const auto t0 = Clock::now();
        model.forward(rows);
        steps.push_back(seconds_since(t0));
      }
      const double step = median(steps), bytes = step_bytes(model, cs.variants);
      std::printf("%-40s %8.1f ms %12.2f %10.1f %10.2f %9.2f\n", cs.name, step * 1e3, double(seqs.size()) / step,
                  bytes / 1e6, bytes / step / 1e9, bytes / step / bw);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_e2e: error: %s\n", e.what());
    return 1;
  }
}
