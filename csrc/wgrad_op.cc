// Paddle binding of the fused weight-gradient op, and the kernel of a float32/float64 CPU
// linear's whole backward (FusedLinearBwd, further down; reached through the op library's Python
// fast entry, wgrad_pyentry.cc, as is FusedWgrad):
//
//   pmg_fused_wgrad_add(x, dout, dweight?, dbias?, multi_precision, has_bias)
//     -> (dweight_out, dbias_out)
//
// (No "_grad" in op names: Paddle's registry takes "<op>_grad" for a gradient op.)
//
// Semantics follow Paddle's GPU-only `_C_ops.fused_linear_param_grad_add`:
// x [..., K], dout [..., N] with the same leading dims; a given dweight [K, N]
// / dbias [N] is updated in place (beta = 1) and returned as the output (same
// allocation); a missing one is allocated (beta = 0).  With multi_precision,
// allocated accumulators are fp32 (fp64 for fp64 inputs, as Paddle's MPTypeTrait).
// Zero-size inputs (M, K or N = 0) are fine.  When has_bias is false dbias_out is a
// [1] placeholder (the Python wrapper returns None).
//
// The Python wrapper validates first and raises FusedLinearError with the
// offending shapes; the PD_CHECKs here guard direct callers of the raw op.
// Every input must be on x's place (both branches).  The GPU branch is
// pmg::gpu_flow (wgrad_gpu_flow.h) on PaddleGpuHost: Paddle's device guard
// first, then Paddle's stream and the outputs, then the CUDA core with the
// device and stream given explicitly and scratch from Paddle's allocator.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

// PADDLE_NO_PYTHON: extension.h then leaves out paddle/utils/pybind.h (pybind11 and Paddle's
// Python type casters), which only an op that defines Python functions itself needs -- this one
// is reached through Paddle's custom-op registry.  Half of this file's compile time went there
// (7.3 s -> 3.4 s on Paddle 3.3.1, 6.4 s -> 2.6 s on 2.6.2, with -g0); the macro changes nothing
// else outside Windows inference builds (paddle/common/enforce.h).
#ifndef PADDLE_NO_PYTHON
#define PADDLE_NO_PYTHON
#endif
#include "paddle/extension.h"
#include "wgrad_core.h"
#include "wgrad_op.h"
#include "wgrad_gpu_plan.h"

#ifdef PMG_WITH_CUDA
#include "wgrad_cuda.h"
#include "wgrad_gpu_flow.h"
#endif

namespace {

pmg::DType to_pmg(paddle::DataType t, const char* what) {
  switch (t) {
    case paddle::DataType::FLOAT32: return pmg::DType::kF32;
    case paddle::DataType::BFLOAT16: return pmg::DType::kBF16;
    case paddle::DataType::FLOAT16: return pmg::DType::kF16;
    case paddle::DataType::FLOAT64: return pmg::DType::kF64;
    default: break;
  }
  PD_CHECK(false, what, " must be float32, bfloat16, float16 or float64");
  return pmg::DType::kF32;
}

paddle::DataType to_paddle(pmg::DType t) {
  switch (t) {
    case pmg::DType::kF32: return paddle::DataType::FLOAT32;
    case pmg::DType::kBF16: return paddle::DataType::BFLOAT16;
    case pmg::DType::kF16: return paddle::DataType::FLOAT16;
    case pmg::DType::kF64: return paddle::DataType::FLOAT64;
  }
  return paddle::DataType::FLOAT32;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t leading(const std::vector<int64_t>& s) {
  int64_t m = 1;
  for (size_t i = 0; i + 1 < s.size(); ++i) m *= s[i];
  return m;
}

// Allocated accumulators: the multi-precision type of the input (Paddle's
// MPTypeTrait: fp32, or fp64 for fp64) or the input dtype itself.
paddle::DataType acc_dtype(paddle::DataType in, bool multi_precision) {
  return multi_precision ? to_paddle(pmg::mp_type(to_pmg(in, "x"))) : in;
}

// The outputs: a given dweight / dbias is updated in place (beta = 1); a missing one is
// allocated on x's place (beta = 0).  Fills the accumulator half of `a`.  On a GPU this runs
// after the device guard (wgrad_gpu_flow.h).
void prepare_outputs(const paddle::Tensor& x, const paddle::optional<paddle::Tensor>& dweight,
                     const paddle::optional<paddle::Tensor>& dbias, bool multi_precision,
                     bool has_bias, pmg::WgradArgs* a, paddle::Tensor* dw_out,
                     paddle::Tensor* db_out) {
  const int64_t K = a->K, N = a->N;
  if (dweight) {
    *dw_out = *dweight;
    PD_CHECK(dw_out->shape() == std::vector<int64_t>({K, N}), "dweight ",
             shape_str(dw_out->shape()), " must be [K, N] = ", shape_str({K, N}));
    a->dw_beta = 1.f;
  } else {
    *dw_out = paddle::empty({K, N}, acc_dtype(x.dtype(), multi_precision), x.place());
    a->dw_beta = 0.f;
  }
  a->dw = dw_out->numel() > 0 ? dw_out->data() : nullptr;  // zero-size: nothing to write
  a->dw_dtype = to_pmg(dw_out->dtype(), "dweight");
  if (has_bias) {
    if (dbias) {
      *db_out = *dbias;
      PD_CHECK(db_out->shape() == std::vector<int64_t>({N}), "dbias ", shape_str(db_out->shape()),
               " must be [N] = ", shape_str({N}));
      a->db_beta = 1.f;
    } else {
      *db_out = paddle::empty({N}, acc_dtype(x.dtype(), multi_precision), x.place());
      a->db_beta = 0.f;
    }
    a->db = db_out->numel() > 0 ? db_out->data() : nullptr;
    a->db_dtype = to_pmg(db_out->dtype(), "dbias");
  } else {
    // A one-element placeholder: Paddle 2.6 rejects zero-size custom-op outputs
    // as "not initialized".  The Python wrapper returns None instead.
    *db_out = paddle::empty({1}, acc_dtype(x.dtype(), multi_precision), x.place());
  }
}

pmg::Placement placement(const paddle::Tensor& t) {
  pmg::Placement p;
  if (t.is_cpu()) {
    p.kind = 0;
  } else if (t.is_gpu()) {
    p.kind = 1;
    p.device = t.place().GetDeviceId();
  } else {
    p.kind = 2;
  }
  return p;
}

#ifdef PMG_WITH_CUDA
}  // namespace

// Paddle's own current-device functions (paddle/phi/backends/gpu/gpu_info.h, exported by
// 2.6 and 3.x; that header itself pulls in cuDNN's).  Paddle's runtime is not ours: its
// view of the current device is what Tensor::stream() and its allocator read.
namespace phi {
namespace backends {
namespace gpu {
int GetCurrentDeviceId();
void SetDeviceId(int device_id);
}  // namespace gpu
}  // namespace backends
}  // namespace phi

namespace {

// The GPU host of pmg::gpu_flow (wgrad_gpu_flow.h): Paddle tensors, device, allocator.
struct PaddleGpuHost {
  const paddle::Tensor& x;
  const paddle::Tensor& dout;
  const paddle::optional<paddle::Tensor>& dweight;
  const paddle::optional<paddle::Tensor>& dbias;
  bool multi_precision, has_bias;
  paddle::Tensor dw_out, db_out;
  std::vector<paddle::Tensor> scratch;  // alive until the op returns; freed in stream order
  std::string alloc_error;
  std::vector<const paddle::Tensor*> inputs;
  std::vector<const char*> names;

  PaddleGpuHost(const paddle::Tensor& x_, const paddle::Tensor& dout_,
                const paddle::optional<paddle::Tensor>& dw_,
                const paddle::optional<paddle::Tensor>& db_, bool mp, bool bias)
      : x(x_), dout(dout_), dweight(dw_), dbias(db_), multi_precision(mp), has_bias(bias) {
    inputs = {&x, &dout};
    names = {"x", "dout"};
    if (dweight) {
      inputs.push_back(&*dweight);
      names.push_back("dweight");
    }
    if (has_bias && dbias) {
      inputs.push_back(&*dbias);
      names.push_back("dbias");
    }
  }
  int count() const { return static_cast<int>(inputs.size()); }
  const char* name(int i) const { return names[i]; }
  pmg::Placement place(int i) const { return placement(*inputs[i]); }
  const char* env(const char* var) const { return std::getenv(var); }

  class Guard {
   public:
    explicit Guard(int device) {
      try {
        const int cur = phi::backends::gpu::GetCurrentDeviceId();
        if (cur != device) {
          phi::backends::gpu::SetDeviceId(device);
          prev_ = cur;
        }
      } catch (const std::exception& e) {
        err_ = "cannot make gpu:" + std::to_string(device) + " current: " + e.what();
      }
    }
    ~Guard() {
      if (prev_ < 0) return;
      try {
        phi::backends::gpu::SetDeviceId(prev_);
      } catch (...) {
      }
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    bool ok() const { return err_.empty(); }
    std::string error() const { return err_; }

   private:
    int prev_ = -1;
    std::string err_;
  };
  Guard enter_device(int device) { return Guard(device); }
  void* stream() { return reinterpret_cast<void*>(x.stream()); }
  std::string allocate_outputs(pmg::WgradArgs* a) {
    prepare_outputs(x, dweight, dbias, multi_precision, has_bias, a, &dw_out, &db_out);
    return "";
  }
  static void* allocate_workspace(size_t bytes, void* self) {
    auto* h = static_cast<PaddleGpuHost*>(self);
    try {
      h->scratch.push_back(
          paddle::empty({static_cast<int64_t>(bytes)}, paddle::DataType::UINT8, h->x.place()));
      return h->scratch.back().data();
    } catch (const std::exception& e) {
      h->alloc_error = e.what();
      return nullptr;
    }
  }
  std::string run_core(const pmg::WgradArgs& a, const pmg::CudaExec& exec) {
    std::string err = pmg::wgrad_cuda(a, exec);
    if (!err.empty() && !alloc_error.empty()) err += " (" + alloc_error.substr(0, 500) + ")";
    return err;
  }
};
#endif  // PMG_WITH_CUDA

}  // namespace

namespace pmg_bind {

std::vector<paddle::Tensor> FusedWgrad(const paddle::Tensor& x, const paddle::Tensor& dout,
                                       const paddle::optional<paddle::Tensor>& dweight,
                                       const paddle::optional<paddle::Tensor>& dbias,
                                       bool multi_precision, bool has_bias) {
  const auto xs = x.shape(), ys = dout.shape();
  PD_CHECK(xs.size() >= 2 && ys.size() == xs.size(), "x ", shape_str(xs), " and dout ",
           shape_str(ys), " must have the same rank >= 2");
  for (size_t i = 0; i + 1 < xs.size(); ++i)
    PD_CHECK(xs[i] == ys[i], "leading dims of x ", shape_str(xs), " and dout ", shape_str(ys),
             " differ");
  PD_CHECK(x.dtype() == dout.dtype(), "x and dout dtypes differ");
  const int64_t M = leading(xs), K = xs.back(), N = ys.back();
  const pmg::DType in_t = to_pmg(x.dtype(), "x");
  // With multi_precision a given accumulator must be the multi-precision type itself (the
  // core also accepts the input dtype, which is the multi_precision=False rule): checked
  // here, before anything is written, so that this op refuses everything
  // paddle_mgrad.ops._inputs.check refuses (the Python wrapper's fast path relies on it).
  if (multi_precision) {
    const paddle::DataType want = acc_dtype(x.dtype(), true);
    PD_CHECK(!dweight || dweight->dtype() == want,
             "dweight must be the multi-precision type when multi_precision=True");
    PD_CHECK(!(has_bias && dbias) || dbias->dtype() == want,
             "dbias must be the multi-precision type when multi_precision=True");
  }

  pmg::WgradArgs a;
  a.in_dtype = in_t;
  a.M = M;
  a.K = K;
  a.N = N;
  // A zero-element tensor has no buffer: pass null, the core reads only what it needs.
  a.x = x.numel() > 0 ? x.data() : nullptr;
  a.dy = dout.numel() > 0 ? dout.data() : nullptr;
  paddle::Tensor dw_out, db_out;
  std::string err;
  if (x.is_cpu()) {
    // every input on the CPU too: a GPU accumulator would be written through a device pointer
    const pmg::Placement places[] = {placement(x), placement(dout),
                                     dweight ? placement(*dweight) : placement(x),
                                     dbias && has_bias ? placement(*dbias) : placement(x)};
    const char* const names[] = {"x", "dout", "dweight", "dbias"};
    err = pmg::check_places(names, places, 4);
    PD_CHECK(err.empty(), "paddle_mgrad fused_linear_param_grad_add: ", err);
    prepare_outputs(x, dweight, dbias, multi_precision, has_bias, &a, &dw_out, &db_out);
    err = pmg::check_args(a);  // the accumulator-dtype rule lives in the core
    PD_CHECK(err.empty(), "paddle_mgrad fused_linear_param_grad_add: ", err);
    err = pmg::wgrad_cpu(a);
#ifdef PMG_WITH_CUDA
  } else if (x.is_gpu()) {
    PaddleGpuHost host(x, dout, dweight, dbias, multi_precision, has_bias);
    err = pmg::gpu_flow(host, a);
    dw_out = host.dw_out;
    db_out = host.db_out;
#endif
  } else {
    PD_CHECK(false, "paddle_mgrad fused_linear_param_grad_add: x is on ", x.place().DebugString(),
             "; this op runs CPU tensors",
#ifdef PMG_WITH_CUDA
             " and GPU tensors",
#endif
             " (paddle_mgrad.ops.fused_linear_param_grad_add sends other places to Paddle)");
  }
  PD_CHECK(err.empty(), "paddle_mgrad fused_linear_param_grad_add: ", err);
  return {dw_out, db_out};
}

// The whole ordinary backward of y = x . W (+ b) for float32 / float64 CPU tensors in one call
// (in a model's step each dispatch into Paddle from Python costs the host ~10 us, as much as a
// small layer's GEMMs), the fast entry's linear_bwd (wgrad_pyentry.cc):
//
//   FusedLinearBwd(x, dout, weight, dweight?, dbias?, has_bias) -> {dx, dweight_out, dbias_out}
//
// dx = dout . W^T by Paddle's own matmul kernel (its C++ API: the same kernel, hence the same
// dx, as the Python matmul it replaces, and on Paddle's own BLAS threads -- MKL's OpenMP runtime
// on x86 wheels: moving this GEMM onto our libgomp regions made them wait for MKL's threads,
// which spin for 200 ms after each of Paddle's matmuls, and the llama example got slower);
// the weight/bias gradients exactly as pmg_fused_wgrad_add(x, dout, dweight, dbias,
// multi_precision=True, has_bias).  Everything that can fail -- the checks below, dx's
// matmul, FusedWgrad's own checks -- happens before the first write, so a refused call leaves
// the accumulators untouched (the Python caller then takes the checked path and raises its
// error).
std::vector<paddle::Tensor> FusedLinearBwd(const paddle::Tensor& x, const paddle::Tensor& dout,
                                           const paddle::Tensor& weight,
                                           const paddle::optional<paddle::Tensor>& dweight,
                                           const paddle::optional<paddle::Tensor>& dbias,
                                           bool has_bias) {
  PD_CHECK(x.is_cpu() && dout.is_cpu() && weight.is_cpu(),
           "linear_bwd: x, dout and weight must be CPU tensors");
  PD_CHECK((x.dtype() == paddle::DataType::FLOAT32 || x.dtype() == paddle::DataType::FLOAT64) &&
               dout.dtype() == x.dtype() && weight.dtype() == x.dtype(),
           "linear_bwd: x, dout and weight must be float32 (or all float64)");
  const auto xs = x.shape(), ys = dout.shape(), ws = weight.shape();
  PD_CHECK(!xs.empty() && !ys.empty() && ws.size() == 2 && ws[0] == xs.back() && ws[1] == ys.back(),
           "linear_bwd: weight ", shape_str(ws), " must be [K, N] for x ", shape_str(xs),
           " and dout ", shape_str(ys));
  // A zero-size product (M, K or N = 0) is the checked path's (it handles every case of it):
  // refused here, before writing.
  PD_CHECK(leading(xs) > 0 && ws[0] > 0 && ws[1] > 0, "linear_bwd: x ", shape_str(xs),
           " and weight ", shape_str(ws), ": a zero-size product (M, K or N = 0)");
  paddle::Tensor dx = paddle::experimental::matmul(dout, weight, false, true);
  std::vector<paddle::Tensor> grads = FusedWgrad(x, dout, dweight, dbias, true, has_bias);
  return {dx, grads[0], grads[1]};
}

}  // namespace pmg_bind

namespace {

std::vector<std::vector<int64_t>> FusedWgradInferShape(
    const std::vector<int64_t>& x_shape, const std::vector<int64_t>& dout_shape,
    const paddle::optional<std::vector<int64_t>>& dweight_shape,
    const paddle::optional<std::vector<int64_t>>& dbias_shape, bool multi_precision,
    bool has_bias) {
  const int64_t K = x_shape.back(), N = dout_shape.back();
  return {{K, N}, {has_bias ? N : 1}};
}

std::vector<paddle::DataType> FusedWgradInferDtype(
    const paddle::DataType& x_dtype, const paddle::DataType& dout_dtype,
    const paddle::optional<paddle::DataType>& dweight_dtype,
    const paddle::optional<paddle::DataType>& dbias_dtype, bool multi_precision, bool has_bias) {
  const auto acc = acc_dtype(x_dtype, multi_precision);
  return {dweight_dtype ? *dweight_dtype : acc, dbias_dtype ? *dbias_dtype : acc};
}

// A tiny op that reports what runs, as int32[5]:
//   [0] CPU GEMM compiled in (1 = oneDNN, 0 = portable), [1] CUDA compiled in,
//   [2] native bf16: the CPU has avx512_bf16 / AMX (run-time cpuid) and oneDNN uses it,
//   [3] bf16 inputs would run now as 1 = oneDNN bf16 GEMM, 0 = widen + fp32 GEMM,
//       -1 = PADDLE_MGRAD_CPU_BF16 is invalid,
//   [4] bf16 calls so far that the oneDNN path widened for exactness (saturates at 2^31-1).
std::vector<paddle::Tensor> BackendInfo(const paddle::Tensor& any) {
  auto out = paddle::empty({5}, paddle::DataType::INT32, paddle::CPUPlace());
  int* p = out.data<int>();
  p[0] = std::string(pmg::cpu_gemm_backend()) == "onednn" ? 1 : 0;
#ifdef PMG_WITH_CUDA
  p[1] = 1;
#else
  p[1] = 0;
#endif
  p[2] = pmg::cpu_has_native_bf16() ? 1 : 0;
  const std::string path = pmg::cpu_bf16_path();
  p[3] = path == "onednn-bf16" ? 1 : (path == "widen-sgemm" ? 0 : -1);
  p[4] = static_cast<int>(std::min<uint64_t>(pmg::cpu_bf16_exact_fallbacks(), 0x7fffffff));
  return {out};
}

std::vector<std::vector<int64_t>> BackendInfoInferShape(const std::vector<int64_t>&) {
  return {{5}};
}

std::vector<paddle::DataType> BackendInfoInferDtype(const paddle::DataType&) {
  return {paddle::DataType::INT32};
}

}  // namespace

// In place, undeclared: given DWeight / DBias, the kernel accumulates into them and returns
// them as DWeightOut / DBiasOut (the same storage); not given, it allocates DWeightOut /
// DBiasOut and writes them with beta 0 (no zero fill).  SetInplaceMap cannot say that: Paddle's
// custom-op in-place mapping (2.6 and 3.x alike) makes the output of an optional in-place input
// a paddle::Optional output that is left uninitialized -- None in Python -- when the input is
// absent, so the freshly allocated gradient of the first micro-batch would be lost.  Declaring
// it would need every caller to allocate and zero the accumulators first (an extra pass over
// each weight gradient) or a second op.  The writes go only to the gradient buffers paddle_mgrad
// itself passes from the backward (param.main_grad, the bias gradient); tests/ops/test_ops.py
// test_raw_op_writes_given_accumulators_in_place_and_allocates_absent_ones checks both halves.
PD_BUILD_OP(pmg_fused_wgrad_add)
    .Inputs({"X", "DOut", paddle::Optional("DWeight"), paddle::Optional("DBias")})
    .Outputs({"DWeightOut", "DBiasOut"})
    .Attrs({"multi_precision: bool", "has_bias: bool"})
    .SetKernelFn(PD_KERNEL(pmg_bind::FusedWgrad))
    .SetInferShapeFn(PD_INFER_SHAPE(FusedWgradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(FusedWgradInferDtype));

PD_BUILD_OP(pmg_backend_info)
    .Inputs({"Any"})
    .Outputs({"Info"})
    .SetKernelFn(PD_KERNEL(BackendInfo))
    .SetInferShapeFn(PD_INFER_SHAPE(BackendInfoInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(BackendInfoInferDtype));
