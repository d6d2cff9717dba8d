// AdamW kernels: the per-element math, the work description shared by all instruction sets,
// and the runtime choice among the scalar, AVX2 and AVX-512 variants.
#pragma once

#include <cstdint>

namespace zf {

// Element types of gradient and copy-out buffers (values are part of the C ABI).
enum DType : int32_t { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

// Instruction sets, in increasing order of preference (values are part of the C ABI).
enum Isa : int32_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

// Hyperparameters of one call, as doubles: per-segment scalars derive from them in double
// precision and are rounded to float once, as torch's single-tensor AdamW does with Python floats.
struct Hyper {
  double lr, beta1, beta2, eps, weight_decay, grad_scale;
};

// One tensor's buffers, also the C ABI's tensor record (its ctypes mirror in
// zenflow/runtime/cpu_adam.py must match this layout). accumulator != nullptr selects the fused
// boundary pass; grad may then be null (the accumulator already holds the window's sum).
// grad_rows != nullptr reads the gradient as rows gathered from a larger matrix, in place: the
// tensor's row r (grad_row_len elements) takes row grad_rows[r] of grad's grad_row_count rows.
struct TensorWork {
  float* param;
  const void* grad;
  int32_t grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
  float* accumulator;
  void* out;  // optional copy of the updated params, in out_dtype
  int32_t out_dtype;
  int64_t numel;
  int64_t step;                  // step count after increment, for every element ...
  const int64_t* segment_steps;  // ... unless non-null: one step per segment_len elements
  int64_t segment_len;
  const int64_t* grad_rows;
  int64_t grad_row_len;
  int64_t grad_row_count;
};

// Where element i of a tensor finds its gradient element.
inline int64_t grad_index(const TensorWork& t, int64_t i) {
  if (t.grad_rows == nullptr) return i;
  return t.grad_rows[i / t.grad_row_len] * t.grad_row_len + i % t.grad_row_len;
}

// The end of the run from element i that reads the gradient contiguously: the tensor's end, or
// with gathered rows the end of i's row.
inline int64_t contiguous_grad_end(const TensorWork& t, int64_t i, int64_t end) {
  if (t.grad_rows == nullptr) return end;
  const int64_t row_end = (i / t.grad_row_len + 1) * t.grad_row_len;
  return row_end < end ? row_end : end;
}

// Float scalars of the element loop, fixed for a run of elements sharing one step count.
struct ElementConsts {
  float decay;          // 1 - lr * weight_decay
  float lerp_coeff;     // torch's lerp: weight, or weight - 1 when weight >= 0.5
  bool lerp_from_grad;  // lerp's base is the gradient (weight >= 0.5) instead of exp_avg
  float beta2, one_minus_beta2, eps, grad_scale;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^step)
};

ElementConsts element_consts(const Hyper& h, int64_t step);

// Updates elements [begin, end) of one tensor. Every element goes through the same instruction
// sequence whatever its position (vector tails run the vector code on a padded copy), so results
// do not depend on how a tensor is sliced, nor on the instruction set.
using RangeFn = void (*)(const TensorWork&, const Hyper&, int64_t begin, int64_t end);

void adamw_range_scalar(const TensorWork&, const Hyper&, int64_t, int64_t);
void adamw_range_avx2(const TensorWork&, const Hyper&, int64_t, int64_t);
void adamw_range_avx512(const TensorWork&, const Hyper&, int64_t, int64_t);

// acc[i] += grad_scale * grad[i] over [begin, end) of one tensor (accumulator, grad, grad_dtype
// and numel are read; the other fields are not).
void accumulate_range_scalar(const TensorWork&, const Hyper&, int64_t, int64_t);
void accumulate_range_avx2(const TensorWork&, const Hyper&, int64_t, int64_t);
void accumulate_range_avx512(const TensorWork&, const Hyper&, int64_t, int64_t);

Isa best_isa();
bool isa_supported(Isa isa);
RangeFn range_fn(Isa isa);
RangeFn accumulate_fn(Isa isa);

}  // namespace zf
