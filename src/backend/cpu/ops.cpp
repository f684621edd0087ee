#include "ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace bitdelta::cpu {

void rmsnorm(const float* x, const float* weight, size_t n, double eps, float* y) {
  float sum = 0;  // float32, as the reference implementation computes it
  for (size_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / float(n) + float(eps));
  for (size_t i = 0; i < n; ++i) y[i] = weight[i] * (x[i] * inv);
}

void rope(float* x, size_t heads, size_t head_dim, size_t position, std::span<const float> inv_freq) {
  const size_t half = head_dim / 2;
  for (size_t i = 0; i < half; ++i) {
    const float angle = float(position) * inv_freq[i];
    const float c = float(std::cos(double(angle))), s = float(std::sin(double(angle)));
    for (size_t h = 0; h < heads; ++h) {
      float* v = x + h * head_dim;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * s;
      v[i + half] = b * c + a * s;
    }
  }
}

void attend(const float* q, const float* keys, const float* values, size_t length, size_t stride, size_t offset,
            size_t head_dim, float scale, float* out) {
  thread_local std::vector<float> scores;
  scores.resize(length);
  float max_score = -INFINITY;
  for (size_t t = 0; t < length; ++t) {
    const float* k = keys + t * stride + offset;
    float dot = 0;
    for (size_t d = 0; d < head_dim; ++d) dot += q[d] * k[d];
    scores[t] = dot * scale;
    max_score = std::max(max_score, scores[t]);
  }
  float total = 0;
  for (size_t t = 0; t < length; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    total += scores[t];
  }
  std::fill(out, out + head_dim, 0.0f);
  for (size_t t = 0; t < length; ++t) {
    const float p = scores[t] / total;
    const float* v = values + t * stride + offset;
    for (size_t d = 0; d < head_dim; ++d) out[d] += p * v[d];
  }
}

void swiglu(float* gate, const float* up, size_t n) {
  for (size_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace bitdelta::cpu
