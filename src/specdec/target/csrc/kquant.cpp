// Small-row GEMM over a GGUF file's own Q4_K / Q6_K blocks, for verifying drafted tokens.
//
// Why this exists: llama.cpp's CPU kernels decode one token at memory speed but are bound by
// arithmetic from two rows on (on two Zen 4 cores T(2) = 1.62 T(1), T(8) = 5.65 T(1)), so
// verifying a draft costs nearly as many decode steps as it verifies. Here each 256-weight
// super-block is unpacked once and multiplied with every row of the pass (up to 8 at a time)
// using integer dot products, so k rows cost little more than reading the weight once.
//
// Layout: within a 256-block, lane l (0..15) of a 512-bit register holds the 16 weights
// 16 l .. 16 l + 15 (one Q6_K sub-block, half a Q4_K one), four per register c (0..3):
// register c, byte 4 l + i is weight 16 l + 4 c + i, for the codes and for the activations
// alike. Four VNNI dot products then leave each lane with one 16-weight group's exact sum, which
// one integer multiply scales by its sub-block scale: 5 multiply instructions per row and
// block, where unpacking to pair sums and scaling them took 8.
//
// Numerics (the same for every row count, so speculation stays lossless):
// - activations: per row, per 256-block, rounded to int8 with scale amax / 127 (llama.cpp's
//   Q8_K rule), plus the block's sums per 16 inputs for the affine "min" term;
// - weights: the file's codes and 6-bit sub-block scales as integers, exactly; d and dmin as
//   fp32 (exact: they are fp16 in the file);
// - per super-block, the integer dot products are exact (int32); each row accumulates
//   d * da * isum and dmin * da * msum into its own float lanes in block order, whatever the
//   number of rows in the call, and reduces them in a fixed order at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int QK = 256;  // weights per super-block
constexpr int MAX_ROWS = 8;
constexpr int64_t PF_BLOCKS = 8;  // software prefetch distance, in super-blocks

// Per row and 256-block: int8 codes, fp32 scale, int16 sums of 16 codes. Rounding is to
// nearest even (the default mode) in both paths, so they give the same codes.
void quantize_block_scalar(const float* xb, int8_t* qb, float* d, int16_t* sb) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
  if (amax == 0.f) {
    *d = 0.f;
    std::memset(qb, 0, QK);
    std::memset(sb, 0, 16 * sizeof(int16_t));
    return;
  }
  const float iscale = 127.f / amax;
  for (int i = 0; i < QK; ++i) {
    int v = static_cast<int>(std::nearbyint(xb[i] * iscale));
    qb[i] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
  }
  for (int h = 0; h < 16; ++h) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += qb[h * 16 + i];
    sb[h] = static_cast<int16_t>(s);
  }
  *d = 1.f / iscale;
}

#define KQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

KQ_TARGET void quantize_block_avx512(const float* xb, int8_t* qb, float* d, int16_t* sb) {
  __m512 vmax = _mm512_setzero_ps();
  for (int i = 0; i < QK; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  if (amax == 0.f) {
    *d = 0.f;
    std::memset(qb, 0, QK);
    std::memset(sb, 0, 16 * sizeof(int16_t));
    return;
  }
  const float iscale = 127.f / amax;
  const __m512 vs = _mm512_set1_ps(iscale);
  alignas(64) int32_t sums[16];
  for (int h = 0; h < 16; ++h) {
    // |x * iscale| <= 127 up to rounding of the product; clamp as the scalar path does
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), vs));
    v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * h), _mm512_cvtepi32_epi8(v));
    sums[h] = _mm512_reduce_add_epi32(v);
  }
  for (int h = 0; h < 16; ++h) sb[h] = static_cast<int16_t>(sums[h]);
  *d = 1.f / iscale;
}

// Natural order -> lane layout (register c, byte 4 l + i <- weight 16 l + 4 c + i).
inline void to_lanes(const int8_t* natural, int8_t* lanes) {
  for (int l = 0; l < 16; ++l)
    for (int c = 0; c < 4; ++c) std::memcpy(lanes + 64 * c + 4 * l, natural + 16 * l + 4 * c, 4);
}

bool have_avx512();

// Also ``u`` = da * (sum of 16 codes) per 16-group: the factor of the "min" term, so the
// kernel pays one multiply-add per row and block for it.
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int16_t* bs,
                   float* u, bool simd) {
  const int64_t nb = k / QK;
  alignas(64) int8_t natural[QK];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t off = r * k + b * QK;
      if (simd)
        quantize_block_avx512(x + off, natural, d + r * nb + b, bs + r * (k / 16) + b * 16);
      else
        quantize_block_scalar(x + off, natural, d + r * nb + b, bs + r * (k / 16) + b * 16);
      to_lanes(natural, q + off);
      const int64_t g = r * (k / 16) + b * 16;
      for (int h = 0; h < 16; ++h) u[g + h] = d[r * nb + b] * static_cast<float>(bs[g + h]);
    }
}

struct Weights {
  // Q4: [N, nb, 128]: byte i of half L holds weights L*128 + i (low nibble), L*128 + 64 + i.
  // Q6: [N, nb, 192]: the same 128 nibble bytes for the low 4 bits, then 64 bytes whose bits
  // 2s, 2s + 1 of byte i are the high 2 bits of weight 64 s + i.
  const uint8_t* codes;
  const uint8_t* meta;   // Q4: [N, nb, 16] sc[8], m[8]; Q6: [N, nb, 16] int8 scales
  const uint16_t* d;     // [N, nb] fp16, as in the file
  const uint16_t* dmin;  // [N, nb] fp16 (Q4 only)
  int64_t nb;
};

struct Acts {
  const int8_t* q;
  const float* d;
  const int16_t* bs;
  const float* u;  // da * bs
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

// Portable reference with the same integer arithmetic, for CPUs without AVX-512 (slow; its
// float accumulation order differs from the SIMD path, so one machine always uses one path).
template <bool Q6>
void rows_scalar(const Weights& w, const Acts& a, int64_t rows, int64_t n0, int64_t n1, float* y,
                 int64_t n_out) {
  const int64_t nb = w.nb;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f, msum = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t blk = n * nb + b;
        const uint8_t* meta = w.meta + blk * 16;
        const int8_t* qa = a.q + r * a.k + b * QK;
        const int16_t* bs = a.bs + r * (a.k / 16) + b * 16;
        const int64_t stride = Q6 ? 192 : 128;
        const uint8_t* codes = w.codes + blk * stride;
        int32_t isum = 0, mm = 0;
        for (int l = 0; l < 16; ++l) {
          int32_t dot = 0;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const int j = 4 * l + i;
              const uint8_t byte = codes[(c / 2) * 64 + j];
              int code = (c % 2) ? (byte >> 4) : (byte & 15);
              if (Q6) code |= ((codes[128 + j] >> (2 * c)) & 3) << 4;
              dot += code * qa[64 * c + j];
            }
          const int sc = Q6 ? static_cast<int8_t>(meta[l]) : meta[l / 2];
          const int m = Q6 ? 32 * static_cast<int8_t>(meta[l]) : meta[8 + l / 2];
          isum += sc * dot;
          mm += m * bs[l];
        }
        const float da = a.d[r * nb + b];
        const float dw = half_to_float(w.d[blk]);
        sum += static_cast<float>(isum) * (dw * da);
        msum += static_cast<float>(mm) * ((Q6 ? dw : half_to_float(w.dmin[blk])) * da);
      }
      y[r * n_out + n] = sum - msum;
    }
  }
}

KQ_TARGET inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// R rows (1..8) against output channels [n0, n1): every super-block is unpacked once.
template <int R, bool Q6>
KQ_TARGET void rows_avx512(const Weights& w, const Acts& a, int64_t n0, int64_t n1, float* y,
                           int64_t n_out) {
  const int64_t nb = w.nb;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i idx_sc = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i idx_m = _mm512_add_epi32(idx_sc, _mm512_set1_epi32(8));

  for (int64_t n = n0; n < n1; ++n) {
    __m512 facc[R];
    for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = n * nb + b;
      // the hardware prefetcher alone left the 1-2 row passes short of memory speed: fetch
      // the codes a few blocks ahead (rows of one output channel are contiguous)
      {
        const int64_t stride = Q6 ? 192 : 128;
        const char* ahead = reinterpret_cast<const char*>(w.codes + (blk + PF_BLOCKS) * stride);
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        if (Q6) _mm_prefetch(ahead + 128, _MM_HINT_T0);
      }
      const uint8_t* p = w.codes + blk * (Q6 ? 192 : 128);
      const __m512i v0 = _mm512_loadu_si512(p);
      const __m512i v1 = _mm512_loadu_si512(p + 64);
      __m512i c0 = _mm512_and_si512(v0, low4);
      __m512i c1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
      __m512i c2 = _mm512_and_si512(v1, low4);
      __m512i c3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
      if (Q6) {
        const __m512i hb = _mm512_loadu_si512(p + 128);
        const __m512i two = _mm512_set1_epi8(0x30);
        c0 = _mm512_or_si512(c0, _mm512_and_si512(_mm512_slli_epi16(hb, 4), two));
        c1 = _mm512_or_si512(c1, _mm512_and_si512(_mm512_slli_epi16(hb, 2), two));
        c2 = _mm512_or_si512(c2, _mm512_and_si512(hb, two));
        c3 = _mm512_or_si512(c3, _mm512_and_si512(_mm512_srli_epi16(hb, 2), two));
      }
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.meta + blk * 16));
      __m512i sc_lanes, m_lanes;
      if (Q6) {
        sc_lanes = _mm512_cvtepi8_epi32(raw);
        m_lanes = _mm512_slli_epi32(sc_lanes, 5);  // 32 * sc: the codes' offset
      } else {
        const __m512i both = _mm512_cvtepu8_epi32(raw);  // sc[0..7], m[0..7]
        sc_lanes = _mm512_permutexvar_epi32(idx_sc, both);
        m_lanes = _mm512_permutexvar_epi32(idx_m, both);
      }
      const float dw = _cvtsh_ss(w.d[blk]);
      const float dm = Q6 ? dw : _cvtsh_ss(w.dmin[blk]);
      // per block, for every row: d * sc per lane, and -dmin * m per lane
      const __m512 dsc = _mm512_mul_ps(_mm512_cvtepi32_ps(sc_lanes), _mm512_set1_ps(dw));
      const __m512 vmin = _mm512_mul_ps(_mm512_cvtepi32_ps(m_lanes), _mm512_set1_ps(-dm));
      for (int r = 0; r < R; ++r) {
        const int8_t* qa = a.q + r * a.k + b * QK;
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0, _mm512_loadu_si512(qa));
        acc = _mm512_dpbusd_epi32(acc, c1, _mm512_loadu_si512(qa + 64));
        acc = _mm512_dpbusd_epi32(acc, c2, _mm512_loadu_si512(qa + 128));
        acc = _mm512_dpbusd_epi32(acc, c3, _mm512_loadu_si512(qa + 192));
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), dsc);
        facc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[r * nb + b]), facc[r]);
        const __m512 u = _mm512_loadu_ps(a.u + r * (a.k / 16) + b * 16);
        facc[r] = _mm512_fmadd_ps(u, vmin, facc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * n_out + n] = hsum512(facc[r]);
  }
}

template <bool Q6>
void dispatch_rows(const Weights& w, const Acts& a, int rows, int64_t n0, int64_t n1, float* y,
                   int64_t n_out) {
  switch (rows) {
    case 1: rows_avx512<1, Q6>(w, a, n0, n1, y, n_out); break;
    case 2: rows_avx512<2, Q6>(w, a, n0, n1, y, n_out); break;
    case 3: rows_avx512<3, Q6>(w, a, n0, n1, y, n_out); break;
    case 4: rows_avx512<4, Q6>(w, a, n0, n1, y, n_out); break;
    case 5: rows_avx512<5, Q6>(w, a, n0, n1, y, n_out); break;
    case 6: rows_avx512<6, Q6>(w, a, n0, n1, y, n_out); break;
    case 7: rows_avx512<7, Q6>(w, a, n0, n1, y, n_out); break;
    default: rows_avx512<8, Q6>(w, a, n0, n1, y, n_out); break;
  }
}

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

torch::Tensor kquant_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor meta, torch::Tensor d,
                        torch::Tensor dmin, bool q6, bool force_scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, K] float32");
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % QK == 0, "in_features must be a multiple of 256");
  const int64_t nb = k / QK;
  const int64_t n_out = d.size(0);
  TORCH_CHECK(d.size(1) == nb, "weights and input disagree on in_features");
  auto q = torch::empty({rows, k}, torch::kInt8);
  auto da = torch::empty({rows, nb}, torch::kFloat32);
  auto bs = torch::empty({rows, k / 16}, torch::kInt16);
  auto u = torch::empty({rows, k / 16}, torch::kFloat32);
  const bool simd = have_avx512() && !force_scalar;
  quantize_rows(x.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), da.data_ptr<float>(),
                bs.data_ptr<int16_t>(), u.data_ptr<float>(), simd);
  auto y = torch::empty({rows, n_out}, torch::kFloat32);
  TORCH_CHECK(d.scalar_type() == torch::kFloat16, "d must be float16");
  const auto* dptr = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* mptr = q6 ? nullptr : reinterpret_cast<const uint16_t*>(dmin.data_ptr<at::Half>());
  Weights w{codes.data_ptr<uint8_t>(), meta.data_ptr<uint8_t>(), dptr, mptr, nb};
  const int64_t grain = std::max<int64_t>(16, n_out / (8 * at::get_num_threads()));
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
      const int r = static_cast<int>(std::min<int64_t>(MAX_ROWS, rows - r0));
      Acts a{q.data_ptr<int8_t>() + r0 * k, da.data_ptr<float>() + r0 * nb,
             bs.data_ptr<int16_t>() + r0 * (k / 16), u.data_ptr<float>() + r0 * (k / 16), k};
      float* yr = y.data_ptr<float>() + r0 * n_out;
      if (simd) {
        if (q6) dispatch_rows<true>(w, a, r, n0, n1, yr, n_out);
        else dispatch_rows<false>(w, a, r, n0, n1, yr, n_out);
      } else {
        if (q6) rows_scalar<true>(w, a, r, n0, n1, yr, n_out);
        else rows_scalar<false>(w, a, r, n0, n1, yr, n_out);
      }
    }
  });
  return y;
}

}  // namespace

void register_layer_ops(pybind11::module& m);  // layer.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kquant_mm", &kquant_mm, "rows x GGUF Q4_K / Q6_K weights, int8 activation blocks");
  m.def("has_simd", &have_avx512, "whether the AVX-512 VNNI path runs on this CPU");
  register_layer_ops(m);
}
