// A non-owning view of one tensor's bytes (usually inside an mmapped file).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "bitdelta/dtype.h"

namespace bitdelta {

using Shape = std::vector<uint64_t>;

uint64_t numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[4096, 512]"

struct TensorView {
  DType dtype = DType::U8;
  Shape shape;
  std::span<const std::byte> data;

  uint64_t numel() const { return bitdelta::numel(shape); }
};

}  // namespace bitdelta
