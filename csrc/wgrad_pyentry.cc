// The Python fast entry of the op library: three CPython functions for the fused linear's hot
// path (paddle_mgrad/linear.py, paddle_mgrad/ops), reached without Paddle's custom-op dispatch.
//
//   route(x, weight, bias, transpose_weight) -> RouteFacts | None | False | NotImplemented
//     What routing.route decides from x/weight/bias's meta (type, dense, rank, dtype, shape,
//     place), in the same order, in one call instead of about a dozen calls into Paddle: None
//     when the call is Paddle's, False when x's last dim does not match the weight (the caller
//     raises its error naming the shapes), else the facts the PyLayer keeps: a
//     RouteFacts(dtype, where, main_grads) (paddle_mgrad/ops/_inputs.py, made once per
//     combination by pmg_fast_module).  "where" is "cpu" or "gpu" for the common case of the
//     fast backward (CPU or CUDA tensors, K, N > 0), else None.  main_grads: the weight's and
//     bias's main_grad attributes are absent, None or dense tensors of the master dtype (the
//     forward's check would pass and is skipped; False: the forward checks, and raises).
//     Anything unexpected (a C++ exception reading a meta, say of an uninitialized tensor)
//     returns NotImplemented: the caller asks Python's _route, which behaves as it always did.
//     stop_gradient and grad mode stay with the Python caller (attribute reads; the autograd
//     meta's layout is not in Paddle's published headers).
//
//   linear_bwd(x, dout, weight, dweight, dbias, has_bias) -> (dx, dweight_out, dbias_out) | None
//     pmg_bind::FusedLinearBwd (wgrad_op.cc) called directly: dx = dout . W^T by Paddle's
//     matmul (float32 / float64), the weight/bias gradients accumulated into dweight/dbias, or
//     into new multi-precision tensors where those are None.
//   wgrad_add(x, dout, dweight, dbias, multi_precision, has_bias) -> (None, dweight_out, dbias_out)
//                                                                     | None
//     pmg_fused_wgrad_add's kernel called directly (every dtype the op takes).
//
//   Both: dweight_out / dbias_out are the new tensors when the caller passed None, else None
//   (the caller holds the accumulator it passed; no second Python object for it).  None
//   instead of a result when the call is not for this entry -- a tensor that is not a dense
//   contiguous Paddle tensor (Paddle's custom-op runner would have made contiguous copies of
//   x/dout; a strided accumulator must not be copied at all) -- and when the kernel refuses
//   the call, which it does before writing anything: the caller then takes the checked path,
//   which raises the usual error.  The GIL is released while a kernel runs, as Paddle's own
//   operators do.
//
// Why: in a model's step every call from Python into Paddle costs the host about a
// microsecond, and a custom op's dispatch (_run_custom_op: attribute parsing, AMP and
// contiguity handling, output wrapping) about 6-7 us more than Paddle's own operators.
//
// Paddle side: paddle/utils/pybind.h (Paddle 2.6 and 3.x) publishes the Python tensor's
// accessors used here -- PyCheckTensor, CastPyArg2Tensor, ToPyObject -- but including it pulls
// in pybind11 (half of a binding's compile time), so they are declared here, weak: a Paddle
// without one of them leaves the entry unavailable (pmg_fast_module returns None) instead of
// the library failing to load.  Nothing here includes a phi header beyond paddle/extension.h and
// paddle/common/ddim.h (phi/core/dense_tensor.h includes cudnn.h in a CUDA build).
#include <Python.h>

#include <exception>
#include <string>
#include <vector>

#ifndef PADDLE_NO_PYTHON
#define PADDLE_NO_PYTHON  // see wgrad_op.cc
#endif
#include "paddle/common/ddim.h"  // (Tensor::dims/strides; Paddle 2.6 and 3.x, no CUDA headers)
#include "paddle/extension.h"
#include "wgrad_op.h"

namespace paddle {
namespace pybind {
__attribute__((weak)) bool PyCheckTensor(PyObject* obj);
__attribute__((weak)) paddle::Tensor& CastPyArg2Tensor(PyObject* obj, Py_ssize_t arg_pos);
__attribute__((weak)) PyObject* ToPyObject(const paddle::Tensor& value,
                                           bool return_py_none_if_not_initialize);
}  // namespace pybind
}  // namespace paddle

namespace {

namespace pb = paddle::pybind;

// RouteFacts(dtype name, where, main_grads), made once: the route's answers; where: None,
// "cpu", "gpu"
PyObject* g_facts[4][3][2];
PyObject* g_main_grad;  // the interned name "main_grad"
const char* const kWhere[3] = {nullptr, "cpu", "gpu"};
const char* const kDtypeNames[4] = {"float32", "bfloat16", "float16", "float64"};

int dtype_index(paddle::DataType t) {
  switch (t) {
    case paddle::DataType::FLOAT32: return 0;
    case paddle::DataType::BFLOAT16: return 1;
    case paddle::DataType::FLOAT16: return 2;
    case paddle::DataType::FLOAT64: return 3;
    default: return -1;
  }
}

// A Paddle eager tensor (subclasses included: parameters) holding a DenseTensor, or null.
const paddle::Tensor* dense(PyObject* obj) {
  if (!pb::PyCheckTensor(obj)) return nullptr;
  const paddle::Tensor& t = pb::CastPyArg2Tensor(obj, 0);
  return t.defined() && t.is_dense_tensor() ? &t : nullptr;  // (no impl: nothing to classify)
}

// Row-major with no gaps: Paddle's own rule (DenseTensorMeta::is_contiguous, strides equal to
// those computed from the dims), through the public Tensor API -- paddle/phi/core/dense_tensor.h
// would pull in cudnn.h in a CUDA build.  A tensor without elements reads no memory.
bool contiguous(const paddle::Tensor& t) {
  if (t.numel() == 0) return true;
  const auto& dims = t.dims();
  const auto& strides = t.strides();
  if (strides.size() != dims.size()) return false;
  int64_t want = 1;
  for (int i = dims.size() - 1; i >= 0; --i) {
    if (strides[i] != want) return false;
    want *= dims[i];
  }
  return true;
}

// Whether p's main_grad (getattr(p, "main_grad", None), the forward's check) is None or a dense
// tensor of dtype want: the rule of linear.check_main_grad, which raises where this is false.
// Any error reading it: false (the check asks again and raises what Python raises).
bool main_grad_ok(PyObject* p, paddle::DataType want) {
  PyObject* mg = PyObject_GetAttr(p, g_main_grad);
  if (!mg) {
    // No attribute: nothing to check.  Any other error (a property that raises) is not an
    // absent main_grad: the checked Python path reads it again and raises the user's error.
    const bool absent = PyErr_ExceptionMatches(PyExc_AttributeError);
    PyErr_Clear();
    return absent;
  }
  bool ok = mg == Py_None;
  if (!ok) {
    try {
      const paddle::Tensor* t = dense(mg);
      ok = t && t->dtype() == want;
    } catch (...) {
    }
  }
  Py_DECREF(mg);
  return ok;
}

PyObject* py_none() {
  Py_INCREF(Py_None);
  return Py_None;
}

PyObject* route(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "route(x, weight, bias, transpose_weight)");
    return nullptr;
  }
  PyObject *xo = args[0], *wo = args[1], *bo = args[2];
  const int transpose = PyObject_IsTrue(args[3]);
  if (transpose < 0) return nullptr;
  try {
    const paddle::Tensor* x = dense(xo);
    const paddle::Tensor* w = x ? dense(wo) : nullptr;
    if (!w) return py_none();
    const paddle::Tensor* b = nullptr;
    if (bo != Py_None && !(b = dense(bo))) return py_none();
    const auto& ws = w->dims();
    const auto& xs = x->dims();
    if (ws.size() != 2 || xs.size() < 2) return py_none();
    const int di = dtype_index(x->dtype());
    if (di < 0 || w->dtype() != x->dtype()) return py_none();
    const int64_t k = transpose ? ws[1] : ws[0];
    const int64_t n = transpose ? ws[0] : ws[1];
    if (b && (b->dims().size() != 1 || b->dims()[0] != n || b->dtype() != x->dtype()))
      return py_none();
    const auto place = x->place();
    if (!(place == w->place())) return py_none();
    if (xs[xs.size() - 1] != k) Py_RETURN_FALSE;
    const int where = k > 0 && n > 0 ? (x->is_cpu() ? 1 : x->is_gpu() ? 2 : 0) : 0;
    // the master dtype (Paddle's MPTypeTrait, ops.mp_dtype): float64 for float64, else float32
    const auto mp = di == 3 ? paddle::DataType::FLOAT64 : paddle::DataType::FLOAT32;
    const int ok = main_grad_ok(wo, mp) && (!b || main_grad_ok(bo, mp));
    PyObject* facts = g_facts[di][where][ok];
    Py_INCREF(facts);
    return facts;
  } catch (...) {
    Py_RETURN_NOTIMPLEMENTED;  // the caller's Python route decides, as before
  }
}

// The tensors args[0..n) (those at index >= first_optional may be None) as dense contiguous
// tensors into t[]; false when one is not.
bool gather(PyObject* const* args, int n, int first_optional, const paddle::Tensor** t) {
  for (int i = 0; i < n; ++i) {
    t[i] = nullptr;
    if (i >= first_optional && args[i] == Py_None) continue;
    t[i] = dense(args[i]);
    if (!t[i] || !contiguous(*t[i])) return false;
  }
  return true;
}

// An optional accumulator: the tensor, or none for a None argument.
paddle::optional<paddle::Tensor> maybe(const paddle::Tensor* t) {
  return t ? paddle::optional<paddle::Tensor>(*t) : paddle::optional<paddle::Tensor>();
}

// (a, b, c) from new references, any of them null (the error set) or Py_None; steals them.
PyObject* triple(PyObject* a, PyObject* b, PyObject* c) {
  PyObject* res = a && b && c ? PyTuple_New(3) : nullptr;
  if (!res) {
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    return nullptr;
  }
  PyTuple_SET_ITEM(res, 0, a);
  PyTuple_SET_ITEM(res, 1, b);
  PyTuple_SET_ITEM(res, 2, c);
  return res;
}

// A kernel's output as a new Python tensor, or None when the caller passed the accumulator
// itself (it holds that object already) or there is none.  Null with a Python error set if
// wrapping fails (no C++ exception leaves a function Python calls: it would abort).
PyObject* wrap(const paddle::Tensor& out, bool wanted) {
  if (!wanted) return py_none();
  try {
    return pb::ToPyObject(out, false);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "paddle_mgrad fast entry: wrapping an output failed");
  }
  return nullptr;
}

template <typename F>
bool run_released(F&& kernel) {
  bool refused = false;
  Py_BEGIN_ALLOW_THREADS;
  try {
    kernel();
  } catch (...) {
    refused = true;  // before any write (wgrad_op.cc): the caller's checked path raises
  }
  Py_END_ALLOW_THREADS;
  return !refused;
}

PyObject* linear_bwd(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "linear_bwd(x, dout, weight, dweight, dbias, has_bias)");
    return nullptr;
  }
  const int has_bias = PyObject_IsTrue(args[5]);
  if (has_bias < 0) return nullptr;
  const paddle::Tensor* t[5];
  if (!gather(args, 5, 3, t)) return py_none();
  // copies (a shared reference each): what runs without the GIL owns its tensors, whatever
  // another thread does to the Python objects meanwhile
  const paddle::Tensor x = *t[0], dout = *t[1], w = *t[2];
  const auto dw = maybe(t[3]), db = maybe(t[4]);
  std::vector<paddle::Tensor> out;
  if (!run_released([&] { out = pmg_bind::FusedLinearBwd(x, dout, w, dw, db, has_bias); }))
    return py_none();
  return triple(wrap(out[0], true), wrap(out[1], !t[3]), wrap(out[2], has_bias && !t[4]));
}

PyObject* wgrad_add(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "wgrad_add(x, dout, dweight, dbias, multi_precision, has_bias)");
    return nullptr;
  }
  const int mp = PyObject_IsTrue(args[4]), has_bias = PyObject_IsTrue(args[5]);
  if (mp < 0 || has_bias < 0) return nullptr;
  const paddle::Tensor* t[4];
  if (!gather(args, 4, 2, t)) return py_none();
  const paddle::Tensor x = *t[0], dout = *t[1];  // (copies: see linear_bwd)
  const auto dw = maybe(t[2]), db = maybe(t[3]);
  std::vector<paddle::Tensor> out;
  if (!run_released([&] { out = pmg_bind::FusedWgrad(x, dout, dw, db, mp, has_bias); }))
    return py_none();
  return triple(py_none(), wrap(out[0], !t[2]), wrap(out[1], has_bias && !t[3]));
}

PyMethodDef g_methods[] = {
    {"route", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(route)), METH_FASTCALL,
     "routing.route's answer from the tensors' meta in one call (wgrad_pyentry.cc)."},
    {"linear_bwd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(linear_bwd)),
     METH_FASTCALL, "A float32/float64 CPU linear's backward in one call (wgrad_pyentry.cc)."},
    {"wgrad_add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(wgrad_add)),
     METH_FASTCALL,
     "pmg_fused_wgrad_add's kernel without the custom-op dispatch (wgrad_pyentry.cc)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "paddle_mgrad_fast_entry",
                        "The op library's Python fast entry (csrc/wgrad_pyentry.cc).", -1,
                        g_methods};

}  // namespace

// The entry's module, made once per process; None when this Paddle lacks an accessor the entry
// needs.  ``facts_type``: the class of the route's answers, called once per (dtype, where,
// main_grads)
// (paddle_mgrad.ops._inputs.RouteFacts).  Called through ctypes.PyDLL (with the GIL) by
// paddle_mgrad/ops/_build.py.
extern "C" PyObject* pmg_fast_module(PyObject* facts_type) {
  static PyObject* module = nullptr;
  if (module) {
    Py_INCREF(module);
    return module;
  }
  if (!pb::PyCheckTensor || !pb::CastPyArg2Tensor || !pb::ToPyObject) return py_none();
  if (!g_main_grad && !(g_main_grad = PyUnicode_InternFromString("main_grad"))) return nullptr;
  for (int d = 0; d < 4; ++d)
    for (int w = 0; w < 3; ++w)
      for (int ok = 0; ok < 2; ++ok) {
        PyObject*& facts = g_facts[d][w][ok];
        if (!facts)
          facts = PyObject_CallFunction(facts_type, "szO", kDtypeNames[d], kWhere[w],
                                        ok ? Py_True : Py_False);
        if (!facts) return nullptr;
      }
  module = PyModule_Create(&g_module);
  if (!module) return nullptr;
  Py_INCREF(module);  // one reference stays here
  return module;
}
