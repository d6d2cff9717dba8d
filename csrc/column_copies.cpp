// Gathering columns of a row-major matrix as rows: dst[i, r] = src[r, idx[i]]. This is how a
// gradient that a backward graph produced row-major ([out, columns]) becomes zenflow's
// column-major rows in the runtime's column order. A plain strided copy reads one element per
// cache line; here the work goes in tiles small enough that every line read or written is used
// whole while it is in cache, over a pool of full-priority threads the caller waits for.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "thread_pool.h"

#define ZF_API extern "C" __attribute__((visibility("default")))

namespace {

// The tile edge (a tile's source and destination lines stay in L1 together), and the source
// rows a thread claims at a time.
constexpr int64_t kTile = 32;
constexpr int64_t kChunkRows = 4 * kTile;

int usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// The caller's helpers: one thread per other usable core, at full priority (the caller waits).
zf::LazyPool g_helpers(usable_cores() - 1, 0);

template <typename T>
void gather_tile_rows(const T* src, int64_t src_stride, const int64_t* idx, int64_t n, T* dst,
                      int64_t dst_stride, int64_t r_begin, int64_t r_end) {
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kTile) {
    const int64_t r1 = std::min(r_end, r0 + kTile);
    for (int64_t i0 = 0; i0 < n; i0 += kTile) {
      const int64_t i1 = std::min(n, i0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        const T* column = src + idx[i];
        T* row = dst + i * dst_stride;
        for (int64_t r = r0; r < r1; ++r) row[r] = column[r * src_stride];
      }
    }
  }
}

}  // namespace

// src: `rows` rows of `cols` elements, row r starting at src + r * src_stride elements; dst: n
// rows of `rows` elements, row i starting at dst + i * dst_stride. elem_size 2 or 4 (bytes).
// Returns 0, or 1 for invalid arguments (an index outside [0, cols), a bad size); nothing is
// written then.
ZF_API int zf_gather_columns(const void* src, int64_t rows, int64_t cols, int64_t src_stride,
                             const int64_t* idx, int64_t n, void* dst, int64_t dst_stride,
                             int elem_size) {
  if (rows < 0 || cols < 0 || n < 0 || src_stride < cols || dst_stride < rows) return 1;
  if (elem_size != 2 && elem_size != 4) return 1;
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= cols) return 1;
  }
  if (rows == 0 || n == 0) return 0;
  // Chunks of source rows are claimed one at a time by the calling thread (awake, its caches
  // warm) and by the pool's threads, so a helper that is slow to wake or to get a core (torch's
  // own threads may still be spinning on it) leaves its share to the others.
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  auto next = std::make_shared<std::atomic<int64_t>>(0);
  auto work = [=] {
    for (int64_t c = (*next)++; c < chunks; c = (*next)++) {
      const int64_t begin = c * kChunkRows;
      const int64_t end = std::min(rows, begin + kChunkRows);
      if (elem_size == 4) {
        gather_tile_rows(static_cast<const uint32_t*>(src), src_stride, idx, n,
                         static_cast<uint32_t*>(dst), dst_stride, begin, end);
      } else {
        gather_tile_rows(static_cast<const uint16_t*>(src), src_stride, idx, n,
                         static_cast<uint16_t*>(dst), dst_stride, begin, end);
      }
    }
  };
  const int helpers = static_cast<int>(std::min<int64_t>(usable_cores(), chunks)) - 1;
  std::shared_ptr<zf::Job> job;
  if (helpers > 0) {
    job = std::make_shared<zf::Job>(static_cast<size_t>(helpers), [work](size_t) { work(); });
    g_helpers.submit(job);
  }
  work();
  if (job) job->wait(-1);
  return 0;
}
