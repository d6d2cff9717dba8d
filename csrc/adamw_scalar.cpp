// Portable scalar variant of the AdamW element loop: the fallback for CPUs without AVX2, and
// the bit-level reference the vector variants are tested against.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adamw_kernels.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace zf {
namespace scalar {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Vec {
  static constexpr int64_t kWidth = 1;
  using T = float;
  static T zero() { return 0.0f; }
  static T set1(float x) { return x; }
  static T load(const float* p) { return *p; }
  static void store(float* p, T x) { *p = x; }
  static T load_bf16(const uint16_t* p) { return bits_float(uint32_t{*p} << 16); }
  static T load_f16(const uint16_t* p) {
    const uint32_t h = *p, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
    const float sub = static_cast<float>(mant) * 0x1p-24f;  // exact: subnormal or zero
    return sign ? -sub : sub;
  }
  // torch's round_to_nearest_even: add 0x7fff plus the lowest kept bit; every NaN -> 0x7fc0.
  static void store_bf16(uint16_t* p, T x) {
    if (std::isnan(x)) {
      *p = 0x7fc0;
      return;
    }
    const uint32_t u = float_bits(x);
    *p = static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7fffu) >> 16);
  }
  // IEEE binary16 with round to nearest even, as F16C's vcvtps2ph (after F. Giesen's
  // float_to_half_fast3_rtne): NaN stays a quiet NaN with the top payload bits.
  static void store_f16(uint16_t* p, T x) {
    uint32_t u = float_bits(x);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint32_t h;
    if (u >= 0x47800000u) {  // >= 2^16: overflows to infinity, or inf/NaN
      h = u > 0x7f800000u ? 0x7e00u | ((u >> 13) & 0x3ffu) : 0x7c00u;
    } else if (u < 0x38800000u) {  // < 2^-14: half subnormal or zero; let the FPU round
      const float magic = bits_float(126u << 23);  // 0.5: aligns the ulp of 2^-24 to bit 0
      h = float_bits(bits_float(u) + magic) - float_bits(magic);
    } else {
      const uint32_t mant_odd = (u >> 13) & 1u;
      u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;
      h = u >> 13;
    }
    *p = static_cast<uint16_t>(h | sign);
  }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T div(T a, T b) { return a / b; }
  static T sqrt(T a) { return std::sqrt(a); }
  static T fma(T a, T b, T c) { return std::fma(a, b, c); }
};

}  // namespace scalar
}  // namespace zf

#define ZF_ISA_NS scalar
#include "adamw_kernel_impl.h"
#undef ZF_ISA_NS

#if !defined(__clang__)
#pragma GCC pop_options
#endif

namespace zf {
void adamw_range_scalar(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  scalar::adamw_range(t, h, begin, end);
}
void accumulate_range_scalar(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  scalar::accumulate_range(t, h, begin, end);
}
}  // namespace zf
