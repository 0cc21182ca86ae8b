// Small-row GEMM over a GGUF file's own quantised blocks, for verifying drafted tokens.
//
// Why this exists: llama.cpp's CPU kernels decode one token at memory speed but are bound by
// arithmetic from two rows on (on two Zen 4 cores T(2) = 1.62 T(1), T(8) = 5.65 T(1)), so
// verifying a draft costs nearly as many decode steps as it verifies. Here each 256-weight
// super-block is unpacked once and multiplied with every row of the pass (up to 8 at a time)
// using integer dot products, so k rows cost little more than reading the weight once.
//
// Layouts. Two, by how finely a file's weights are scaled:
// - per 32 weights (Q4_K, Q5_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): two consecutive super-blocks
//   (512 weights) go together, lane l (0..15) of a 512-bit register holding the 32 weights
//   32 l .. 32 l + 31, one sub-block with one scale, four per register c (0..7): register c,
//   byte 4 l + i is weight 32 l + 4 c + i, for the codes and the activations alike. Eight VNNI
//   dot products leave each lane its sub-block's exact sum, and one float part (convert, scale,
//   two multiply-adds) serves both super-blocks: per row and block 4 dot products and half a
//   float part, where 16-weight lanes paid a whole one (once a pass is bound by arithmetic,
//   the float part shares the dot products' pipes). A row of an odd number of super-blocks
//   ends with its last one alone: 8 lanes, registers of 32 bytes.
// - per 16 weights (Q6_K): one super-block, lane l holding the 16 weights 16 l .. 16 l + 15,
//   register c (0..3), byte 4 l + i is weight 16 l + 4 c + i; four dot products leave each lane
//   one scale's exact sum.
// Paths: AVX-512 VNNI (above); AVX2 (the same lanes in two 256-bit halves, maddubs + madd for
// the dot products: the same bits, tested); a portable loop with the same integer arithmetic.
//
// Numerics (the same for every row count, so speculation stays lossless):
// - activations: per row, per 32 inputs, rounded to int8 with scale amax / 127 (llama.cpp's
//   Q8_0 rule; per 256 inputs, its Q8_K rule, lost 0.04 nats a token on the bundled 135M
//   model), plus the sums per lane (32 or 16 inputs) for the affine "min" term;
// - weights: the file's codes and 6-bit sub-block scales as integers, exactly; d and dmin as
//   fp32 (exact: they are fp16 in the file);
// - per lane, the integer dot products are exact (int32); each row accumulates
//   d * sc * da * isum and dmin * m * da * asum into its own float lanes in block order,
//   whatever the number of rows in the call, and reduces them in a fixed order at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr int QK = 256;  // weights per super-block
constexpr int QA = 32;   // inputs per activation scale
constexpr int MAX_ROWS = 8;
constexpr int64_t PF_BLOCKS = 8;  // software prefetch distance, in super-blocks

// Per row and 32 inputs: int8 codes, fp32 scale, int16 sums of 16 codes. Rounding is to
// nearest even (the default mode) in both paths, so they give the same codes.
// An all-zero block: scale 0, codes and sums 0 (no division by amax).
inline void zero_block(int8_t* qb, float* d, int16_t* sb) {
  *d = 0.f;
  std::memset(qb, 0, QA);
  std::memset(sb, 0, QA / 16 * sizeof(int16_t));
}

void quantize_block_scalar(const float* xb, int8_t* qb, float* d, int16_t* sb) {
  float amax = 0.f;
  for (int i = 0; i < QA; ++i) amax = std::max(amax, std::fabs(xb[i]));
  if (amax == 0.f) return zero_block(qb, d, sb);
  const float iscale = 127.f / amax;
  for (int i = 0; i < QA; ++i) {
    int v = static_cast<int>(std::nearbyint(xb[i] * iscale));
    qb[i] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
  }
  for (int h = 0; h < QA / 16; ++h) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += qb[h * 16 + i];
    sb[h] = static_cast<int16_t>(s);
  }
  *d = 1.f / iscale;
}

#define KQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define KQ_AVX2 __attribute__((target("avx2,fma,f16c")))

KQ_TARGET void quantize_block_avx512(const float* xb, int8_t* qb, float* d, int16_t* sb) {
  __m512 vmax = _mm512_setzero_ps();
  for (int i = 0; i < QA; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  if (amax == 0.f) return zero_block(qb, d, sb);
  const float iscale = 127.f / amax;
  const __m512 vs = _mm512_set1_ps(iscale);
  alignas(64) int32_t sums[QA / 16];
  for (int h = 0; h < QA / 16; ++h) {
    // |x * iscale| <= 127 up to rounding of the product; clamp as the scalar path does
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), vs));
    v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * h), _mm512_cvtepi32_epi8(v));
    sums[h] = _mm512_reduce_add_epi32(v);
  }
  for (int h = 0; h < QA / 16; ++h) sb[h] = static_cast<int16_t>(sums[h]);
  *d = 1.f / iscale;
}

// Natural order -> a lane layout: ``nl`` lanes of ``per`` weights, register c (of per / 4,
// 4 * nl bytes each), byte 4 l + i <- weight per * l + 4 c + i. Q6_K: 16 lanes of 16; the
// paired kinds: 16 lanes of 32 for a pair of blocks, 8 for a row's last block alone.
inline void to_lanes(const int8_t* natural, int8_t* lanes, int nl, int per) {
  for (int l = 0; l < nl; ++l)
    for (int c = 0; c < per / 4; ++c)
      std::memcpy(lanes + 4 * nl * c + 4 * l, natural + per * l + 4 * c, 4);
}

bool have_avx512();

void quantize_block_avx2(const float* xb, int8_t* qb, float* d, int16_t* sb);

// The kernels, fastest first; each machine uses the best it has, unless a test asks.
enum Path : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// One 32-input block on a path (each gives the same codes, scale and sums).
inline void quantize_block(int path, const float* xb, int8_t* qb, float* d, int16_t* sb) {
  if (path == kAvx512) quantize_block_avx512(xb, qb, d, sb);
  else if (path == kAvx2) quantize_block_avx2(xb, qb, d, sb);
  else quantize_block_scalar(xb, qb, d, sb);
}

// The activations of the Q6_K kernels, per row: the codes in the lane layout, each 16-input
// group's activation scale ``d`` (its 32-input block's, stored twice so the kernel loads one
// lane's worth with one instruction) and ``u`` = d * (sum of its 16 codes), the factor of the
// "min" term, so the kernel pays one multiply-add per row and block for it.
// Q6_K rows are whole blocks (``x`` is ``k`` wide: the kernel refuses anything else).
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int16_t* bs,
                   float* u, int path) {
  const int64_t nb = k / QK;
  alignas(64) int8_t natural[QK];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = r * (k / 16) + b * 16;
      const float* xb = x + r * k + b * QK;
      for (int j = 0; j < QK / QA; ++j) {
        float dj = 0.f;
        quantize_block(path, xb + j * QA, natural + j * QA, &dj, bs + g + j * (QA / 16));
        for (int h = 0; h < QA / 16; ++h) d[g + j * (QA / 16) + h] = dj;
      }
      to_lanes(natural, q + r * k + b * QK, 16, 16);
      for (int h = 0; h < 16; ++h) u[g + h] = d[g + h] * static_cast<float>(bs[g + h]);
    }
}

// The activations of the paired kernels: per row and 512 inputs the codes in the paired
// layout, and per 32 inputs (one lane) the scale ``d`` and ``u`` = d * (sum of its codes).
// The codes and scales are those of ``quantize_rows`` (the same rounding); only their order and
// the width of the sums differ.
void quantize_rows_paired(const float* x, int64_t rows, int64_t k_in, int64_t k, int8_t* q,
                          float* d, float* u, int path) {
  constexpr int QP = 2 * QK;
  const int64_t nu = (k / QK + 1) / 2;  // pairs, and a last single block where the count is odd
  alignas(64) int8_t natural[QP];
  alignas(64) float tail[QP];
  int16_t sb[QA / 16];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < nu; ++p) {
      const int64_t width = std::min<int64_t>(QP, k - p * QP);  // 512, or 256 for a last block
      const int64_t g = r * (k / QA) + p * (QP / QA);
      const float* xb = x + r * k_in + p * QP;
      if (p * QP + width > k_in) {  // the last, partly padded unit
        const int64_t have = std::max<int64_t>(0, k_in - p * QP);
        std::fill(tail, tail + QP, 0.f);
        std::memcpy(tail, xb, sizeof(float) * have);
        xb = tail;
      }
      for (int j = 0; j < width / QA; ++j) {
        float dj = 0.f;
        quantize_block(path, xb + j * QA, natural + j * QA, &dj, sb);
        d[g + j] = dj;
        u[g + j] = dj * static_cast<float>(sb[0] + sb[1]);
      }
      to_lanes(natural, q + r * k + p * QP, static_cast<int>(width / QA), 32);
    }
}

// Weight formats. Q4_K, Q6_K and Q5_K are the file's super-blocks (codes repacked into the lane
// layouts, scales as integers); the "lane-scaled" kinds carry one fp16 scale d and one fp16
// offset m per 32 weights, w = d * code + m, which holds the 32-weight GGUF blocks exactly
// (Q4_0: code q, m = -8 d; Q4_1: q and its m; Q5_0/Q5_1 likewise with 5-bit codes; Q8_0: q + 128,
// m = -128 d; the offsets are powers of two times d, so exact in fp16).
enum Kind : int {
  kQ4K = 0,  // 4-bit codes, meta sc[8], m[8] (u8), fp16 d and dmin per block
  kQ6K = 1,  // 6-bit codes, meta int8 sc[16], fp16 d
  kQ5K = 2,  // 5-bit codes in the 6-bit layout, meta as Q4_K
  kL4 = 3,   // 4-bit codes, meta fp16 d[8], m[8] per 256-block (32 bytes)
  kL5 = 4,   // 5-bit codes in the 6-bit layout, meta as kL4
  kL8 = 5,   // 8-bit codes (unsigned), meta as kL4
};
constexpr int kLastKind = kL8;
constexpr bool high_bits(int K) { return K == kQ6K || K == kQ5K || K == kL5; }
constexpr int64_t code_stride(int K) { return K == kL8 ? 256 : high_bits(K) ? 192 : 128; }
constexpr int64_t meta_stride(int K) { return K >= kL4 ? 32 : 16; }
constexpr bool lane_scaled(int K) { return K >= kL4; }
constexpr bool paired(int K) { return K != kQ6K; }  // scaled per 32: the paired layout

struct Weights {
  // Per output channel, its blocks in order, ``code_stride`` bytes each; a paired kind's two
  // blocks of a pair are one unit of twice that. Q6_K, [N, nb, 192]: 128 bytes of nibbles
  // (registers 0, 1 the low and high nibbles of bytes 0-63, 2, 3 those of bytes 64-127), then
  // 64 bytes whose bits 2c, 2c + 1 hold register c's high 2 bits. A pair of a paired kind,
  // registers of 64 bytes: 4-bit, registers 2 j, 2 j + 1 the low and high nibbles of bytes
  // 64 j .. 64 j + 63; 5-bit, those 256 bytes, then 128 whose first 64 hold registers 0-3's
  // high bits (bits 2c, 2c + 1) and the next 64 registers 4-7's; 8-bit, register c at byte
  // 64 c. A row's last block alone (an odd count): the same with registers of 32 bytes.
  // Meta, ``meta_stride`` bytes a block: Q6_K its 16 int8 scales; a pair of Q4_K/Q5_K blocks
  // sc[16] then m[16] (both blocks' 8 each); a pair of lane-scaled blocks d[16] then m[16]
  // (fp16); a last single block its own sc[8], m[8] or d[8], m[8].
  const uint8_t* codes;
  const uint8_t* meta;   // [N, nb, meta_stride]
  const uint16_t* d;     // [N, nb] fp16, as in the file (K-quants)
  const uint16_t* dmin;  // [N, nb] fp16 (Q4_K, Q5_K)
  int64_t nb;
};

struct Acts {
  const int8_t* q;
  const float* d;  // per lane: 16 inputs (each 32-input block's scale twice) or 32 (paired)
  const int16_t* bs;  // per 16 inputs (the Q6_K kernels)
  const float* u;  // d * the lane's sum of codes
  int64_t k;
};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mant;
      do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One code of a Q6_K block in its lane layout: register c (0..3), byte j (= 4 l + i).
inline int q6_code_at(const uint8_t* codes, int c, int j) {
  const uint8_t byte = codes[(c / 2) * 64 + j];
  const int code = (c % 2) ? (byte >> 4) : (byte & 15);
  return code | (((codes[128 + j] >> (2 * c)) & 3) << 4);
}

// One code of a pair of blocks in the paired layout (``reg`` 64: registers of 64 bytes; a
// row's last single block: 32): register c (0..7), byte j (= 4 l + i).
template <int K>
inline int pair_code_at(const uint8_t* codes, int c, int j, int reg) {
  if (K == kL8) return codes[reg * c + j];
  const uint8_t byte = codes[(c / 2) * reg + j];
  int code = (c % 2) ? (byte >> 4) : (byte & 15);
  if (high_bits(K)) code |= ((codes[4 * reg + reg * (c / 4) + j] >> (2 * (c % 4))) & 3) << 4;
  return code;
}

// Portable references with the same integer arithmetic, for CPUs without AVX2 (slow; their
// float accumulation order differs from the SIMD paths, so one machine always uses one path).
void q6_scalar(const Weights& w, const Acts& a, int64_t rows, int64_t n0, int64_t n1, float* y,
               int64_t n_out) {
  const int64_t nb = w.nb;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f, msum = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t blk = n * nb + b;
        const uint8_t* meta = w.meta + blk * meta_stride(kQ6K);
        const uint8_t* codes = w.codes + blk * code_stride(kQ6K);
        const int8_t* qa = a.q + r * a.k + b * QK;
        const int16_t* bs = a.bs + r * (a.k / 16) + b * 16;
        const float* da = a.d + r * (a.k / 16) + b * 16;  // per 16 inputs
        const float dw = half_to_float(w.d[blk]);
        for (int l = 0; l < 16; ++l) {
          int32_t dot = 0;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) dot += q6_code_at(codes, c, 4 * l + i) * qa[64 * c + 4 * l + i];
          const int sc = static_cast<int8_t>(meta[l]);
          sum += static_cast<float>(sc * dot) * (dw * da[l]);
          msum += static_cast<float>(32 * sc * bs[l]) * (dw * da[l]);
        }
      }
      y[r * n_out + n] = sum - msum;
    }
  }
}

template <int K>
void pairs_scalar(const Weights& w, const Acts& a, int64_t rows, int64_t n0, int64_t n1, float* y,
                  int64_t n_out) {
  const int64_t nb = w.nb, ka = a.k / QA;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t b = 0; b < nb; b += 2) {
        const int64_t blk = n * nb + b;
        const int nl = b + 1 < nb ? 16 : 8;  // lanes: a pair, or the row's last single block
        const uint8_t* codes = w.codes + blk * code_stride(K);
        const uint8_t* meta = w.meta + blk * meta_stride(K);
        const int8_t* qa = a.q + r * a.k + b * QK;
        const float* da = a.d + r * ka + b * 8;  // per 32 inputs
        const float* u = a.u + r * ka + b * 8;
        for (int l = 0; l < nl; ++l) {
          int32_t dot = 0;
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 4; ++i)
              dot += pair_code_at<K>(codes, c, 4 * l + i, 4 * nl) * qa[4 * nl * c + 4 * l + i];
          float dsc, vmin;
          if (lane_scaled(K)) {
            const uint16_t* h = reinterpret_cast<const uint16_t*>(meta);
            dsc = half_to_float(h[l]);
            vmin = half_to_float(h[nl + l]);
          } else {
            dsc = static_cast<float>(meta[l]) * half_to_float(w.d[blk + l / 8]);
            vmin = static_cast<float>(meta[nl + l]) * -half_to_float(w.dmin[blk + l / 8]);
          }
          sum += static_cast<float>(dot) * dsc * da[l] + u[l] * vmin;
        }
      }
      y[r * n_out + n] = sum;
    }
  }
}

KQ_TARGET inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// The hardware prefetcher alone left the 1-2 row passes short of memory speed: fetch the codes
// a few blocks ahead (the blocks of one output channel are contiguous).
inline void prefetch(const uint8_t* codes, int64_t at, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(codes + at);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
}

// R rows (1..8) against output channels [n0, n1) of Q6_K blocks: every block is unpacked once.
template <int R>
KQ_TARGET void q6_avx512(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y,
                         int64_t n_out) {
  constexpr int64_t stride = code_stride(kQ6K);
  const int64_t nb = w.nb;
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  for (int64_t n = n0; n < n1; ++n) {
    __m512 facc[R];
    for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = n * nb + b;
      prefetch(w.codes, (blk + PF_BLOCKS) * stride, stride);
      const uint8_t* p = w.codes + blk * stride;
      const __m512i v0 = _mm512_loadu_si512(p);
      const __m512i v1 = _mm512_loadu_si512(p + 64);
      const __m512i hb = _mm512_loadu_si512(p + 128);
      const __m512i c0 = _mm512_or_si512(_mm512_and_si512(v0, low4),
                                         _mm512_and_si512(_mm512_slli_epi16(hb, 4), two));
      const __m512i c1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low4),
                                         _mm512_and_si512(_mm512_slli_epi16(hb, 2), two));
      const __m512i c2 = _mm512_or_si512(_mm512_and_si512(v1, low4), _mm512_and_si512(hb, two));
      const __m512i c3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), low4),
                                         _mm512_and_si512(_mm512_srli_epi16(hb, 2), two));
      // per block, for every row: the scale of each lane's sum, and the factor of its "min"
      // term (the codes' offset 32, multiplied by da * the lane's activation sum)
      const __m512i sc = _mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.meta + blk * 16)));
      const float dw = _cvtsh_ss(w.d[blk]);
      const __m512 dsc = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(dw));
      const __m512 vmin =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_slli_epi32(sc, 5)), _mm512_set1_ps(-dw));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* qa = a.q + r * a.k + b * QK;
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0, _mm512_loadu_si512(qa));
        acc = _mm512_dpbusd_epi32(acc, c1, _mm512_loadu_si512(qa + 64));
        acc = _mm512_dpbusd_epi32(acc, c2, _mm512_loadu_si512(qa + 128));
        acc = _mm512_dpbusd_epi32(acc, c3, _mm512_loadu_si512(qa + 192));
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), dsc);
        facc[r] = _mm512_fmadd_ps(t, _mm512_loadu_ps(a.d + r * (a.k / 16) + b * 16), facc[r]);
        const __m512 u = _mm512_loadu_ps(a.u + r * (a.k / 16) + b * 16);
        facc[r] = _mm512_fmadd_ps(u, vmin, facc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = hsum512(facc[r]);
  }
}

// 256-bit pieces shared by the AVX2 kernel and the AVX-512 kernel's last single block.
KQ_AVX2 inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The eight code registers of one block of a paired kind as 256-bit halves: ``reg`` is the
// bytes of one register in memory (64 in a pair, whose block b + 1 is at byte offset ``o`` 32;
// 32 for a row's last single block).
template <int K>
KQ_AVX2 inline void codes8_256(const uint8_t* p, int reg, int o, __m256i* c) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
  if (K == kL8) {
    for (int i = 0; i < 8; ++i) c[i] = load256(p + reg * i + o);
  } else {
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load256(p + reg * j + o);
      c[2 * j] = _mm256_and_si256(v, low4);
      c[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
  }
  if (high_bits(K)) {
    for (int h = 0; h < 2; ++h) {
      const __m256i hb = load256(p + 4 * reg + reg * h + o);
      __m256i* q = c + 4 * h;
      q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), two));
      q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), two));
      q[2] = _mm256_or_si256(q[2], _mm256_and_si256(hb, two));
      q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), two));
    }
  }
}

// One block's lane scales and min factors (8 lanes): ``meta`` at its d (or sc) and ``mo``
// bytes further its m; ``blk`` the block, for the K-quants' d and dmin.
template <int K>
KQ_AVX2 inline void scales8_256(const Weights& w, const uint8_t* meta, int mo, int64_t blk,
                                __m256* dsc, __m256* vmin) {
  if (lane_scaled(K)) {
    *dsc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta)));
    *vmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + mo)));
  } else {
    const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta)));
    const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + mo)));
    *dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), _mm256_set1_ps(_cvtsh_ss(w.d[blk])));
    *vmin = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(-_cvtsh_ss(w.dmin[blk])));
  }
}

// R rows (1..8) against output channels [n0, n1) of a paired kind: every pair of blocks is
// unpacked once.
template <int R, int K>
KQ_TARGET void pairs_avx512(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y,
                            int64_t n_out) {
  constexpr int64_t stride = code_stride(K);
  const int64_t nb = w.nb, ka = a.k / QA;
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  for (int64_t n = n0; n < n1; ++n) {
    __m512 facc[R];
    for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b + 1 < nb; b += 2) {
      const int64_t blk = n * nb + b;
      prefetch(w.codes, (blk + PF_BLOCKS) * stride, 2 * stride);
      const uint8_t* p = w.codes + blk * stride;
      __m512i c[8];
      if (K == kL8) {
        for (int i = 0; i < 8; ++i) c[i] = _mm512_loadu_si512(p + 64 * i);
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(p + 64 * j);
          c[2 * j] = _mm512_and_si512(v, low4);
          c[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
      }
      if (high_bits(K)) {
        for (int h = 0; h < 2; ++h) {
          const __m512i hb = _mm512_loadu_si512(p + 256 + 64 * h);
          __m512i* q = c + 4 * h;
          q[0] = _mm512_or_si512(q[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), two));
          q[1] = _mm512_or_si512(q[1], _mm512_and_si512(_mm512_slli_epi16(hb, 2), two));
          q[2] = _mm512_or_si512(q[2], _mm512_and_si512(hb, two));
          q[3] = _mm512_or_si512(q[3], _mm512_and_si512(_mm512_srli_epi16(hb, 2), two));
        }
      }
      // per pair, for every row: the scale of each lane's sum and the factor of its "min"
      // term (multiplied by da * the lane's activation sum); lanes 0-7 are block b's
      const uint8_t* meta = w.meta + blk * meta_stride(K);
      __m512 dsc, vmin;
      if (lane_scaled(K)) {
        dsc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
        vmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32)));
      } else {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta)));
        const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16)));
        const __m512 dv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(_cvtsh_ss(w.d[blk])),
                                               _mm512_set1_ps(_cvtsh_ss(w.d[blk + 1])));
        const __m512 mv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(-_cvtsh_ss(w.dmin[blk])),
                                               _mm512_set1_ps(-_cvtsh_ss(w.dmin[blk + 1])));
        dsc = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), dv);
        vmin = _mm512_mul_ps(_mm512_cvtepi32_ps(m), mv);
      }
      // registers outer, rows inner: the rows' dot products are independent, so a pass's rows
      // fill the pipes while each one's chain waits; up to four rows split theirs in two
      // (integer sums: the same bits either way)
      constexpr int NA = R <= 4 ? 2 : 1;
      __m512i acc[R * NA];
      for (int j = 0; j < R * NA; ++j) acc[j] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int j = r * NA + (NA == 2 ? i / 4 : 0);
          acc[j] = _mm512_dpbusd_epi32(acc[j], c[i], _mm512_loadu_si512(a.q + r * a.k + b * QK + 64 * i));
        }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i sum = NA == 2 ? _mm512_add_epi32(acc[2 * r], acc[2 * r + 1]) : acc[r];
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dsc);
        facc[r] = _mm512_fmadd_ps(t, _mm512_loadu_ps(a.d + r * ka + b * 8), facc[r]);
        facc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(a.u + r * ka + b * 8), vmin, facc[r]);
      }
    }
    if (nb % 2) {
      // the row's last block alone, in 32-byte registers: its 8 lanes go into lanes 0-7,
      // with the instructions of the AVX2 kernel's first half (the same bits)
      const int64_t b = nb - 1, blk = n * nb + b;
      __m256i c[8];
      codes8_256<K>(w.codes + blk * stride, 32, 0, c);
      __m256 dsc, vmin;
      scales8_256<K>(w, w.meta + blk * meta_stride(K), meta_stride(K) / 2, blk, &dsc, &vmin);
      // 256-bit dot products issue two a cycle: fewer rows split their chains further
      constexpr int NT = R <= 2 ? 4 : R <= 4 ? 2 : 1;
      __m256i acc[R * NT];
      for (int j = 0; j < R * NT; ++j) acc[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int j = r * NT + i % NT;
          acc[j] = _mm256_dpbusd_epi32(acc[j], c[i], load256(a.q + r * a.k + b * QK + 32 * i));
        }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i sum = acc[r * NT];
        for (int j = 1; j < NT; ++j) sum = _mm256_add_epi32(sum, acc[r * NT + j]);
        const __m512 t = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), dsc));
        const __m512 da = _mm512_castps256_ps512(_mm256_loadu_ps(a.d + r * ka + b * 8));
        const __m512 u = _mm512_castps256_ps512(_mm256_loadu_ps(a.u + r * ka + b * 8));
        facc[r] = _mm512_mask3_fmadd_ps(t, da, facc[r], 0x00FF);
        facc[r] = _mm512_mask3_fmadd_ps(u, _mm512_castps256_ps512(vmin), facc[r], 0x00FF);
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = hsum512(facc[r]);
  }
}

// AVX2 (no AVX-512, no VNNI): the same rounding as the other paths (cvtps rounds to nearest
// even, as nearbyint does), so every path gives the same int8 codes.
KQ_AVX2 void quantize_block_avx2(const float* xb, int8_t* qb, float* d, int16_t* sb) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int i = 0; i < QA; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  alignas(32) float m8[8];
  _mm256_store_ps(m8, vmax);
  float amax = 0.f;
  for (int i = 0; i < 8; ++i) amax = std::max(amax, m8[i]);
  if (amax == 0.f) return zero_block(qb, d, sb);
  const float iscale = 127.f / amax;
  const __m256 vs = _mm256_set1_ps(iscale);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  alignas(32) int32_t v8[8];
  for (int h = 0; h < QA / 16; ++h) {
    int s = 0;
    for (int half = 0; half < 2; ++half) {
      const int off = 16 * h + 8 * half;
      __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + off), vs));
      v = _mm256_max_epi32(_mm256_min_epi32(v, hi), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(v8), v);
      for (int i = 0; i < 8; ++i) {
        qb[off + i] = static_cast<int8_t>(v8[i]);
        s += v8[i];
      }
    }
    sb[h] = static_cast<int16_t>(s);
  }
  *d = 1.f / iscale;
}

// The AVX-512 kernels' lanes split in two 256-bit halves (lanes 0-7, 8-15): the same layouts,
// the same exact integer dot products (maddubs pairs then madd; the 16-bit partial sums stay
// below 32767: 4-bit codes' eight pair sums below 8 * 2 * 15 * 127, 5-bit codes' four below
// 4 * 2 * 31 * 127, Q6_K's two below 2 * 2 * 63 * 127; 8-bit codes, whose pairs could
// saturate, go as 2 * (code >> 1) + (code & 1)), the same per-lane float accumulation, and the
// final sum adds the halves first, as the AVX-512 reduction does.
KQ_AVX2 inline float hsum_halves(__m256 h0, __m256 h1) {
  const __m256 s8 = _mm256_add_ps(h0, h1);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}

template <int R>
KQ_AVX2 void q6_avx2(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y,
                     int64_t n_out) {
  constexpr int64_t stride = code_stride(kQ6K);
  const int64_t nb = w.nb;
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 facc[R][2];
    for (int r = 0; r < R; ++r) facc[r][0] = facc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = n * nb + b;
      prefetch(w.codes, (blk + PF_BLOCKS) * stride, stride);
      const uint8_t* p = w.codes + blk * stride;
      const uint8_t* meta = w.meta + blk * meta_stride(kQ6K);
      const float dw = _cvtsh_ss(w.d[blk]);
      for (int half = 0; half < 2; ++half) {
        const int o = 32 * half;  // byte offset of this half within each 64-byte register
        const __m256i v0 = load256(p + o), v1 = load256(p + 64 + o), hb = load256(p + 128 + o);
        const __m256i c0 = _mm256_or_si256(_mm256_and_si256(v0, low4),
                                           _mm256_and_si256(_mm256_slli_epi16(hb, 4), two));
        const __m256i c1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
                                           _mm256_and_si256(_mm256_slli_epi16(hb, 2), two));
        const __m256i c2 = _mm256_or_si256(_mm256_and_si256(v1, low4), _mm256_and_si256(hb, two));
        const __m256i c3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4),
                                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), two));
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 8 * half)));
        const __m256 dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), _mm256_set1_ps(dw));
        const __m256 vmin =
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_slli_epi32(sc, 5)), _mm256_set1_ps(-dw));
        for (int r = 0; r < R; ++r) {
          const int8_t* qa = a.q + r * a.k + b * QK + o;
          const __m256i p0 = _mm256_maddubs_epi16(c0, load256(qa));
          const __m256i p1 = _mm256_maddubs_epi16(c1, load256(qa + 64));
          const __m256i p2 = _mm256_maddubs_epi16(c2, load256(qa + 128));
          const __m256i p3 = _mm256_maddubs_epi16(c3, load256(qa + 192));
          const __m256i acc = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones),
                                               _mm256_madd_epi16(_mm256_add_epi16(p2, p3), ones));
          const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), dsc);
          const int64_t g = r * (a.k / 16) + b * 16 + 8 * half;
          facc[r][half] = _mm256_fmadd_ps(t, _mm256_loadu_ps(a.d + g), facc[r][half]);
          facc[r][half] = _mm256_fmadd_ps(_mm256_loadu_ps(a.u + g), vmin, facc[r][half]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = hsum_halves(facc[r][0], facc[r][1]);
  }
}

// One row's exact integer dot products, per lane, with one block's eight code registers:
// ``qa`` at the row's codes of that block (half), ``reg`` bytes apart.
template <int K>
KQ_AVX2 inline __m256i dot8_256(const __m256i* c, const int8_t* qa, int reg) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (K == kL8) {
    const __m256i seven = _mm256_set1_epi8(0x7F), one = _mm256_set1_epi8(1);
    __m256i hi = _mm256_setzero_si256(), lo = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      const __m256i ai = load256(qa + reg * i);
      const __m256i h7 = _mm256_and_si256(_mm256_srli_epi16(c[i], 1), seven);
      const __m256i l1 = _mm256_and_si256(c[i], one);
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_maddubs_epi16(h7, ai), ones));
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_maddubs_epi16(l1, ai), ones));
    }
    return _mm256_add_epi32(_mm256_slli_epi32(hi, 1), lo);
  }
  __m256i pr[8];
  for (int i = 0; i < 8; ++i) pr[i] = _mm256_maddubs_epi16(c[i], load256(qa + reg * i));
  const __m256i s0 = _mm256_add_epi16(_mm256_add_epi16(pr[0], pr[1]), _mm256_add_epi16(pr[2], pr[3]));
  const __m256i s1 = _mm256_add_epi16(_mm256_add_epi16(pr[4], pr[5]), _mm256_add_epi16(pr[6], pr[7]));
  if (high_bits(K)) return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
  return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
}

template <int R, int K>
KQ_AVX2 void pairs_avx2(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y,
                        int64_t n_out) {
  constexpr int64_t stride = code_stride(K);
  const int64_t nb = w.nb, ka = a.k / QA;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 facc[R][2];
    for (int r = 0; r < R; ++r) facc[r][0] = facc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
      const int64_t blk = n * nb + b;
      const bool single = b + 1 == nb;  // the row's last block alone: 32-byte registers
      const int reg = single ? 32 : 64;
      prefetch(w.codes, (blk + PF_BLOCKS) * stride, 2 * stride);
      const uint8_t* p = w.codes + blk * stride;
      const uint8_t* meta = w.meta + blk * meta_stride(K);
      for (int half = 0; half < (single ? 1 : 2); ++half) {  // block b + half: lanes 8 half..
        const int o = 32 * half;
        __m256i c[8];
        codes8_256<K>(p, reg, o, c);
        __m256 dsc, vmin;
        if (single)
          scales8_256<K>(w, meta, meta_stride(K) / 2, blk, &dsc, &vmin);
        else  // a pair's meta: both blocks' first field, then both blocks' second
          scales8_256<K>(w, meta + meta_stride(K) / 2 * half, meta_stride(K), blk + half, &dsc,
                         &vmin);
        for (int r = 0; r < R; ++r) {
          const __m256i acc = dot8_256<K>(c, a.q + r * a.k + b * QK + o, reg);
          const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), dsc);
          const int64_t g = r * ka + b * 8 + 8 * half;
          facc[r][half] = _mm256_fmadd_ps(t, _mm256_loadu_ps(a.d + g), facc[r][half]);
          facc[r][half] = _mm256_fmadd_ps(_mm256_loadu_ps(a.u + g), vmin, facc[r][half]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = hsum_halves(facc[r][0], facc[r][1]);
  }
}

// One entry per kernel family, so a row count picks its unrolled instance in one place.
template <int R, int K>
struct Avx512Rows {
  static void run(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y, int64_t n) {
    if constexpr (K == kQ6K) q6_avx512<R>(w, a, n0, n1, y, n);
    else pairs_avx512<R, K>(w, a, n0, n1, y, n);
  }
};
template <int R, int K>
struct Avx2Rows {
  static void run(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y, int64_t n) {
    if constexpr (K == kQ6K) q6_avx2<R>(w, a, n0, n1, y, n);
    else pairs_avx2<R, K>(w, a, n0, n1, y, n);
  }
};
template <int R, int K>
struct ScalarRows {
  static void run(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y, int64_t n) {
    if constexpr (K == kQ6K) q6_scalar(w, a, R, n0, n1, y, n);
    else pairs_scalar<K>(w, a, R, n0, n1, y, n);
  }
};

template <template <int, int> class F, int K>
void dispatch_rows(const Weights& w, const Acts& a, int rows, int64_t n0, int64_t n1, float* y,
                   int64_t n_out) {
  switch (rows) {
    case 1: F<1, K>::run(w, a, n0, n1, y, n_out); break;
    case 2: F<2, K>::run(w, a, n0, n1, y, n_out); break;
    case 3: F<3, K>::run(w, a, n0, n1, y, n_out); break;
    case 4: F<4, K>::run(w, a, n0, n1, y, n_out); break;
    case 5: F<5, K>::run(w, a, n0, n1, y, n_out); break;
    case 6: F<6, K>::run(w, a, n0, n1, y, n_out); break;
    case 7: F<7, K>::run(w, a, n0, n1, y, n_out); break;
    default: F<8, K>::run(w, a, n0, n1, y, n_out); break;
  }
}

template <template <int, int> class F>
void dispatch_kind(int kind, const Weights& w, const Acts& a, int rows, int64_t n0, int64_t n1,
                   float* y, int64_t n_out) {
  switch (kind) {
    case kQ4K: dispatch_rows<F, kQ4K>(w, a, rows, n0, n1, y, n_out); break;
    case kQ6K: dispatch_rows<F, kQ6K>(w, a, rows, n0, n1, y, n_out); break;
    case kQ5K: dispatch_rows<F, kQ5K>(w, a, rows, n0, n1, y, n_out); break;
    case kL4: dispatch_rows<F, kL4>(w, a, rows, n0, n1, y, n_out); break;
    case kL5: dispatch_rows<F, kL5>(w, a, rows, n0, n1, y, n_out); break;
    default: dispatch_rows<F, kL8>(w, a, rows, n0, n1, y, n_out); break;
  }
}

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

int best_path() { return have_avx512() ? kAvx512 : have_avx2() ? kAvx2 : kScalar; }

bool has_simd() { return best_path() != kScalar; }

std::string path_name() {
  const int p = best_path();
  return p == kAvx512 ? "avx512-vnni" : p == kAvx2 ? "avx2" : "portable";
}

torch::Tensor kquant_mm_on(torch::Tensor x, torch::Tensor codes, torch::Tensor meta,
                           torch::Tensor d, torch::Tensor dmin, int64_t kind, int path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, K] float32");
  TORCH_CHECK(kind >= 0 && kind <= kLastKind, "unknown weight kind ", kind);
  x = x.contiguous();
  const int K = static_cast<int>(kind);
  const bool pair = paired(K);
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % code_stride(K) == 0,
              "codes must be [N, blocks * ", code_stride(K), "] bytes");
  // the weights' width, a multiple of 256; x may be narrower by less than a block (the rest are
  // zero weights, met by zero inputs)
  const int64_t nb = codes.size(1) / code_stride(K);
  const int64_t rows = x.size(0), k_in = x.size(1), k = nb * QK;
  TORCH_CHECK(k_in <= k && k_in > k - QK && (k_in == k || lane_scaled(K)),
              "weights and input disagree on in_features (", k_in, " inputs, weights ", k, " wide)");
  const int64_t n_out = codes.size(0);
  TORCH_CHECK(meta.numel() == n_out * nb * meta_stride(K), "meta has the wrong size");
  const uint16_t* dptr = nullptr;
  const uint16_t* mptr = nullptr;
  if (!lane_scaled(K)) {
    TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.numel() == n_out * nb, "d must be [N, nb] float16");
    dptr = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
    if (K != kQ6K) {
      TORCH_CHECK(dmin.scalar_type() == torch::kFloat16 && dmin.numel() == n_out * nb,
                  "dmin must be [N, nb] float16");
      mptr = reinterpret_cast<const uint16_t*>(dmin.data_ptr<at::Half>());
    }
  }
  // activation scales and min factors per lane: 32 inputs (paired) or 16 (Q6_K)
  const int64_t per_row = pair ? k / QA : k / 16;
  auto q = torch::empty({rows, k}, torch::kInt8);
  auto da = torch::empty({rows, per_row}, torch::kFloat32);
  auto bs = torch::empty({pair ? 0 : rows, k / 16}, torch::kInt16);
  auto u = torch::empty({rows, per_row}, torch::kFloat32);
  TORCH_CHECK(path >= kScalar && path <= best_path(), "kernel path ", path,
              " does not run on this CPU (best: ", path_name(), ")");
  if (pair)
    quantize_rows_paired(x.data_ptr<float>(), rows, k_in, k, q.data_ptr<int8_t>(),
                         da.data_ptr<float>(), u.data_ptr<float>(), path);
  else
    quantize_rows(x.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), da.data_ptr<float>(),
                  bs.data_ptr<int16_t>(), u.data_ptr<float>(), path);
  auto y = torch::empty({rows, n_out}, torch::kFloat32);
  Weights w{codes.data_ptr<uint8_t>(), meta.data_ptr<uint8_t>(), dptr, mptr, nb};
  const int64_t grain = std::max<int64_t>(16, n_out / (8 * at::get_num_threads()));
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
      const int r = static_cast<int>(std::min<int64_t>(MAX_ROWS, rows - r0));
      Acts a{q.data_ptr<int8_t>() + r0 * k, da.data_ptr<float>() + r0 * per_row,
             pair ? nullptr : bs.data_ptr<int16_t>() + r0 * (k / 16),
             u.data_ptr<float>() + r0 * per_row, k};
      float* yr = y.data_ptr<float>() + r0 * n_out;
      if (path == kAvx512) dispatch_kind<Avx512Rows>(K, w, a, r, n0, n1, yr, n_out);
      else if (path == kAvx2) dispatch_kind<Avx2Rows>(K, w, a, r, n0, n1, yr, n_out);
      else dispatch_kind<ScalarRows>(K, w, a, r, n0, n1, yr, n_out);
    }
  });
  return y;
}

torch::Tensor kquant_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor meta, torch::Tensor d,
                        torch::Tensor dmin, int64_t kind, bool force_scalar) {
  return kquant_mm_on(x, codes, meta, d, dmin, kind, force_scalar ? kScalar : best_path());
}

}  // namespace

// For layer.cpp's fused decoder layer: the same call as ``kquant_mm`` from Python (the best path).
torch::Tensor kquant_linear(const torch::Tensor& x, const torch::Tensor& codes,
                            const torch::Tensor& meta, const torch::Tensor& d,
                            const torch::Tensor& dmin, int64_t kind) {
  return kquant_mm_on(x, codes, meta, d, dmin, kind, best_path());
}

void register_layer_ops(pybind11::module& m);  // layer.cpp

// The compute entry points release the GIL while they run: a server's HTTP thread then
// writes the last step's chunks while the engine computes the next, instead of waiting for
// each kernel call to return (they touch no Python object; pybind converts the arguments
// before and the result after, holding the GIL).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("kquant_mm", &kquant_mm, release(),
        "rows x GGUF quantised weights (kind: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3-5 lane-scaled 4/5/8-bit "
        "codes), int8 activation blocks");
  m.def("kquant_mm_on", &kquant_mm_on, release(),
        "kquant_mm on a given kernel path (0 portable, 1 AVX2, 2 AVX-512 VNNI): for tests");
  m.def("has_simd", &has_simd, "whether a SIMD path (AVX-512 VNNI or AVX2) runs on this CPU");
  m.def("best_path", &best_path, "the kernel path this CPU runs: 0 portable, 1 AVX2, 2 AVX-512");
  m.def("path_name", &path_name, "the kernel path this CPU runs, by name");
  register_layer_ops(m);
}
