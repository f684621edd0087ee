// How fast the tensor memory accelerator streams a weight matrix into shared memory in the tiles a
// matrix kernel reads it by (tile_read.cu): the streaming decode kernel's ring of stages with no
// arithmetic, so that the stage geometry can be measured apart from what consumes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace bitdelta::bench {

struct TileReadConfig {
  int rows = 64;         // R: rows of W per tile (a multiple of 16, ≤ 256)
  int cols = 256;        // C: columns of W per stage (a multiple of 256)
  int stages = 4;        // S: ring depth
  int blocks_per_sm = 1;
  int variants = 0;      // sign tiles per stage (R/16 × C/256 blocks of 512 B each), one per variant
  int side_bytes = 0;    // bytes per stage from a small L2-resident buffer (x and its bit-planes)
  bool rotate = false;   // whole tiles start at a block-dependent column block (spreads DRAM pages)
  std::string name() const;
};

struct TileReadSet {
  const void* w;                   // [N, K] bf16
  std::vector<const void*> signs;  // per variant, the packed layout (packed_signs.h), ≥ config.variants
};

// Median µs of one launch streaming W (and the signs, and the side bytes) of sets[rep % size]
// tile by tile: persistent blocks take R-row tiles over all of K; the tiles left over after whole
// rounds are split along K as the streaming kernel splits them. Throws if the config does not fit.
double tile_read_us(const TileReadConfig& c, const std::vector<TileReadSet>& sets, int N, int K, int reps);

}  // namespace bitdelta::bench
