// The least time one kernel launch takes to read given bytes (read_floor.cu).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace bitdelta::bench {

constexpr int kMaxReadRegions = 20;

struct ReadRegion {
  const void* ptr;  // device memory, 16-byte aligned
  size_t bytes;     // read in whole 16-byte words (a ragged end is not read)
};

struct ReadFloor {
  double us;          // median µs of one launch, the fastest of the forms tried
  std::string form;   // that form: blocks, threads and loads in flight
  // Every form tried: (KB in flight per multiprocessor, median µs), the blocks per multiprocessor ×
  // threads × loads of 16 B in flight per thread, in the order tried.
  std::vector<std::pair<double, double>> forms;
  int per_sm, threads, unroll;  // the fastest form's blocks per multiprocessor, threads, loads in flight
};

// regions(rep): what launch rep reads (callers rotate buffers by rep so that L2 never holds them).
// Every form (blocks per multiprocessor, threads, loads in flight per thread) is timed over reps
// launches; the fastest median wins.
ReadFloor read_floor_us(const std::function<std::vector<ReadRegion>(int)>& regions, int reps);

// Where a chained launch reads against its wait for the launch before (launch.cuh's pdl_wait):
// - kBefore: all of it before (weights only; the decode kernels' loads of W before their wait, had
//   they room for all of them);
// - kAfter: all of it after (what a kernel reads that the launch before wrote, x);
// - kFirstBatchBefore: each thread's first batch of loads before, into registers, the rest after;
// - kFirstBatchToL2: each thread's first batch sent to L2 before, all of it read after.
// The last three bound a kernel that needs x from the launch before and can hold no, or a first
// batch of, its weights before the wait (the one-row kernel sends its first unit of W to L2).
enum class ChainWait { kBefore = 0, kAfter = 1, kFirstBatchBefore = 2, kFirstBatchToL2 = 3 };

// The same reads in `form` (read_floor_us's fastest), `calls` launches back to back, each free to
// start while the one before runs (launch.cuh, as the decode step's kernels do) and reading as
// `wait` says: µs per launch, the floor under a chain of such kernels.
double read_floor_chain_us(const std::function<std::vector<ReadRegion>(int)>& regions, const ReadFloor& form,
                           int calls, ChainWait wait = ChainWait::kBefore);

// Every form of read_floor_us, chained as read_floor_chain_us times it: the fastest, with each
// form's (KB in flight per multiprocessor, µs) in forms.
ReadFloor read_floor_chain_best(const std::function<std::vector<ReadRegion>(int)>& regions, int calls,
                                ChainWait wait);

// One launch of the floor's kernel (per_sm blocks per multiprocessor, 4 loads in flight per thread)
// reading these regions, each block's {entry, end, %smid} recorded (%globaltimer ns): the timeline
// that --stream-trace compares with the streaming kernel's.
std::vector<unsigned long long> read_floor_trace(const std::vector<ReadRegion>& regions, int per_sm, int threads);

}  // namespace bitdelta::bench
