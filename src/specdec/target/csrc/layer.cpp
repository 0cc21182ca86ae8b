// The small operations of a decoder layer under --dtype kquant, one call each instead of a
// chain of torch operators from Python (HF's RMSNorm is 7 operators, RoPE 10, row-wise
// attention 8 per row and head group): at one to eight rows the model's arithmetic outside the
// linears is tiny and the per-operator dispatch was most of the 10-13 ms a decode step spent
// outside the kernel (specdec/target/kquant_layers.py calls these).
//
// Row invariance (what keeps speculation lossless): every output row is computed from its own
// input row (and, in attention, the keys it may see, in cache order) by the same instructions
// whatever the number of rows, so a k-row verification pass gives each row the bits of a
// one-row step. Loops over the feature axis keep fixed partial-sum lanes, so the order of
// every sum is fixed too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

// csrc/kquant.cpp: rows x quantised blocks on this CPU's best kernel path
torch::Tensor kquant_linear(const torch::Tensor& x, const torch::Tensor& codes,
                            const torch::Tensor& meta, const torch::Tensor& d,
                            const torch::Tensor& dmin, int64_t kind);

namespace {

constexpr int LANES = 16;  // partial sums per reduction, in a fixed order

// Built for three instruction sets, picked at load time: the same source, vectorised.
#define LAYER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

LAYER_CLONES float dot(const float* a, const float* b, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[i % LANES] += a[i] * b[i];
  float s = 0.f;
  for (int l = 0; l < LANES; ++l) s += acc[l];
  return s;
}

LAYER_CLONES void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

LAYER_CLONES void scale_row(const float* x, const float* w, float inv, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

// y = w * (x * rsqrt(mean(x^2) + eps)): HF's Qwen2/Llama RMSNorm in fp32, with HF's bits. The
// sum of squares is ATen's own (a hand-written reduction sums in another order, and under int8
// activation rounding that alone moved perplexity on the fixed text from 13.34 to 13.39); the
// rest is elementwise and correctly rounded either way (mean = sum / n, rsqrt = 1 / sqrt), so
// one loop gives the bits of HF's five further operators.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "rms_norm takes float32");
  const auto xc = x.contiguous();
  const int64_t n = xc.size(-1), rows = xc.numel() / n;
  TORCH_CHECK(w.numel() == n && w.is_contiguous(), "weight must be [features] contiguous");
  const auto sums = xc.pow(2).sum(-1).contiguous();  // [rows...]: ATen's reduction order
  auto y = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* sp = sums.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / std::sqrt(sp[r] / static_cast<float>(n) + e);
    scale_row(xp + r * n, wp, inv, n, yp + r * n);
  }
  return y;
}

// Not contracted to fused multiply-adds: the same roundings as HF's x * cos + rotate_half(x) * sin
// (a + (-b) * s is a - b * s exactly), so the rotation matches torch's bit for bit.
__attribute__((optimize("fp-contract=off"))) LAYER_CLONES void rope_head(float* x, const float* c,
                                                                           const float* s,
                                                                           int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i + half] + a * s[i + half];
  }
}

// In place, x [T, heads, D] (D contiguous), cos/sin [T, D]: rotary embedding, rotate-half form
// (x * cos + rotate_half(x) * sin), every head of a row with that row's angles.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be [T, heads, D] float32 with D contiguous");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.size(0) == t && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos/sin must be [T, D]");
  float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r)
    for (int64_t h = 0; h < heads; ++h)
      rope_head(xp + r * x.stride(0) + h * x.stride(1), cos.data_ptr<float>() + r * d,
                sin.data_ptr<float>() + r * d, d / 2);
}

// ---- attention, AVX-512: one row, one kv head and its G query heads -------------------------
#define ATT_TARGET __attribute__((target("avx512f,avx512dq,fma")))

bool have_avx512f() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return ok;
}

// exp(x) for x <= 0 (scores less their maximum): Cephes' expf polynomial (about 1 ulp), the
// power of two applied by scalef; below -87 it underflows to 0 as expf does.
ATT_TARGET inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// q: G heads at q + h * q_head (d floats each); keys/values rows js[0..m) at k + j * k_row;
// p: scratch [G * m]; out: G heads at out + h * dv. d and dv are multiples of 16.
template <int G>
ATT_TARGET void attend_group(const float* q, int64_t q_head, const float* k, int64_t k_row,
                             const float* v, int64_t v_row, const int64_t* js, int64_t m,
                             int64_t d, int64_t dv, float scale, float* p, float* out) {
  for (int64_t a = 0; a < m; ++a) {
    const float* kr = k + js[a] * k_row;
    __m512 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 kv = _mm512_loadu_ps(kr + c);
      for (int h = 0; h < G; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * q_head + c), kv, acc[h]);
    }
    for (int h = 0; h < G; ++h) p[h * m + a] = _mm512_reduce_add_ps(acc[h]) * scale;
  }
  for (int h = 0; h < G; ++h) {  // softmax over the row's keys, fixed order
    float* ph = p + h * m;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t a = 0; a < m; ++a) top = std::max(top, ph[a]);
    const __m512 t = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    int64_t a = 0;
    for (; a + 16 <= m; a += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(ph + a), t));
      _mm512_storeu_ps(ph + a, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (a < m) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (m - a)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, ph + a), t));
      _mm512_mask_storeu_ps(ph + a, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (a = 0; a + 16 <= m; a += 16) _mm512_storeu_ps(ph + a, _mm512_mul_ps(_mm512_loadu_ps(ph + a), inv));
    for (; a < m; ++a) ph[a] *= inv[0];
  }
  for (int64_t c = 0; c < dv; c += 16) {
    __m512 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t a = 0; a < m; ++a) {
      const __m512 vv = _mm512_loadu_ps(v + js[a] * v_row + c);
      for (int h = 0; h < G; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * m + a]), vv, acc[h]);
    }
    for (int h = 0; h < G; ++h) _mm512_storeu_ps(out + h * dv + c, acc[h]);
  }
}

using GroupFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t,
                         const int64_t*, int64_t, int64_t, int64_t, float, float*, float*);

GroupFn group_kernel(int64_t g) {
  switch (g) {
    case 1: return attend_group<1>;
    case 2: return attend_group<2>;
    case 3: return attend_group<3>;
    case 4: return attend_group<4>;
    case 5: return attend_group<5>;
    case 6: return attend_group<6>;
    case 7: return attend_group<7>;
    case 8: return attend_group<8>;
    default: return nullptr;
  }
}

// q [T, heads, D], keys/values [kv_heads, N, D] (D contiguous; any other strides, e.g. views
// of a preallocated cache), allowed: [T, N] bool or an undefined tensor (causal: the queries
// are the last T positions). Returns [T, heads * D]. Row i, head h attends over the keys row i
// may see, in cache order: scores = q.k * scale, softmax, sum of p * v. AVX-512 where the CPU
// has it (``portable`` forces the plain loops, for tests): the same sums in another order.
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                        c10::optional<torch::Tensor> allowed, double scale, bool portable) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "q [T,H,D], k/v [Hkv,N,D]");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
                  values.scalar_type() == torch::kFloat32,
              "attention takes float32");
  const int64_t t = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = keys.size(0), n = keys.size(1), dv = values.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(2) == d && values.size(1) == n,
              "shapes of q, keys and values disagree");
  const int64_t group = heads / kv_heads;
  torch::Tensor mask;
  if (allowed.has_value() && allowed->defined()) {
    mask = allowed->contiguous();
    TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.size(0) == t && mask.size(1) == n,
                "allowed must be [T, N] bool");
  }
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  auto out = torch::empty({t, heads * dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // the positions row i may see, in cache order
  std::vector<std::vector<int64_t>> seen(t);
  for (int64_t i = 0; i < t; ++i) {
    if (mp == nullptr) {
      const int64_t m = n - t + i + 1;
      seen[i].resize(m);
      for (int64_t j = 0; j < m; ++j) seen[i][j] = j;
    } else {
      for (int64_t j = 0; j < n; ++j)
        if (mp[i * n + j]) seen[i].push_back(j);
    }
  }
  const bool simd = !portable && have_avx512f() && d % 16 == 0 && dv % 16 == 0;
  const GroupFn fast = simd ? group_kernel(group) : nullptr;
  if (fast != nullptr) {  // per row and kv head, its query heads together
    at::parallel_for(0, t * kv_heads, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> p;
      for (int64_t w = lo; w < hi; ++w) {
        const int64_t i = w / kv_heads, g = w % kv_heads;
        const auto& js = seen[i];
        p.resize(group * js.size());
        fast(qp + i * q.stride(0) + g * group * q.stride(1), q.stride(1), kp + g * keys.stride(0),
             keys.stride(1), vp + g * values.stride(0), values.stride(1), js.data(),
             static_cast<int64_t>(js.size()), d, dv, sc, p.data(), op + i * heads * dv + g * group * dv);
      }
    });
    return out;
  }
  at::parallel_for(0, t * heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> p;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t i = w / heads, h = w % heads, g = h / group;
      const float* qv = qp + i * q.stride(0) + h * q.stride(1);
      const auto& js = seen[i];
      p.resize(js.size());
      float top = -std::numeric_limits<float>::infinity();
      for (size_t a = 0; a < js.size(); ++a) {
        p[a] = dot(qv, kp + g * keys.stride(0) + js[a] * keys.stride(1), d) * sc;
        top = std::max(top, p[a]);
      }
      float total = 0.f;
      for (size_t a = 0; a < js.size(); ++a) {
        p[a] = std::exp(p[a] - top);
        total += p[a];
      }
      float* o = op + i * heads * dv + h * dv;
      for (int64_t e = 0; e < dv; ++e) o[e] = 0.f;
      for (size_t a = 0; a < js.size(); ++a)
        axpy(o, p[a] / total, vp + g * values.stride(0) + js[a] * values.stride(1), dv);
    }
  });
  return out;
}

// ---- a whole decoder layer in one call -----------------------------------------------------
// The lean layer's forward (kquant_layers.LeanDecoderLayer) for one sequence's rows, the same
// operations in the same order (the same functions and ATen kernels, so the same bits), without
// the fifteen Python calls and torch dispatches a layer took around its linears.

struct Lin {  // one KQuantLinear (or a run of them fused into one call)
  torch::Tensor codes, meta, d, dmin, bias;  // bias: empty when the layer has none
  int64_t kind;
  torch::Tensor mm(const torch::Tensor& x) const {
    auto y = kquant_linear(x, codes, meta, d, dmin, kind);
    if (bias.numel()) y.add_(bias);
    return y;
  }
};

struct LeanLayer {
  torch::Tensor w1, w2;  // the two RMSNorm weights
  double eps1, eps2;
  std::vector<Lin> qkv;  // runs of q, k, v of one kind, in that order
  std::vector<std::vector<int64_t>> qkv_widths;  // the outputs each run holds
  int64_t head_dim;
  double scaling;
  Lin o;
  std::vector<Lin> gate_up;
  std::vector<std::vector<int64_t>> gate_up_widths;
  Lin down;
};

// Each run's output split into its layers' outputs (column views), in order.
std::vector<torch::Tensor> apply_runs(const std::vector<Lin>& runs,
                                      const std::vector<std::vector<int64_t>>& widths,
                                      const torch::Tensor& x) {
  std::vector<torch::Tensor> out;
  for (size_t g = 0; g < runs.size(); ++g) {
    auto y = runs[g].mm(x);
    int64_t off = 0;
    for (int64_t w : widths[g]) {
      out.push_back(y.narrow(1, off, w));
      off += w;
    }
  }
  return out;
}

// x [T, hidden] float32; cos/sin [T, D]; kbuf/vbuf [kv_heads, capacity, D]: the layer's cache
// buffers, holding n entries, with room for T more (written here); allowed: [T, n + T] bool or
// none (causal). Returns the layer's output [T, hidden].
torch::Tensor lean_layer(const LeanLayer& L, const torch::Tensor& x_in, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& kbuf,
                         const torch::Tensor& vbuf, int64_t n,
                         c10::optional<torch::Tensor> allowed) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32,
              "x must be [T, hidden] float32");
  const auto x = x_in.contiguous();
  const int64_t t = x.size(0), d = L.head_dim;
  TORCH_CHECK(kbuf.dim() == 3 && vbuf.dim() == 3 && n + t <= kbuf.size(1) &&
                  n + t <= vbuf.size(1),
              "the cache buffers must be [kv_heads, capacity, D] with room for the rows");
  auto qkv = apply_runs(L.qkv, L.qkv_widths, rms_norm(x, L.w1, L.eps1));
  TORCH_CHECK(qkv.size() == 3, "q, k and v expected");
  auto q = qkv[0].view({t, qkv[0].size(1) / d, d});
  auto k = qkv[1].view({t, qkv[1].size(1) / d, d});
  auto v = qkv[2].view({t, qkv[2].size(1) / d, d});
  rope_(q, cos, sin);
  rope_(k, cos, sin);
  kbuf.narrow(1, n, t).copy_(k.transpose(0, 1));
  vbuf.narrow(1, n, t).copy_(v.transpose(0, 1));
  auto out = attention(q, kbuf.narrow(1, 0, n + t), vbuf.narrow(1, 0, n + t), allowed, L.scaling,
                       false);
  auto h = x + L.o.mm(out);
  auto gu = apply_runs(L.gate_up, L.gate_up_widths, rms_norm(h, L.w2, L.eps2));
  TORCH_CHECK(gu.size() == 2, "gate and up expected");
  return h + L.down.mm(at::silu(gu[0]).mul_(gu[1]));
}

}  // namespace

void register_layer_ops(pybind11::module& m) {
  pybind11::class_<Lin>(m, "Lin")
      .def(pybind11::init([](torch::Tensor codes, torch::Tensor meta, torch::Tensor d,
                             torch::Tensor dmin, torch::Tensor bias, int64_t kind) {
             return Lin{codes, meta, d, dmin, bias, kind};
           }),
           "one kquant linear: its block tensors, bias (empty: none) and kind");
  pybind11::class_<LeanLayer>(m, "LeanLayer")
      .def(pybind11::init([](torch::Tensor w1, double eps1, torch::Tensor w2, double eps2,
                             std::vector<Lin> qkv, std::vector<std::vector<int64_t>> qkv_widths,
                             int64_t head_dim, double scaling, Lin o, std::vector<Lin> gate_up,
                             std::vector<std::vector<int64_t>> gate_up_widths, Lin down) {
             return LeanLayer{w1, w2, eps1, eps2, qkv, qkv_widths, head_dim, scaling, o,
                              gate_up, gate_up_widths, down};
           }),
           "a decoder layer's tensors for lean_layer");
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;  // as kquant_mm's
  m.def("rms_norm", &rms_norm, release(), "RMSNorm over the last axis, row by row (float32)");
  m.def("rope_", &rope_, release(), "rotate-half rotary embedding, in place, [T, heads, D]");
  m.def("attention", &attention, release(),
        "row-wise grouped-query attention over a cache view");
  m.def("lean_layer", &lean_layer, release(),
        "a Qwen2/Llama decoder layer over one sequence's rows, writing its cache in place");
}
