// The AdamW element loop, written once over a vector type `Vec` and compiled once per instruction
// set. Each adamw_<isa>.cpp defines ZF_ISA_NS and `ZF_ISA_NS::Vec` under its target pragma, then
// includes this file; the per-ISA namespace keeps the copies apart (no ODR merging of code built
// for different instruction sets).
//
// Vec provides: kWidth, T, zero, set1, load/store (fp32), load_bf16/load_f16,
// store_bf16/store_f16 (round to nearest even), add, sub, mul, div, sqrt, fma (a*b+c, one
// rounding). Contraction of mul+add into FMA is disabled in these files, so the only fused
// operations are the explicit ones that mirror torch's vectorized lerp and addcmul, and all
// variants round alike.

#include <algorithm>
#include <cstring>

namespace zf {
namespace ZF_ISA_NS {

constexpr int64_t dtype_size(int32_t d) { return d == kF32 ? 4 : 2; }

template <int32_t G>
inline typename Vec::T load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return Vec::load(static_cast<const float*>(g) + i);
  if constexpr (G == kBF16) return Vec::load_bf16(static_cast<const uint16_t*>(g) + i);
  if constexpr (G == kF16) return Vec::load_f16(static_cast<const uint16_t*>(g) + i);
  return Vec::zero();
}

// n is a multiple of Vec::kWidth. The order of operations follows torch's single-tensor AdamW:
//   p *= 1 - lr*wd;  m = fma(w', g - m, m or g) (torch's lerp);
//   v = fma((1-beta2)*g, g, v*beta2) (torch's addcmul);  denom = sqrt(v) * (1/sqrt(bc2)) + eps;
//   p += ((-lr/bc1) * m) / denom (torch's addcdiv)
// so m and v match torch bit for bit. Only denom differs: torch divides by sqrt(bc2); multiplying
// by its reciprocal (at most an ulp apart) leaves one division per element instead of two, and
// the divider is what limits a core that the training thread is also using.
// With an accumulator (the ZenFlow boundary) the gradient is (acc + g) * grad_scale and the
// accumulator is cleared in the same pass.
template <int32_t G, int32_t O, bool kBoundary>
inline void update_block(float* p, const void* g, float* m, float* v, float* acc, void* out,
                         int64_t n, const ElementConsts& c) {
  using T = typename Vec::T;
  const T decay = Vec::set1(c.decay), coeff = Vec::set1(c.lerp_coeff);
  const T beta2 = Vec::set1(c.beta2), one_minus_beta2 = Vec::set1(c.one_minus_beta2);
  const T eps = Vec::set1(c.eps), scale = Vec::set1(c.grad_scale);
  const T neg_step_size = Vec::set1(c.neg_step_size), inv_bc2_sqrt = Vec::set1(c.inv_bc2_sqrt);
  for (int64_t i = 0; i < n; i += Vec::kWidth) {
    T grad = load_grad<G>(g, i);
    if constexpr (kBoundary) {
      const T a = Vec::load(acc + i);
      grad = G == kNone ? a : Vec::add(a, grad);
      Vec::store(acc + i, Vec::zero());
    }
    grad = Vec::mul(grad, scale);
    T param = Vec::mul(Vec::load(p + i), decay);
    T exp_avg = Vec::load(m + i);
    const T base = c.lerp_from_grad ? grad : exp_avg;
    exp_avg = Vec::fma(coeff, Vec::sub(grad, exp_avg), base);
    const T decayed_sq = Vec::mul(Vec::load(v + i), beta2);
    const T exp_avg_sq = Vec::fma(Vec::mul(one_minus_beta2, grad), grad, decayed_sq);
    const T denom = Vec::add(Vec::mul(Vec::sqrt(exp_avg_sq), inv_bc2_sqrt), eps);
    param = Vec::add(param, Vec::div(Vec::mul(neg_step_size, exp_avg), denom));
    Vec::store(p + i, param);
    Vec::store(m + i, exp_avg);
    Vec::store(v + i, exp_avg_sq);
    if constexpr (O == kF32) Vec::store(static_cast<float*>(out) + i, param);
    if constexpr (O == kBF16) Vec::store_bf16(static_cast<uint16_t*>(out) + i, param);
    if constexpr (O == kF16) Vec::store_f16(static_cast<uint16_t*>(out) + i, param);
  }
}

// Elements [begin, begin + n) of one tensor with one set of constants. The tail that does not
// fill a vector runs through the same vector code on a zero-padded copy.
template <int32_t G, int32_t O, bool kBoundary>
void update_run(const TensorWork& t, int64_t begin, int64_t n, const ElementConsts& c) {
  constexpr int64_t W = Vec::kWidth;
  float* p = t.param + begin;
  float* m = t.exp_avg + begin;
  float* v = t.exp_avg_sq + begin;
  float* acc = kBoundary ? t.accumulator + begin : nullptr;
  const void* g = G == kNone
                      ? nullptr
                      : static_cast<const char*>(t.grad) + grad_index(t, begin) * dtype_size(G);
  void* out = O == kNone ? nullptr : static_cast<char*>(t.out) + begin * dtype_size(O);

  const int64_t body = n - n % W;
  update_block<G, O, kBoundary>(p, g, m, v, acc, out, body, c);
  const int64_t rem = n - body;
  if (rem == 0) return;

  alignas(64) float tp[W] = {}, tm[W] = {}, tv[W] = {}, tacc[W] = {};
  alignas(64) char tg[W * 4] = {}, tout[W * 4] = {};
  const size_t f = rem * sizeof(float);
  std::memcpy(tp, p + body, f);
  std::memcpy(tm, m + body, f);
  std::memcpy(tv, v + body, f);
  if constexpr (kBoundary) std::memcpy(tacc, acc + body, f);
  if constexpr (G != kNone) {
    std::memcpy(tg, static_cast<const char*>(g) + body * dtype_size(G), rem * dtype_size(G));
  }
  update_block<G, O, kBoundary>(tp, tg, tm, tv, tacc, tout, W, c);
  std::memcpy(p + body, tp, f);
  std::memcpy(m + body, tm, f);
  std::memcpy(v + body, tv, f);
  if constexpr (kBoundary) std::memcpy(acc + body, tacc, f);
  if constexpr (O != kNone) {
    std::memcpy(static_cast<char*>(out) + body * dtype_size(O), tout, rem * dtype_size(O));
  }
}

// Splits [begin, end) into runs of equal step count (consecutive segments with the same step
// share one run), so per-column steps cost one constant computation per change of step; with
// gathered gradient rows a run also ends where its gradient row does.
template <int32_t G, int32_t O, bool kBoundary>
void update_range(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  const int64_t len = t.segment_len;
  int64_t cached_step = -1;
  ElementConsts c{};
  for (int64_t i = begin; i < end;) {
    int64_t step = t.step, run_end = end;
    if (t.segment_steps != nullptr) {
      step = t.segment_steps[i / len];
      run_end = std::min(end, (i / len + 1) * len);
      while (run_end < end && t.segment_steps[run_end / len] == step) {
        run_end = std::min(end, run_end + len);
      }
    }
    if (G != kNone) run_end = contiguous_grad_end(t, i, run_end);
    if (step != cached_step) {
      c = element_consts(h, step);
      cached_step = step;
    }
    update_run<G, O, kBoundary>(t, i, run_end - i, c);
    i = run_end;
  }
}

template <int32_t G, int32_t O>
void dispatch_boundary(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  if (t.accumulator != nullptr) {
    update_range<G, O, true>(t, h, begin, end);
  } else if constexpr (G != kNone) {
    update_range<G, O, false>(t, h, begin, end);
  }
}

template <int32_t G>
void dispatch_out(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  switch (t.out == nullptr ? kNone : t.out_dtype) {
    case kF32: return dispatch_boundary<G, kF32>(t, h, begin, end);
    case kBF16: return dispatch_boundary<G, kBF16>(t, h, begin, end);
    case kF16: return dispatch_boundary<G, kF16>(t, h, begin, end);
    default: return dispatch_boundary<G, kNone>(t, h, begin, end);
  }
}

// Argument combinations are validated at submission (cpu_adam_api.cpp).
inline void adamw_range(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  switch (t.grad == nullptr ? kNone : t.grad_dtype) {
    case kF32: return dispatch_out<kF32>(t, h, begin, end);
    case kBF16: return dispatch_out<kBF16>(t, h, begin, end);
    case kF16: return dispatch_out<kF16>(t, h, begin, end);
    default: return dispatch_out<kNone>(t, h, begin, end);
  }
}

// The window's sum: acc += grad_scale * g, as torch's vectorized add_(g, alpha=grad_scale)
// (one FMA), so a sum built here equals one built with torch on the training thread.
template <int32_t G>
inline void accumulate_block(float* acc, const void* g, int64_t n, float scale) {
  const typename Vec::T s = Vec::set1(scale);
  for (int64_t i = 0; i < n; i += Vec::kWidth) {
    Vec::store(acc + i, Vec::fma(load_grad<G>(g, i), s, Vec::load(acc + i)));
  }
}

template <int32_t G>
void accumulate_run(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  constexpr int64_t W = Vec::kWidth;
  const float scale = static_cast<float>(h.grad_scale);
  float* acc = t.accumulator + begin;
  const void* g = static_cast<const char*>(t.grad) + grad_index(t, begin) * dtype_size(G);
  const int64_t n = end - begin, body = n - n % W, rem = n - body;
  accumulate_block<G>(acc, g, body, scale);
  if (rem == 0) return;
  alignas(64) float tacc[W] = {};
  alignas(64) char tg[W * 4] = {};
  std::memcpy(tacc, acc + body, rem * sizeof(float));
  std::memcpy(tg, static_cast<const char*>(g) + body * dtype_size(G), rem * dtype_size(G));
  accumulate_block<G>(tacc, tg, W, scale);
  std::memcpy(acc + body, tacc, rem * sizeof(float));
}

template <int32_t G>
void accumulate_rows(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end;) {
    const int64_t run_end = contiguous_grad_end(t, i, end);
    accumulate_run<G>(t, h, i, run_end);
    i = run_end;
  }
}

inline void accumulate_range(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  switch (t.grad_dtype) {
    case kBF16: return accumulate_rows<kBF16>(t, h, begin, end);
    case kF16: return accumulate_rows<kF16>(t, h, begin, end);
    default: return accumulate_rows<kF32>(t, h, begin, end);
  }
}

}  // namespace ZF_ISA_NS
}  // namespace zf
