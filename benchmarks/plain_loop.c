// The plain SIMD loop that benchmarks/cache_suite.py measures rope_ext against (issue 30): what a
// person would write for one layout and nothing else. x (T, H, D) contiguous, half-split pairs
// (i, i + D/2), float32 half-width caches indexed by pos[t], each product and sum rounded once (no
// FMA), D/2 a multiple of the register's float count. out may be x (in place). conj: the transpose
// (backward). Built by cache_suite.py with -O3 -ffp-contract=off and either -mavx2 -mfma (AVX2) or
// -mavx512f -mavx512bw -mavx512bf16 (PLAIN_AVX512: bfloat16 rounded with vcvtneps2bf16).
#include <immintrin.h>
#include <stdint.h>

#ifdef PLAIN_AVX512
typedef __m512 vf;
enum { W = 16 };
#define LOAD _mm512_loadu_ps
#define STORE _mm512_storeu_ps
#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
static inline vf bf16_load(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void bf16_store(uint16_t *p, vf f) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(f)); }
#else
typedef __m256 vf;
enum { W = 8 };
#define LOAD _mm256_loadu_ps
#define STORE _mm256_storeu_ps
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
static inline vf bf16_load(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void bf16_store(uint16_t *p, vf f) {  // round to nearest even; NaN -> quiet NaN
  __m256i i = _mm256_castps_si256(f);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(0x7fff)), lsb);
  __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                           _mm256_castsi256_ps(_mm256_or_si256(i, _mm256_set1_epi32(0x400000))), nan));
  r = _mm256_srli_epi32(r, 16);
  _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

#define ROPE_LOOP(T_, LD, ST)                                                              \
  int h2 = D / 2;                                                                          \
  for (long t = 0; t < T; t++) {                                                           \
    const float *ct = c + pos[t] * h2, *st = s + pos[t] * h2;                              \
    for (int h = 0; h < H; h++) {                                                          \
      const T_ *r = x + (t * H + h) * D;                                                   \
      T_ *o = out + (t * H + h) * D;                                                       \
      for (int i = 0; i < h2; i += W) {                                                    \
        vf a = LD(r + i), b = LD(r + h2 + i), cc = LOAD(ct + i), ss = LOAD(st + i);        \
        vf o1 = conj ? ADD(MUL(a, cc), MUL(b, ss)) : SUB(MUL(a, cc), MUL(b, ss));          \
        vf o2 = conj ? SUB(MUL(b, cc), MUL(a, ss)) : ADD(MUL(b, cc), MUL(a, ss));          \
        ST(o + i, o1);                                                                     \
        ST(o + h2 + i, o2);                                                                \
      }                                                                                    \
    }                                                                                      \
  }

void plain_f32(const float *x, float *out, const float *c, const float *s, const int64_t *pos, long T, int H, int D,
               int conj) {
  ROPE_LOOP(float, LOAD, STORE)
}

void plain_bf16(const uint16_t *x, uint16_t *out, const float *c, const float *s, const int64_t *pos, long T, int H,
                int D, int conj) {
  ROPE_LOOP(uint16_t, bf16_load, bf16_store)
}
