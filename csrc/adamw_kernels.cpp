// Per-run constants and the choice of instruction set.
#include "adamw_kernels.h"

#include <cmath>

namespace zf {

// Scalars are formed in double and rounded to float once, as torch does when it passes Python
// floats to float32 tensor ops; step_size and 1/sqrt(bc2) are rounded separately, not folded.
ElementConsts element_consts(const Hyper& h, int64_t step) {
  ElementConsts c;
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  // torch's lerp(m, g, w) = |w| < 0.5 ? m + w*(g-m) : g + (w-1)*(g-m), as one FMA.
  const float w = static_cast<float>(1.0 - h.beta1);
  c.lerp_from_grad = !(std::fabs(w) < 0.5f);
  c.lerp_coeff = c.lerp_from_grad ? w - 1.0f : w;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.grad_scale = static_cast<float>(h.grad_scale);
  const double s = static_cast<double>(step);
  c.neg_step_size = static_cast<float>(-(h.lr / (1.0 - std::pow(h.beta1, s))));
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, s)));
  return c;
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case kScalar: return true;
#if defined(__x86_64__) || defined(__i386__)
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
    default: return false;
  }
}

Isa best_isa() {
  if (isa_supported(kAvx512)) return kAvx512;
  if (isa_supported(kAvx2)) return kAvx2;
  return kScalar;
}

RangeFn range_fn(Isa isa) {
  switch (isa) {
#if defined(__x86_64__) || defined(__i386__)
    case kAvx512: return adamw_range_avx512;
    case kAvx2: return adamw_range_avx2;
#endif
    default: return adamw_range_scalar;
  }
}

RangeFn accumulate_fn(Isa isa) {
  switch (isa) {
#if defined(__x86_64__) || defined(__i386__)
    case kAvx512: return accumulate_range_avx512;
    case kAvx2: return accumulate_range_avx2;
#endif
    default: return accumulate_range_scalar;
  }
}

}  // namespace zf
