// Fused CPU AdamW over a flat segment: one pass reads the low-precision grad and the FP32
// param/exp_avg/exp_avg_sq and writes the FP32 state back plus a bf16/fp16 copy of the params.
//
// The arithmetic copies what torch's own CPU kernels do for the ops of the pure-torch path
// (kernels/torch_adamw.py), op for op, so the results are the same bits:
//   g = float(grad) * grad_scale                         mul_(scalar): scalar cast to float
//   p = p * decay                                        decay = float(1 - lr * weight_decay)
//   m = fma(w, g - m, m)      if |w| < 0.5              lerp_(g, w): torch's vectorized lerp is an
//     = fma(w - 1, g - m, g)  otherwise                  FMA (and its scalar tail is contracted)
//   v = fma((1 - beta2) * g, g, v * beta2)               mul_().addcmul_(): torch's build contracts
//                                                        self + value * t1 * t2 into one FMA
//   denom = sqrt(v) / bc2_sqrt + eps                     sqrt is MKL's vmsSqrt, as torch.sqrt's is
//   p = p + (-step_size * m) / denom                     addcdiv_(): no FMA possible
// Every scalar is a double computed in Python, cast to float here as torch casts it. The file is
// built with -ffp-contract=off so that the compiler adds no FMA that torch does not have. Each op but
// MKL's sqrt is a correctly rounded IEEE op, in the same order on the AVX-512, AVX2 and scalar paths,
// so the three give the same bits, with either sqrt.
//
// This file is that arithmetic, over a range of a segment on the calling thread. cpu_adamw_ops.cpp, built
// with it into one extension, runs a segment's ranges on OpenMP threads, joins and splits the masters of
// the split step (kernels/split_masters.py) around each block, checks the ops' arguments and binds them.
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw"), always_inline))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c"), always_inline))
#endif

// MKL's vector sqrt, which libtorch_cpu exports in MKL builds. torch.sqrt on FP32 calls it, and it
// is not correctly rounded: up to 1 ulp off, in a share of elements that depends on the code path MKL
// picks for the CPU (about 1 in 150 on the AVX-512 CI machine, 1 in 5 on an AVX2-only AMD EPYC), so
// matching torch bit for bit means calling it too. Weak: in a torch without MKL it stays null and the
// hardware sqrt (correctly rounded, as torch's own is then) takes over.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
// VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: the mode ATen/cpu/vml.h passes.
constexpr long long kVmlMode = 0x2 | 0x140000 | 0x100;

namespace {

// Elements per block: one block's p, m, v, grad and sqrt scratch (about 36 KiB) stay in L1/L2
// between the moment pass, the sqrt and the update pass, so memory is still read once.
constexpr int64_t kBlock = 2048;

enum class Grad { f32, bf16, f16 };
enum class Out { none, bf16, f16 };
enum class Isa { scalar, avx2, avx512 };

struct Coeffs {
  float grad_scale, decay, w, w_minus_1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  bool small_w;  // torch's lerp picks its formula by |weight| < 0.5
};

struct Segment {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* param_out;  // may equal grad: a block's grads are all read before its param_out is written
};

// ---- scalar path: a segment's last few elements, and all of it where there is no SIMD ----

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

template <Grad G>
inline float load_grad(const void* grad, int64_t i) {
  if constexpr (G == Grad::f32) return static_cast<const float*>(grad)[i];
  if constexpr (G == Grad::bf16) return bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
  if constexpr (G == Grad::f16)
    return c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(grad)[i]);
}

template <Out O>
inline void store_out(void* out, int64_t i, float p) {
  if constexpr (O == Out::bf16) static_cast<uint16_t*>(out)[i] = float_to_bf16(p);
  if constexpr (O == Out::f16)
    static_cast<uint16_t*>(out)[i] = c10::detail::fp16_ieee_from_fp32_value(p);
}

template <Grad G>
inline void moments_scalar(const Segment& s, const Coeffs& c, int64_t i) {
  float g = load_grad<G>(s.grad, i) * c.grad_scale;
  float m = s.exp_avg[i];
  s.exp_avg[i] = c.small_w ? std::fma(c.w, g - m, m) : std::fma(c.w_minus_1, g - m, g);
  s.exp_avg_sq[i] = std::fma(c.one_minus_beta2 * g, g, s.exp_avg_sq[i] * c.beta2);
}

template <Out O>
inline void update_scalar(const Segment& s, const Coeffs& c, int64_t i, float root) {
  float denom = root / c.bc2_sqrt + c.eps;
  float p = s.param[i] * c.decay;
  p = p + c.neg_step_size * s.exp_avg[i] / denom;
  s.param[i] = p;
  store_out<O>(s.param_out, i, p);
}

inline bool sqrt_mkl(const float* v, float* root, int64_t n, bool use_mkl) {
  if (!use_mkl) return false;
  vmsSqrt(static_cast<int>(n), v, root, kVmlMode);
  return true;
}

template <Grad G, Out O>
void block_scalar(const Segment& s, const Coeffs& c, int64_t lo, int64_t hi, float* root,
                  bool use_mkl) {
  for (int64_t i = lo; i < hi; ++i) moments_scalar<G>(s, c, i);
  if (!sqrt_mkl(s.exp_avg_sq + lo, root, hi - lo, use_mkl))
    for (int64_t i = lo; i < hi; ++i) root[i - lo] = std::sqrt(s.exp_avg_sq[i]);
  for (int64_t i = lo; i < hi; ++i) update_scalar<O>(s, c, i, root[i - lo]);
}

#if defined(__x86_64__)
// ---- AVX-512: 16 floats a step ----

template <Grad G>
AVX512_TARGET inline __m512 load_grad16(const void* grad, int64_t i) {
  if constexpr (G == Grad::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const auto* src = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i);
    const __m256i h = _mm256_loadu_si256(src);
    if constexpr (G == Grad::bf16)  // bf16 is the top half of an FP32: widen and shift, exact
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
}

template <Out O>
AVX512_TARGET inline void store_out16(void* out, int64_t i, __m512 p) {
  auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (O == Out::bf16) {
    const __m512i u = _mm512_castps_si512(p);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(r));
  }
  if constexpr (O == Out::f16)
    _mm256_storeu_si256(dst, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <Grad G, Out O>
__attribute__((target("avx512f,avx512bw"))) void block_avx512(const Segment& s, const Coeffs& c,
                                                              int64_t lo, int64_t hi, float* root,
                                                              bool use_mkl) {
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale), beta2 = _mm512_set1_ps(c.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 coeff = _mm512_set1_ps(c.small_w ? c.w : c.w_minus_1);
  const int64_t vec_hi = lo + (hi - lo) / 16 * 16;
  // 1. moments: reads grad, exp_avg, exp_avg_sq from memory
  for (int64_t i = lo; i < vec_hi; i += 16) {
    const __m512 g = _mm512_mul_ps(load_grad16<G>(s.grad, i), grad_scale);
    const __m512 m = _mm512_loadu_ps(s.exp_avg + i);
    const __m512 v = _mm512_loadu_ps(s.exp_avg_sq + i);
    const __m512 base = c.small_w ? m : g;
    _mm512_storeu_ps(s.exp_avg + i, _mm512_fmadd_ps(coeff, _mm512_sub_ps(g, m), base));
    _mm512_storeu_ps(s.exp_avg_sq + i, _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g,
                                                       _mm512_mul_ps(v, beta2)));
  }
  for (int64_t i = vec_hi; i < hi; ++i) moments_scalar<G>(s, c, i);

  // 2. sqrt of the block's new exp_avg_sq, from cache
  if (!sqrt_mkl(s.exp_avg_sq + lo, root, hi - lo, use_mkl)) {
    for (int64_t i = lo; i < vec_hi; i += 16)
      _mm512_storeu_ps(root + (i - lo), _mm512_sqrt_ps(_mm512_loadu_ps(s.exp_avg_sq + i)));
    for (int64_t i = vec_hi; i < hi; ++i) root[i - lo] = std::sqrt(s.exp_avg_sq[i]);
  }

  const __m512 decay = _mm512_set1_ps(c.decay), bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps), neg_step_size = _mm512_set1_ps(c.neg_step_size);
  // 3. update: reads param from memory, exp_avg and the roots from cache
  for (int64_t i = lo; i < vec_hi; i += 16) {
    const __m512 root_v = _mm512_loadu_ps(root + (i - lo));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(root_v, bc2_sqrt), eps);
    const __m512 m = _mm512_loadu_ps(s.exp_avg + i);
    const __m512 step = _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom);
    const __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(s.param + i), decay), step);
    _mm512_storeu_ps(s.param + i, p);
    store_out16<O>(s.param_out, i, p);
  }
  for (int64_t i = vec_hi; i < hi; ++i) update_scalar<O>(s, c, i, root[i - lo]);
}

// ---- AVX2 + FMA + F16C: 8 floats a step ----

template <Grad G>
AVX2_TARGET inline __m256 load_grad8(const void* grad, int64_t i) {
  if constexpr (G == Grad::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const auto* src = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i);
    const __m128i h = _mm_loadu_si128(src);
    if constexpr (G == Grad::bf16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      return _mm256_cvtph_ps(h);
  }
}

template <Out O>
AVX2_TARGET inline void store_out8(void* out, int64_t i, __m256 p) {
  auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (O == Out::bf16) {
    const __m256i u = _mm256_castps_si256(p);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    // packus works per 128-bit lane: gather the two lanes' low halves into the low 128 bits
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
    _mm_storeu_si128(dst, _mm256_castsi256_si128(r));
  }
  if constexpr (O == Out::f16)
    _mm_storeu_si128(dst, _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <Grad G, Out O>
__attribute__((target("avx2,fma,f16c"))) void block_avx2(const Segment& s, const Coeffs& c,
                                                         int64_t lo, int64_t hi, float* root,
                                                         bool use_mkl) {
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale), beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 coeff = _mm256_set1_ps(c.small_w ? c.w : c.w_minus_1);
  const int64_t vec_hi = lo + (hi - lo) / 8 * 8;
  // 1. moments: reads grad, exp_avg, exp_avg_sq from memory
  for (int64_t i = lo; i < vec_hi; i += 8) {
    const __m256 g = _mm256_mul_ps(load_grad8<G>(s.grad, i), grad_scale);
    const __m256 m = _mm256_loadu_ps(s.exp_avg + i);
    const __m256 v = _mm256_loadu_ps(s.exp_avg_sq + i);
    const __m256 base = c.small_w ? m : g;
    _mm256_storeu_ps(s.exp_avg + i, _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m), base));
    _mm256_storeu_ps(s.exp_avg_sq + i, _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g,
                                                       _mm256_mul_ps(v, beta2)));
  }
  for (int64_t i = vec_hi; i < hi; ++i) moments_scalar<G>(s, c, i);

  // 2. sqrt of the block's new exp_avg_sq, from cache
  if (!sqrt_mkl(s.exp_avg_sq + lo, root, hi - lo, use_mkl)) {
    for (int64_t i = lo; i < vec_hi; i += 8)
      _mm256_storeu_ps(root + (i - lo), _mm256_sqrt_ps(_mm256_loadu_ps(s.exp_avg_sq + i)));
    for (int64_t i = vec_hi; i < hi; ++i) root[i - lo] = std::sqrt(s.exp_avg_sq[i]);
  }

  const __m256 decay = _mm256_set1_ps(c.decay), bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps), neg_step_size = _mm256_set1_ps(c.neg_step_size);
  // 3. update: reads param from memory, exp_avg and the roots from cache
  for (int64_t i = lo; i < vec_hi; i += 8) {
    const __m256 root_v = _mm256_loadu_ps(root + (i - lo));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(root_v, bc2_sqrt), eps);
    const __m256 m = _mm256_loadu_ps(s.exp_avg + i);
    const __m256 step = _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom);
    const __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s.param + i), decay), step);
    _mm256_storeu_ps(s.param + i, p);
    store_out8<O>(s.param_out, i, p);
  }
  for (int64_t i = vec_hi; i < hi; ++i) update_scalar<O>(s, c, i, root[i - lo]);
}
#endif  // __x86_64__

bool isa_supported(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::avx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (isa == Isa::avx2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#endif
  return isa == Isa::scalar;
}

Isa parse_isa(const std::string& name) {
  if (name == "avx512") return Isa::avx512;
  if (name == "avx2") return Isa::avx2;
  TORCH_CHECK(name == "scalar", "unknown ISA '", name, "': choose avx512, avx2 or scalar");
  return Isa::scalar;
}

// Elements [lo, hi), a block at a time.
template <Grad G, Out O>
void run(const Segment& s, const Coeffs& c, Isa isa, bool use_mkl, int64_t lo, int64_t hi) {
  alignas(64) float root[kBlock];
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t e = std::min(b + kBlock, hi);
#if defined(__x86_64__)
    if (isa == Isa::avx512) { block_avx512<G, O>(s, c, b, e, root, use_mkl); continue; }
    if (isa == Isa::avx2) { block_avx2<G, O>(s, c, b, e, root, use_mkl); continue; }
#endif
    block_scalar<G, O>(s, c, b, e, root, use_mkl);
  }
}

template <Grad G>
void run_grad(const Segment& s, const Coeffs& c, Isa isa, bool use_mkl, Out out, int64_t lo,
              int64_t hi) {
  if (out == Out::bf16) return run<G, Out::bf16>(s, c, isa, use_mkl, lo, hi);
  if (out == Out::f16) return run<G, Out::f16>(s, c, isa, use_mkl, lo, hi);
  run<G, Out::none>(s, c, isa, use_mkl, lo, hi);
}

}  // namespace

// What cpu_adamw_ops.cpp calls. It declares them alike: a declaration that differs there fails the
// import (the mangled name, which spells out the parameter types, is then undefined).
namespace fsdp_offload_cpu_adamw {

bool isa_supported(const std::string& isa) { return ::isa_supported(parse_isa(isa)); }

// AdamW on elements [lo, hi) of a segment, on the calling thread (an OpenMP one: the caller checked the
// arguments, the ISA included, since a check failing here would end the process). param_out is bf16 or
// fp16, or none (null, out_type Undefined), and may alias grad. The scalars are Python doubles, combined
// as torch_adamw_step combines them; each is cast to float, as torch casts it.
void step_range(float* param, float* exp_avg, float* exp_avg_sq, const void* grad,
                c10::ScalarType grad_type, void* param_out, c10::ScalarType out_type,
                double grad_scale, double decay, double weight, double beta2,
                double one_minus_beta2, double bc2_sqrt, double eps, double neg_step_size,
                const std::string& isa_name, bool use_mkl_sqrt, int64_t lo, int64_t hi) {
  const Isa isa = parse_isa(isa_name);
  Out out = Out::none;
  if (out_type == c10::ScalarType::BFloat16) out = Out::bf16;
  if (out_type == c10::ScalarType::Half) out = Out::f16;
  const float w = static_cast<float>(weight);
  const Coeffs c{static_cast<float>(grad_scale), static_cast<float>(decay), w, w - 1.0f,
                 static_cast<float>(beta2), static_cast<float>(one_minus_beta2),
                 static_cast<float>(bc2_sqrt), static_cast<float>(eps),
                 static_cast<float>(neg_step_size), std::abs(w) < 0.5f};
  const Segment s{param, exp_avg, exp_avg_sq, grad, param_out};
  switch (grad_type) {
    case c10::ScalarType::Float: return run_grad<Grad::f32>(s, c, isa, use_mkl_sqrt, out, lo, hi);
    case c10::ScalarType::BFloat16: return run_grad<Grad::bf16>(s, c, isa, use_mkl_sqrt, out, lo, hi);
    case c10::ScalarType::Half: return run_grad<Grad::f16>(s, c, isa, use_mkl_sqrt, out, lo, hi);
    default: TORCH_CHECK(false, "grad must be bf16, fp16 or fp32, not ", grad_type);
  }
}

}  // namespace fsdp_offload_cpu_adamw
