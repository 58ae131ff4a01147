// The fused CPU AdamW's ops, built with cpu_adamw.cpp (its arithmetic) into one extension: they check
// their arguments, run a segment's blocks on OpenMP threads and, for the split step, join each block's
// masters before its arithmetic and split them after it.
//
// Split masters (kernels/split_masters.py, whose torch_adamw_step_split the split step repeats bit for
// bit): where the params are bf16, a master is kept as its low 16 bits, `low`, and a "rounded up" bit in
// the sign bit of its exp_avg_sq; its high half is the model's bf16 param, one less where that bit is
// set. A block's masters are joined into an FP32 array of this thread's (which stays in cache), those
// sign bits cleared, the arithmetic run on the array, and the new masters split again against the bf16
// params it wrote. Both are integer code, so the bits are the reference's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

// MKL's vector sqrt (cpu_adamw.cpp says why it is called) and MKL's thread count for the calling thread
// only, which returns the one it replaces (0: none set here); weak: null in a torch without MKL.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
extern "C" int MKL_Set_Num_Threads_Local(int n) __attribute__((weak));  // C name: the lowercase one takes a pointer

// cpu_adamw.cpp's, declared as there.
namespace fsdp_offload_cpu_adamw {
bool isa_supported(const std::string& isa);
void step_range(float* param, float* exp_avg, float* exp_avg_sq, const void* grad,
                c10::ScalarType grad_type, void* param_out, c10::ScalarType out_type,
                double grad_scale, double decay, double weight, double beta2,
                double one_minus_beta2, double bc2_sqrt, double eps, double neg_step_size,
                const std::string& isa_name, bool use_mkl_sqrt, int64_t lo, int64_t hi);
}  // namespace fsdp_offload_cpu_adamw

namespace {

namespace arith = fsdp_offload_cpu_adamw;

// cpu_adamw.cpp's block: one block's p, m, v, grad and sqrt scratch (about 36 KiB) stay in L1/L2
// between its passes. The split step joins and splits its masters a block at a time.
constexpr int64_t kBlock = 2048;
constexpr int64_t kChunk = 8;  // blocks a thread takes at a time
// The split step's blocks: half of one, so that its masters, moments, grads, params and low halves all stay
// in L1 between its join, arithmetic and split (faster than blocks of 2048 on a 2-core AVX-512 machine).
constexpr int64_t kSplitBlock = kBlock / 2;

// One op's arguments, checked. `low` and `lowp` (bf16) are the split step's masters (param is null).
struct Step {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const char* grad;
  int64_t grad_size;  // bytes an element
  c10::ScalarType grad_type;
  char* param_out;  // may equal grad: a block's grads are all read before its param_out is written
  c10::ScalarType out_type;  // Undefined: no param_out
  int16_t* low;
  const uint16_t* lowp;
  int64_t n;
  double grad_scale, decay, weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  std::string isa;
  bool use_mkl;
};

// The arithmetic on elements [lo, hi): on a.param, or on the FP32 params in `block` (the split step's
// joined masters, element i's at block[i - lo]), and then on the rest seen from element lo on.
void step(const Step& a, int64_t lo, int64_t hi, float* block = nullptr) {
  const int64_t at = block == nullptr ? 0 : lo;
  const int64_t out_size = a.param_out == nullptr ? 0 : 2;
  arith::step_range(block == nullptr ? a.param : block, a.exp_avg + at, a.exp_avg_sq + at,
                    a.grad + at * a.grad_size, a.grad_type, a.param_out + at * out_size,
                    a.out_type, a.grad_scale, a.decay, a.weight, a.beta2, a.one_minus_beta2,
                    a.bc2_sqrt, a.eps, a.neg_step_size, a.isa, a.use_mkl, lo - at, hi - at);
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Joins a block's masters into `master`: bits ((bf16 param - rounded up) << 16) | low (the param's own
// value where the joined master does not round to it: the param was written behind the optimizer;
// torch's canonical NaN where the param is NaN), and clears the rounded-up bits from exp_avg_sq. Plain
// loops over restrict pointers, which the compiler vectorizes for the ISA of the function they are
// inlined into (below, one for each).
inline __attribute__((always_inline)) void join_loop(const int16_t* __restrict low, const uint16_t* __restrict lowp,
                                                     float* __restrict v, float* __restrict master, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t vb = bits_of(v[i]), high = lowp[i];
    v[i] = float_of(vb & 0x7fffffffu);
    uint32_t bits = ((high - (vb >> 31)) & 0xffffu) << 16 | static_cast<uint16_t>(low[i]);
    const uint32_t rounded = (bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    bits = rounded == high ? bits : high << 16;
    master[i] = float_of((high & 0x7fffu) > 0x7f80u ? 0x7fc00000u : bits);
  }
}

// Splits a block's new masters: the low halves to `low`, and exp_avg_sq's sign bit set where the bf16
// param written (`out`) is not the master's high half (the rounding went up).
inline __attribute__((always_inline)) void split_loop(const float* __restrict master, const uint16_t* __restrict out,
                                                      int16_t* __restrict low, float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = bits_of(master[i]);
    low[i] = static_cast<int16_t>(bits & 0xffffu);
    const uint32_t up = (bits >> 16) != out[i];
    v[i] = float_of((bits_of(v[i]) & 0x7fffffffu) | up << 31);
  }
}

#define SPLIT_MASTERS_FOR(NAME, TARGET)                                                                        \
  TARGET void join_##NAME(const int16_t* low, const uint16_t* lowp, float* v, float* master, int64_t n) {     \
    join_loop(low, lowp, v, master, n);                                                                        \
  }                                                                                                            \
  TARGET void split_##NAME(const float* master, const uint16_t* out, int16_t* low, float* v, int64_t n) {     \
    split_loop(master, out, low, v, n);                                                                        \
  }
SPLIT_MASTERS_FOR(avx512, __attribute__((target("avx512f,avx512bw"))))
SPLIT_MASTERS_FOR(avx2, __attribute__((target("avx2"))))
SPLIT_MASTERS_FOR(scalar, )

// The split step on block [lo, hi): its masters joined into an array of this thread's (in cache), the
// arithmetic on it, the new masters split again.
void step_split_block(const Step& a, int64_t lo, int64_t hi) {
  alignas(64) float master[kSplitBlock];
  const int64_t n = hi - lo;
  const auto* out = reinterpret_cast<const uint16_t*>(a.param_out) + lo;
  float* v = a.exp_avg_sq + lo;
  if (a.isa == "avx512") join_avx512(a.low + lo, a.lowp + lo, v, master, n);
  else if (a.isa == "avx2") join_avx2(a.low + lo, a.lowp + lo, v, master, n);
  else join_scalar(a.low + lo, a.lowp + lo, v, master, n);
  step(a, lo, hi, master);
  if (a.isa == "avx512") split_avx512(master, out, a.low + lo, v, n);
  else if (a.isa == "avx2") split_avx2(master, out, a.low + lo, v, n);
  else split_scalar(master, out, a.low + lo, v, n);
}

void run(const Step& a) {
  const int64_t nchunks = (a.n + kChunk * kBlock - 1) / (kChunk * kBlock);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), nchunks));
  // Dynamic, in chunks of kChunk blocks (~0.5 MB of state): the overlapped update runs beside the
  // training loop's thread, which takes a core now and then; with a static split the thread that
  // shares that core would hold every other one up at the end of the loop.
  // Each thread's sqrt calls run on that thread alone. After torch.set_num_threads (which turns MKL's
  // dynamic threading off for the process, as train.py's rank share of the cores does) MKL would
  // otherwise thread each 2048-element call inside this loop: the kernel ran 15-30% slower.
  const bool own_mkl_threads = a.use_mkl && MKL_Set_Num_Threads_Local != nullptr;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int mkl_threads_before = own_mkl_threads ? MKL_Set_Num_Threads_Local(1) : 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t chunk = 0; chunk < nchunks; ++chunk) {
      const int64_t lo = chunk * kChunk * kBlock, hi = std::min(lo + kChunk * kBlock, a.n);
      if (a.low == nullptr) {
        step(a, lo, hi);
        continue;
      }
      for (int64_t b = lo; b < hi; b += kSplitBlock) step_split_block(a, b, std::min(b + kSplitBlock, hi));
    }
    if (own_mkl_threads) MKL_Set_Num_Threads_Local(mkl_threads_before);
  }
}

// Each of the op's tensors: on the CPU, contiguous, n elements, of one of `types` (named `kinds`). How
// they may overlap is checked in Python (kernels/contract.py) before the op is called.
void check(const at::Tensor& t, const char* name, int64_t n, std::initializer_list<at::ScalarType> types,
           const char* kinds) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == n &&
                  std::find(types.begin(), types.end(), t.scalar_type()) != types.end(),
              name, " must be a contiguous ", kinds, " CPU tensor of ", n, " elements");
}

// The arguments that both ops share, checked; the scalars are Python doubles, already combined as
// torch_adamw_step combines them.
Step shared(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& grad, int64_t n,
            double grad_scale, double decay, double weight, double beta2, double one_minus_beta2,
            double bc2_sqrt, double eps, double neg_step_size, const std::string& isa,
            bool use_mkl_sqrt) {
  check(exp_avg, "exp_avg", n, {at::kFloat}, "FP32");
  check(exp_avg_sq, "exp_avg_sq", n, {at::kFloat}, "FP32");
  check(grad, "grad", n, {at::kFloat, at::kBFloat16, at::kHalf}, "bf16/fp16/fp32");
  TORCH_CHECK(arith::isa_supported(isa), "this CPU lacks the ", isa, " instructions");
  TORCH_CHECK(!use_mkl_sqrt || vmsSqrt != nullptr, "this torch has no MKL vmsSqrt");
  return Step{nullptr, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
              static_cast<const char*>(grad.data_ptr()), static_cast<int64_t>(grad.element_size()),
              grad.scalar_type(), nullptr, at::ScalarType::Undefined, nullptr, nullptr, n,
              grad_scale, decay, weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
              isa, use_mkl_sqrt};
}

void adamw_step(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const at::Tensor& grad, const std::optional<at::Tensor>& param_out,
                double grad_scale, double decay, double weight, double beta2,
                double one_minus_beta2, double bc2_sqrt, double eps, double neg_step_size,
                const std::string& isa, bool use_mkl_sqrt) {
  const int64_t n = param.numel();
  check(param, "param", n, {at::kFloat}, "FP32");
  Step a = shared(exp_avg, exp_avg_sq, grad, n, grad_scale, decay, weight, beta2, one_minus_beta2,
                  bc2_sqrt, eps, neg_step_size, isa, use_mkl_sqrt);
  a.param = param.data_ptr<float>();
  if (param_out.has_value()) {
    check(*param_out, "param_out", n, {at::kBFloat16, at::kHalf}, "bf16/fp16");
    a.param_out = static_cast<char*>(param_out->data_ptr());
    a.out_type = param_out->scalar_type();
  }
  if (n > 0) run(a);
}

// torch_adamw_step_split: the masters are low (int16), lowp (bf16, read only) and exp_avg_sq's sign bits.
void adamw_step_split(const at::Tensor& low, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& grad, const at::Tensor& lowp, const at::Tensor& param_out,
                      double grad_scale, double decay, double weight, double beta2,
                      double one_minus_beta2, double bc2_sqrt, double eps, double neg_step_size,
                      const std::string& isa, bool use_mkl_sqrt) {
  const int64_t n = low.numel();
  check(low, "low", n, {at::kShort}, "int16");
  check(lowp, "lowp", n, {at::kBFloat16}, "bf16");
  check(param_out, "param_out", n, {at::kBFloat16}, "bf16");
  Step a = shared(exp_avg, exp_avg_sq, grad, n, grad_scale, decay, weight, beta2, one_minus_beta2,
                  bc2_sqrt, eps, neg_step_size, isa, use_mkl_sqrt);
  a.param_out = static_cast<char*>(param_out.data_ptr());
  a.out_type = at::kBFloat16;
  a.low = low.data_ptr<int16_t>();
  a.lowp = static_cast<const uint16_t*>(lowp.data_ptr());
  if (n > 0) run(a);
}

std::string best_isa() {
  for (const char* isa : {"avx512", "avx2"})
    if (arith::isa_supported(isa)) return isa;
  return "scalar";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused CPU AdamW (AVX-512 / AVX2 + OpenMP), bit-exact with the pure-torch AdamW path";
  // The GIL is released: the optimizer overlaps these with storage I/O on other Python threads.
  m.def("adamw_step", &adamw_step, py::call_guard<py::gil_scoped_release>());
  m.def("adamw_step_split", &adamw_step_split, py::call_guard<py::gil_scoped_release>());
  m.def("best_isa", &best_isa);
  m.def("isa_supported", [](const std::string& isa) { return arith::isa_supported(isa); });
  m.def("has_mkl_sqrt", [] { return vmsSqrt != nullptr; });
}
