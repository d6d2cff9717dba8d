// AVX-512 variant of the AdamW element loop (16 floats per vector).
// Built on x86 only; elsewhere range_fn never selects it.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstdint>

#include "adamw_kernels.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw"))), apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
#pragma GCC optimize("fp-contract=off")
#endif

namespace zf {
namespace avx512 {

struct Vec {
  static constexpr int64_t kWidth = 16;
  using T = __m512;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static T load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
  }
  // torch's round_to_nearest_even: add 0x7fff plus the lowest kept bit; every NaN -> 0x7fc0.
  static void store_bf16(uint16_t* p, T x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(uint16_t* p, T x) {
    _mm256_storeu_si256((__m256i*)p,
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
};

}  // namespace avx512
}  // namespace zf

#define ZF_ISA_NS avx512
#include "adamw_kernel_impl.h"
#undef ZF_ISA_NS

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace zf {
void adamw_range_avx512(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  avx512::adamw_range(t, h, begin, end);
}
void accumulate_range_avx512(const TensorWork& t, const Hyper& h, int64_t begin, int64_t end) {
  avx512::accumulate_range(t, h, begin, end);
}
}  // namespace zf

#endif  // x86
