// The CUDA core's order of steps, as a template over its GPU: the real one
// (wgrad_cuda.cu: CUDA runtime, cuBLASLt, our kernels) and a fake (FakeGpu in
// wgrad_capi.cc) whose heuristic results, SM count, GEMM workspace, pointer places,
// pending error and allocation failures the CPU tests choose.  So every decision
// the core makes between "called" and "launched" is tested without a GPU:
//
//   1. a CUDA error someone else left pending is reported as theirs (before anything);
//   2. argument checks no other binding makes: element alignment, M = 0 betas;
//   3. the device's capability (CUDA 13's libraries: sm_75 and newer) and SM count; every
//      pointer and the stream on exec.device;
//   4. the bias path before cuBLASLt (choose_bias), then after its heuristic
//      (decide_epilogue: the epilogue only where it costs the GEMM nothing);
//   5. kernel images for this GPU; the scratch layout;
//   6. scratch memory; when it cannot be had, the same plan without cuBLASLt workspace
//      (plan_and_allocate);
//   7. the launches.  Everything before 7 writes nothing.
//
// Gpu requirements (see FakeGpu in wgrad_capi.cc for a complete one):
//   std::string pending_error();                       -- "" or pending_error_message(...)
//   std::string device_info(int* cap, int* sms);
//   int cuda_major();                                  -- the CUDA release built against
//   std::string pointer_place(const void* p, PointerPlace* out);   -- kind and device
//   std::string stream_device(void* stream, int* device);          -- -1 when unknown
//   std::string heuristic(const WgradArgs&, bool epilogue, uint64_t max_workspace,
//                         GemmCandidate* out, std::string* why_none, CudaReport* rep);
//   std::string check_images(int cap, bool simulated, BiasPath, DType in);
//   void* alloc(size_t bytes, std::string* why, CudaReport* rep);  -- null when it cannot
//   std::string launch(const WgradArgs&, const CallPlan&, char* base, int sms);
#pragma once

#include <string>

#include "wgrad_core.h"
#include "wgrad_cuda.h"
#include "wgrad_gpu_plan.h"

namespace pmg {

template <class Gpu>
std::string cuda_core_flow(Gpu& gpu, const WgradArgs& a, const CudaExec& exec, CudaReport* rep) {
  std::string err;
#define PMG_FLOW_TRY(expr)        \
  do {                            \
    err = (expr);                 \
    if (!err.empty()) return err; \
  } while (0)
  if (exec.device < 0) return "no CUDA device given (CudaExec.device)";
  PMG_FLOW_TRY(gpu.pending_error());
  PMG_FLOW_TRY(check_element_alignment(a));
  PMG_FLOW_TRY(check_rowless_beta(a));
  int cap = 0, sms = 0;
  PMG_FLOW_TRY(gpu.device_info(&cap, &sms));
  const bool simulated = exec.sim_capability > 0;
  if (simulated) cap = exec.sim_capability;
  rep->capability = cap;
  PMG_FLOW_TRY(check_library_support(cap, gpu.cuda_major(), simulated));

  const bool gemm = a.dw != nullptr && a.K > 0 && a.N > 0;
  const bool matmul = gemm && a.M > 0;
  const bool bias = a.db != nullptr && a.N > 0;
  {
    const struct {
      const char* name;
      const void* p;
      bool used;
    } used[] = {{"x", a.x, matmul},
                {"dy", a.dy, matmul || (bias && a.M > 0)},
                {"dweight", a.dw, gemm},
                {"dbias", a.db, bias}};
    PointerPlace places[4];
    int n = 0;
    for (const auto& u : used) {
      if (!u.used || u.p == nullptr) continue;
      places[n].name = u.name;
      PMG_FLOW_TRY(gpu.pointer_place(u.p, &places[n]));
      ++n;
    }
    int stream_dev = -1;
    PMG_FLOW_TRY(gpu.stream_device(exec.stream, &stream_dev));
    PMG_FLOW_TRY(check_pointer_places(places, n, exec.device, stream_dev));
  }

  const BiasChoice choice = choose_bias(a, exec.bias_mode);
  if (choice.refused) return "PADDLE_MGRAD_CUDA_BIAS=epilogue, but it cannot apply: " + choice.why;
  auto plan = [&](uint64_t max_ws, CallPlan* cp) -> std::string {
    std::string e;
    cp->path = choice.path;
    cp->why = choice.why;
    cp->gemm = GemmCandidate();
    if (matmul) {
      const bool want_epi = choice.path == BiasPath::kEpilogue;
      GemmCandidate epi, plain;
      std::string epi_why, plain_why;
      if (want_epi) {
        e = gpu.heuristic(a, true, max_ws, &epi, &epi_why, rep);
        if (!e.empty()) return e;
      }
      if (!want_epi || exec.bias_mode != BiasMode::kEpilogue) {
        e = gpu.heuristic(a, false, max_ws, &plain, &plain_why, rep);
        if (!e.empty()) return e;
      }
      if (want_epi) {
        const EpilogueDecision d = decide_epilogue(exec.bias_mode, epi, epi_why, plain);
        if (!d.error.empty()) return d.error;
        cp->path = d.path;
        cp->why = d.why;
      }
      cp->gemm = cp->path == BiasPath::kEpilogue ? epi : plain;
      if (!cp->gemm.found) return plain_why;
    }
    e = gpu.check_images(cap, simulated, cp->path, a.in_dtype);
    if (!e.empty()) return e;
    cp->ws = plan_workspace(a, cp->path, cp->gemm.found ? cp->gemm.workspace : 0, sms);
    return "";
  };
  auto alloc = [&](size_t bytes, std::string* why) -> void* { return gpu.alloc(bytes, why, rep); };
  CallPlan cp;
  char* base = nullptr;
  bool retried = false;
  err = plan_and_allocate(plan, alloc, &cp, &base, &retried);
  rep->bias = cp.path;
  rep->bias_why = cp.why;
  rep->workspace_retry = retried;
  if (!err.empty()) return err;
  rep->workspace_bytes = cp.ws.request;
  return gpu.launch(a, cp, base, sms);
#undef PMG_FLOW_TRY
}

}  // namespace pmg
