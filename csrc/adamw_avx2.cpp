// AVX2 + FMA + F16C variant of the AdamW element loop (8 floats per vector).
// Built on x86 only; elsewhere range_fn never selects it.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstdint>

#include "adamw_kernels.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif

namespace zf {
namespace avx2 {

struct Vec {
  static constexpr int64_t kWidth = 8;
  using T = __m256;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static T load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  }
  // torch's round_to_nearest_even: add 0x7fff plus the lowest kept bit; every NaN -> 0x7fc0.
  static void store_bf16(uint16_t* p, T x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    // Values fit in 16 bits, so the saturating pack only narrows.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i*)p, packed);
  }
  static void store_f16(uint16_t* p, T x) {
    _mm_storeu_si128((__m128i*)p,
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T sqrt(T a) { return _mm256_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
};

}  // namespace avx2
}  // namespace zf

#define ZF_ISA_NS avx2
#include "adamw_kernel_impl.h"
#undef ZF_ISA_NS

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace zf {
void adamw_range_avx2(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  avx2::adamw_range(t, h, begin, end);
}
void accumulate_range_avx2(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  avx2::accumulate_range(t, h, begin, end);
}
}  // namespace zf

#endif  // x86
