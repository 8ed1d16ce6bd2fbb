// The Paddle binding's GPU branch, as a template over its host: the real one
// (wgrad_op.cc: Paddle tensors, Paddle's device guard, Paddle's allocator) and a
// recording fake (wgrad_capi.cc) that CPU tests drive through the C ABI.  So the
// order of what the binding does on a GPU -- and every decision it still makes --
// is tested without one:
//
//   1. every input is on x's device (before anything touches a device);
//   2. PADDLE_MGRAD_CUDA_BIAS is valid;
//   3. the device guard is entered FIRST: Paddle's Tensor::stream() and its
//      allocations use the *current* device (tensor.cc reads GetCurrentDeviceId()),
//      which a new thread or a tensor on a non-default GPU need not have set;
//   4. then the stream and the fresh outputs, on that device; check_args;
//   5. the core, told the device and stream explicitly, with scratch memory from
//      the host's allocator (Paddle's caching allocator: retries under memory
//      pressure, CUDA-graph aware).
//
// Host requirements (see FakeHost in wgrad_capi.cc for a complete one):
//   int count() const; const char* name(int i) const; Placement place(int i) const;
//       -- x first, then dout, then the given dweight / dbias;
//   const char* env(const char* name) const;
//   Guard enter_device(int device);   -- RAII; Guard::ok(), Guard::error();
//   void* stream();                    -- the current device's stream;
//   std::string allocate_outputs(WgradArgs* a);  -- fresh dweight/dbias, pointers into a;
//   static void* allocate_workspace(size_t bytes, void* host);  -- a WorkspaceAllocFn;
//   std::string run_core(const WgradArgs& a, const CudaExec& exec).
#pragma once

#include <string>
#include <vector>

#include "wgrad_core.h"
#include "wgrad_cuda.h"
#include "wgrad_gpu_plan.h"

namespace pmg {

template <class Host>
std::string gpu_flow(Host& host, WgradArgs a) {
  std::vector<const char*> names;
  std::vector<Placement> places;
  for (int i = 0; i < host.count(); ++i) {
    names.push_back(host.name(i));
    places.push_back(host.place(i));
  }
  std::string err = check_places(names.data(), places.data(), host.count());
  if (!err.empty()) return err;
  const int device = places[0].device;
  BiasMode mode = BiasMode::kAuto;
  err = parse_bias_mode(host.env("PADDLE_MGRAD_CUDA_BIAS"), &mode);
  if (!err.empty()) return err;

  auto guard = host.enter_device(device);  // first: everything below uses the current device
  if (!guard.ok()) return guard.error();
  void* stream = host.stream();
  err = host.allocate_outputs(&a);
  if (!err.empty()) return err;
  err = check_args(a);
  if (!err.empty()) return err;

  CudaExec exec;
  exec.device = device;
  exec.stream = stream;
  exec.alloc = &Host::allocate_workspace;
  exec.alloc_user = &host;
  exec.bias_mode = mode;
  return host.run_core(a, exec);
}

}  // namespace pmg
