// Moving columns of a row-major matrix (a weight, [rows, cols]) to and from rows of zenflow's
// column-major buffers ([n, rows], one row per column):
//   gather:  dst[i, r] = src[r, idx[i]]   (a gradient produced row-major becomes rows)
//   scatter: dst[r, idx[i]] = src[i, r]   (updated rows are written back into the weight)
// A plain strided copy reads or writes one element per cache line; here the work goes in tiles
// small enough that every line read or written is used whole while it is in cache (most of the
// columns, either way: in strips a line wide, the buffer's rows read or written as streams),
// over a pool of full-priority threads the caller waits for.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "thread_pool.h"

#define ZF_API extern "C" __attribute__((visibility("default")))

namespace {

// The tile edge (a tile's source and destination lines stay in L1 together), and the rows of
// the row-major matrix a thread claims at a time.
constexpr int64_t kTile = 32;
constexpr int64_t kChunkRows = 4 * kTile;
// Elements of one 64-byte cache line.
template <typename T>
constexpr int64_t kLineElements = 64 / sizeof(T);
// Up to this many columns a scatter's source lines for a line of matrix rows fit in L1.
constexpr int64_t kFewColumns = 256;
// The most matrix rows a thread claims at a time in a gather or scatter by strips: the strip's
// buffer rows are read or written as streams this long.
constexpr int64_t kStripRows = 512;

int usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// The caller's helpers: one thread per other usable core, at full priority (the caller waits).
zf::LazyPool g_helpers(usable_cores() - 1, 0);

// Gather: rows [r_begin, r_end) of the row-major matrix, tile by tile, read into the buffer's
// rows (one per column): each tile's source and destination lines are used whole in L1.
template <typename T>
void gather_tiles(const T* matrix, int64_t matrix_stride, const int64_t* idx, int64_t n, T* rows,
                  int64_t rows_stride, int64_t r_begin, int64_t r_end) {
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kTile) {
    const int64_t r1 = std::min(r_end, r0 + kTile);
    for (int64_t i0 = 0; i0 < n; i0 += kTile) {
      const int64_t i1 = std::min(n, i0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        const T* column = matrix + idx[i];
        T* row = rows + i * rows_stride;
        for (int64_t r = r0; r < r1; ++r) row[r] = column[r * matrix_stride];
      }
    }
  }
}

#if defined(__SSE2__)
// K x K blocks of 16-byte vectors (K = 16 / sizeof(T)): in[w] holds K elements of source row w,
// out[i] element i of every source row, in source row order.
template <typename T>
struct Transpose;

template <>
struct Transpose<uint32_t> {
  static constexpr int64_t K = 4;
  static void block(const __m128i* in, __m128i* out) {
    const __m128i a = _mm_unpacklo_epi32(in[0], in[1]);
    const __m128i b = _mm_unpackhi_epi32(in[0], in[1]);
    const __m128i c = _mm_unpacklo_epi32(in[2], in[3]);
    const __m128i d = _mm_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm_unpacklo_epi64(a, c);
    out[1] = _mm_unpackhi_epi64(a, c);
    out[2] = _mm_unpacklo_epi64(b, d);
    out[3] = _mm_unpackhi_epi64(b, d);
  }
};

template <>
struct Transpose<uint16_t> {
  static constexpr int64_t K = 8;
  static void block(const __m128i* in, __m128i* out) {
    __m128i a[8], b[8];
    for (int p = 0; p < 4; ++p) {
      a[2 * p] = _mm_unpacklo_epi16(in[2 * p], in[2 * p + 1]);
      a[2 * p + 1] = _mm_unpackhi_epi16(in[2 * p], in[2 * p + 1]);
    }
    for (int h = 0; h < 2; ++h) {
      for (int q = 0; q < 2; ++q) {
        b[4 * h + 2 * q] = _mm_unpacklo_epi32(a[4 * h + q], a[4 * h + q + 2]);
        b[4 * h + 2 * q + 1] = _mm_unpackhi_epi32(a[4 * h + q], a[4 * h + q + 2]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = _mm_unpacklo_epi64(b[i], b[i + 4]);
      out[2 * i + 1] = _mm_unpackhi_epi64(b[i], b[i + 4]);
    }
  }
};

// Scatter of buffer rows j0 + [0, K) (sources `from`, each read from element r on) into matrix
// rows r + [0, K): one transpose in registers; each matrix row's K elements go out as one
// store where their columns are consecutive, else one by one.
template <typename T>
void scatter_block(T* matrix, int64_t matrix_stride, const int64_t* columns, const T* const* from,
                   int64_t r) {
  constexpr int64_t K = Transpose<T>::K;
  __m128i in[K], out[K];
  for (int64_t w = 0; w < K; ++w) in[w] = _mm_loadu_si128((const __m128i*)(from[w] + r));
  Transpose<T>::block(in, out);
  const bool consecutive = columns[K - 1] - columns[0] == K - 1;  // ascending and distinct
  for (int64_t i = 0; i < K; ++i) {
    T* line = matrix + (r + i) * matrix_stride;
    if (consecutive) {
      _mm_storeu_si128((__m128i*)(line + columns[0]), out[i]);
    } else {
      alignas(16) T values[K];
      _mm_store_si128((__m128i*)values, out[i]);
      for (int64_t w = 0; w < K; ++w) line[columns[w]] = values[w];
    }
  }
}
#endif

// Scatter: rows [r_begin, r_end) of the row-major matrix take their elements of the source
// rows, tile by tile, with the columns in ascending order (column columns[j] is read from
// sources[j]) so that each matrix row is written front to back. Reading a tile's source lines
// waits on memory (one line per buffer row, rows far apart): the next tile's are prefetched. A
// few columns (a selection) go in tiles of every column and a line's worth of matrix rows: each
// matrix row is then written in one pass, as a stream, with the source lines held in L1. More
// columns (up to half of them) go through transposes in registers, K x K elements at a time.
template <typename T>
void scatter_tiles(T* matrix, int64_t matrix_stride, const int64_t* columns,
                   const T* const* sources, int64_t n, int64_t r_begin, int64_t r_end) {
  const bool few = n <= kFewColumns;
  const int64_t r_tile = few ? kLineElements<T> : kTile;
  const int64_t j_tile = few ? n : kTile;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += r_tile) {
    const int64_t r1 = std::min(r_end, r0 + r_tile);
    for (int64_t j0 = 0; j0 < n; j0 += j_tile) {
      const int64_t j1 = std::min(n, j0 + j_tile);
      if (r1 < r_end) {
        for (int64_t j = j0; j < j1; ++j) {
          const T* next = sources[j] + r1;
          for (int64_t e = 0; e < r_tile; e += kLineElements<T>) __builtin_prefetch(next + e);
        }
      }
      // The part of the tile left to the scalar loop: all of it, or its edges.
      int64_t r_done = r0, j_done = j0;
#if defined(__SSE2__)
      constexpr int64_t K = Transpose<T>::K;
      if (!few) {
        r_done = r0 + (r1 - r0) / K * K;
        j_done = j0 + (j1 - j0) / K * K;
        for (int64_t j = j0; j < j_done; j += K) {
          for (int64_t r = r0; r < r_done; r += K) {
            scatter_block(matrix, matrix_stride, columns + j, sources + j, r);
          }
        }
      }
#endif
      for (int64_t r = r0; r < r1; ++r) {
        T* line = matrix + r * matrix_stride;
        const int64_t j_from = r < r_done ? j_done : j0;
        for (int64_t j = j_from; j < j1; ++j) {
          line[columns[j]] = sources[j][r];
        }
      }
    }
  }
}

// The columns [c0, c0 + L) of a matrix (fewer at its right edge), L a cache line's worth: each
// one's buffer row (null where the column is not moved) and the places of those that are.
template <typename T, typename Row>
struct Strip {
  static constexpr int64_t L = kLineElements<T>;
  int64_t width;
  Row rows[L];
  int64_t present[L];
  int64_t count = 0;

  Strip(const Row* row_of, int64_t c0, int64_t cols) : width(std::min(L, cols - c0)) {
    for (int64_t c = 0; c < width; ++c) {
      rows[c] = row_of[c0 + c];
      if (rows[c] != nullptr) present[count++] = c;
    }
  }

  // Where rows [r_begin, r_end) stop going through k x k transposes: none unless the strip is
  // a whole line wide and moves at least k columns.
  int64_t transposed_end(int64_t r_begin, int64_t r_end, int64_t k) const {
    if (width < L || count < k) return r_begin;
    return r_begin + (r_end - r_begin) / k * k;
  }
};

// Scatter of most of a matrix's columns: rows [r_begin, r_end) take them one strip of a cache
// line's worth of columns at a time (column c is read from source_of[c], null where it is not
// written). Down a strip, its source rows are read as streams, and each matrix row's line in
// the strip is written whole at once, from K x K transposes in registers. Tile by tile instead
// (scatter_tiles), each source line comes from memory alone, far from the last one read: for
// a window's write-back that took two to three times as long (bench_write_back.py).
template <typename T>
void scatter_strips(T* matrix, int64_t matrix_stride, int64_t cols, const T* const* source_of,
                    int64_t r_begin, int64_t r_end) {
  constexpr int64_t L = kLineElements<T>;
  for (int64_t c0 = 0; c0 < cols; c0 += L) {
    Strip<T, const T*> strip(source_of, c0, cols);
    const T** from = strip.rows;
    const int64_t* present = strip.present;
    int64_t r_done = r_begin;
#if defined(__SSE2__)
    constexpr int64_t K = Transpose<T>::K;
    r_done = strip.transposed_end(r_begin, r_end, K);
    if (r_done > r_begin) {  // a missing column's lanes are read from a written one, not stored
      for (int64_t c = 0; c < L; ++c) {
        if (from[c] == nullptr) from[c] = from[present[0]];
      }
    }
    for (int64_t r = r_begin; r < r_done; r += K) {
      __m128i out[L / K][K];
      for (int64_t g = 0; g < L / K; ++g) {
        __m128i in[K];
        for (int64_t w = 0; w < K; ++w) {
          in[w] = _mm_loadu_si128((const __m128i*)(from[g * K + w] + r));
        }
        Transpose<T>::block(in, out[g]);
      }
      for (int64_t i = 0; i < K; ++i) {
        T* line = matrix + (r + i) * matrix_stride + c0;
        if (strip.count == L) {
          for (int64_t g = 0; g < L / K; ++g) {
            _mm_storeu_si128((__m128i*)(line + g * K), out[g][i]);
          }
        } else {
          alignas(16) T values[L];
          for (int64_t g = 0; g < L / K; ++g) {
            _mm_store_si128((__m128i*)(values + g * K), out[g][i]);
          }
          for (int64_t p = 0; p < strip.count; ++p) line[present[p]] = values[present[p]];
        }
      }
    }
#endif
    for (int64_t r = r_done; r < r_end; ++r) {
      T* line = matrix + r * matrix_stride + c0;
      for (int64_t p = 0; p < strip.count; ++p) line[present[p]] = from[present[p]][r];
    }
  }
}

// Gather of most of a matrix's columns, the scatter by strips' twin: down a strip a cache line
// wide, each matrix row's line in it is read whole at once, and the strip's buffer rows
// (row_of[c], null where column c is not gathered) are written as streams.
template <typename T>
void gather_strips(const T* matrix, int64_t matrix_stride, int64_t cols, T* const* row_of,
                   int64_t r_begin, int64_t r_end) {
  constexpr int64_t L = kLineElements<T>;
  for (int64_t c0 = 0; c0 < cols; c0 += L) {
    const Strip<T, T*> strip(row_of, c0, cols);
    T* const* to = strip.rows;
    int64_t r_done = r_begin;
#if defined(__SSE2__)
    constexpr int64_t K = Transpose<T>::K;
    r_done = strip.transposed_end(r_begin, r_end, K);
    for (int64_t r = r_begin; r < r_done; r += K) {
      const T* line = matrix + r * matrix_stride + c0;
      for (int64_t g = 0; g < L / K; ++g) {
        __m128i in[K], out[K];
        for (int64_t w = 0; w < K; ++w) {
          in[w] = _mm_loadu_si128((const __m128i*)(line + w * matrix_stride + g * K));
        }
        Transpose<T>::block(in, out);
        for (int64_t i = 0; i < K; ++i) {
          if (to[g * K + i] != nullptr) _mm_storeu_si128((__m128i*)(to[g * K + i] + r), out[i]);
        }
      }
    }
#endif
    for (int64_t r = r_done; r < r_end; ++r) {
      const T* line = matrix + r * matrix_stride + c0;
      for (int64_t p = 0; p < strip.count; ++p) to[strip.present[p]][r] = line[strip.present[p]];
    }
  }
}

// Whether moving `moved` of a matrix's `cols` columns goes by strips rather than tiles: from half
// of them. For bench_write_back.py's weights strips ran at 1.6x the tiles' speed with half of
// the columns, at 0.9x with 30 % of them (--topk 0.5 and 0.3).
bool by_strips(int64_t moved, int64_t cols) { return 2 * moved >= cols; }

// The matrix rows a thread claims at a time in a gather or scatter by strips: every thread gets
// rows even where the matrix has few.
int64_t strip_chunk_rows(int64_t rows) {
  const int64_t cores = usable_cores();
  return std::min(kStripRows, (rows + cores - 1) / cores);
}

// Checks the arguments shared by both directions: 0 if valid (nothing to do included).
int check(int64_t rows, int64_t cols, int64_t matrix_stride, const int64_t* idx, int64_t n,
          int64_t rows_stride, int elem_size) {
  if (rows < 0 || cols < 0 || n < 0 || matrix_stride < cols || rows_stride < rows) return 1;
  if (elem_size != 2 && elem_size != 4) return 1;
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= cols) return 1;
  }
  return 0;
}

// Runs `chunk(begin, end)` over row chunks of the row-major matrix on the calling thread (awake,
// its caches warm) and the pool's threads, each claiming one chunk at a time, so that a helper
// slow to wake or to get a core (torch's own threads may still be spinning on it) leaves its
// share to the others. A chunk owns its matrix rows: a scatter's threads never write one line.
template <typename Chunk>
void over_row_chunks(int64_t rows, int64_t chunk_rows, Chunk chunk) {
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  auto next = std::make_shared<std::atomic<int64_t>>(0);
  auto work = [=] {
    for (int64_t c = (*next)++; c < chunks; c = (*next)++) {
      chunk(c * chunk_rows, std::min(rows, (c + 1) * chunk_rows));
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
}

template <typename T>
void gather(const void* matrix, int64_t rows, int64_t cols, int64_t matrix_stride,
            const int64_t* idx, int64_t n, void* buffer, int64_t rows_stride) {
  if (by_strips(n, cols)) {  // and each column gathered once
    auto row_of = std::make_shared<std::vector<T*>>(cols, nullptr);
    bool distinct = true;
    for (int64_t i = 0; i < n; ++i) {
      T*& row = (*row_of)[idx[i]];
      distinct = distinct && row == nullptr;
      row = static_cast<T*>(buffer) + i * rows_stride;
    }
    if (distinct) {
      over_row_chunks(rows, strip_chunk_rows(rows), [=](int64_t begin, int64_t end) {
        gather_strips(static_cast<const T*>(matrix), matrix_stride, cols, row_of->data(), begin,
                      end);
      });
      return;
    }
  }
  over_row_chunks(rows, kChunkRows, [=](int64_t begin, int64_t end) {
    gather_tiles(static_cast<const T*>(matrix), matrix_stride, idx, n, static_cast<T*>(buffer),
                 rows_stride, begin, end);
  });
}

// Every column the sets name, ascending, each with the source row it is written from (the last
// set that names a column gives its row), then strips or tiles over row chunks.
template <typename T>
void scatter(void* matrix, int64_t rows, int64_t cols, int64_t matrix_stride, int64_t sets,
             const int64_t* const* idx, const int64_t* n, const void* const* src,
             const int64_t* src_stride) {
  auto source_of = std::make_shared<std::vector<const T*>>(cols, nullptr);
  for (int64_t s = 0; s < sets; ++s) {
    const T* first = static_cast<const T*>(src[s]);
    for (int64_t i = 0; i < n[s]; ++i) (*source_of)[idx[s][i]] = first + i * src_stride[s];
  }
  const int64_t written = cols - std::count(source_of->begin(), source_of->end(), nullptr);
  if (written == 0) return;
  if (by_strips(written, cols)) {
    over_row_chunks(rows, strip_chunk_rows(rows), [=](int64_t begin, int64_t end) {
      scatter_strips(static_cast<T*>(matrix), matrix_stride, cols, source_of->data(), begin, end);
    });
    return;
  }
  auto columns = std::make_shared<std::vector<int64_t>>();
  auto sources = std::make_shared<std::vector<const T*>>();
  for (int64_t c = 0; c < cols; ++c) {
    if ((*source_of)[c] != nullptr) {
      columns->push_back(c);
      sources->push_back((*source_of)[c]);
    }
  }
  over_row_chunks(rows, kChunkRows, [=](int64_t begin, int64_t end) {
    scatter_tiles(static_cast<T*>(matrix), matrix_stride, columns->data(), sources->data(),
                  written, begin, end);
  });
}

}  // namespace

// src: `rows` rows of `cols` elements, row r starting at src + r * src_stride elements; dst: n
// rows of `rows` elements, row i starting at dst + i * dst_stride. elem_size 2 or 4 (bytes).
// Returns 0, or 1 for invalid arguments (an index outside [0, cols), a bad size); nothing is
// written then.
ZF_API int zf_gather_columns(const void* src, int64_t rows, int64_t cols, int64_t src_stride,
                             const int64_t* idx, int64_t n, void* dst, int64_t dst_stride,
                             int elem_size) {
  if (check(rows, cols, src_stride, idx, n, dst_stride, elem_size)) return 1;
  if (rows == 0 || n == 0) return 0;
  if (elem_size == 4) {
    gather<uint32_t>(src, rows, cols, src_stride, idx, n, dst, dst_stride);
  } else {
    gather<uint16_t>(src, rows, cols, src_stride, idx, n, dst, dst_stride);
  }
  return 0;
}

// The inverse, for several sets of rows at once: dst is the row-major matrix (`rows` rows of
// `cols` elements, stride dst_stride); set s holds n[s] rows of `rows` elements (src[s], stride
// src_stride[s]), and column idx[s][i] of dst becomes its row i. A column that several sets (or
// one set twice) name takes the last one's row. Each column is written once, in one pass over
// dst. Returns as zf_gather_columns does.
ZF_API int zf_scatter_column_sets(void* dst, int64_t rows, int64_t cols, int64_t dst_stride,
                                  int64_t sets, const int64_t* const* idx, const int64_t* n,
                                  const void* const* src, const int64_t* src_stride,
                                  int elem_size) {
  if (sets < 0) return 1;
  for (int64_t s = 0; s < sets; ++s) {
    if (check(rows, cols, dst_stride, idx[s], n[s], src_stride[s], elem_size)) return 1;
  }
  if (rows == 0) return 0;
  if (elem_size == 4) {
    scatter<uint32_t>(dst, rows, cols, dst_stride, sets, idx, n, src, src_stride);
  } else {
    scatter<uint16_t>(dst, rows, cols, dst_stride, sets, idx, n, src, src_stride);
  }
  return 0;
}
