// The output tensors of an op made in one call into torch's C++ allocator. A
// tensor made from Python (new_empty) costs about 1.5-2 us of argument
// parsing and dispatch; here each costs the allocation and its Python object.
// Each allocation and its free still cost about 3 us of host time on CUDA, so
// an op's small outputs (top-k, indices, prefix sums) share one.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

#include "torch_ext.hpp"

namespace turnout::torch_ext {

namespace {

// Where a packed tensor starts in its block: a boundary no kernel's vector
// access or element type outgrows.
constexpr int64_t kPackAlign = 128;

int64_t packed_bytes(const OutputSpec& s) {
  int64_t bytes = 0;
  const bool overflow = __builtin_mul_overflow(s.rows, s.cols < 0 ? 1 : s.cols, &bytes) ||
                        __builtin_mul_overflow(bytes, static_cast<int64_t>(c10::elementSize(s.type)), &bytes) ||
                        __builtin_add_overflow(bytes, kPackAlign - 1, &bytes);
  TORCH_CHECK(!overflow, "a packed output of ", s.rows, " x ", s.cols, " ", s.type, " has no size that fits 63 bits");
  return bytes / kPackAlign * kPackAlign;
}

at::Tensor alone(const at::TensorOptions& on, const OutputSpec& s) {
  const auto opts = on.dtype(s.type);
  return s.cols < 0 ? at::empty({s.rows}, opts) : at::empty({s.rows, s.cols}, opts);
}

// A contiguous tensor of `s` over `block`'s storage from byte `offset`: what
// block.view(...) would give, without a dispatched op for each.
at::Tensor part_of(const at::Tensor& block, int64_t offset, const OutputSpec& s) {
  const caffe2::TypeMeta type = c10::scalarTypeToTypeMeta(s.type);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(block.storage()), block.key_set(), type);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (s.cols < 0)
    impl->set_sizes_contiguous({s.rows});
  else
    impl->set_sizes_contiguous({s.rows, s.cols});
  impl->set_storage_offset(offset / static_cast<int64_t>(type.itemsize()));
  return t;
}

// The specs of empty's arguments from `first` on: (code, rows, cols) triples.
bool parse_specs(const char* name, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t first,
                 std::vector<OutputSpec>* specs) {
  if (nargs < first || (nargs - first) % 3 != 0) {
    PyErr_Format(PyExc_TypeError, "%s: wrong number of arguments ((code, rows, cols) triples)", name);
    return false;
  }
  if (!THPDevice_Check(args[0])) {
    PyErr_Format(PyExc_TypeError, "%s: device must be a torch.device, got %s", name, Py_TYPE(args[0])->tp_name);
    return false;
  }
  for (Py_ssize_t i = first; i < nargs; i += 3) {
    const long code = PyLong_AsLong(args[i]);
    const long long rows = PyLong_AsLongLong(args[i + 1]);
    const long long cols = PyLong_AsLongLong(args[i + 2]);
    if (PyErr_Occurred()) return false;
    if (code < 0 || code >= static_cast<long>(kTypes.size()) || rows < 0) {
      PyErr_Format(PyExc_ValueError, "%s: tensor %zd: code %ld and rows %lld (a code below %zu, rows >= 0)", name,
                   (i - first) / 3, code, rows, kTypes.size());
      return false;
    }
    specs->push_back({kTypes[code], rows, cols});
  }
  return true;
}

}  // namespace

PyObject* tuple_of(std::vector<at::Tensor>&& tensors) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(tensors.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* item = Py_None;
    if (tensors[i].defined())
      item = THPVariable_Wrap(std::move(tensors[i]));
    else
      Py_INCREF(item);
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

std::vector<at::Tensor> make_outputs(const at::TensorOptions& on, const OutputSpec* specs, size_t count,
                                     size_t separate) {
  std::vector<at::Tensor> out;
  out.reserve(count);
  for (size_t i = 0; i < count && i < separate; ++i) out.push_back(alone(on, specs[i]));
  if (count <= separate) return out;
  int64_t bytes = 0;
  for (size_t i = separate; i < count; ++i)
    TORCH_CHECK(!__builtin_add_overflow(bytes, packed_bytes(specs[i]), &bytes), "packed outputs over 63 bits of bytes");
  const at::Tensor block = at::empty({bytes}, on.dtype(at::kByte));
  int64_t offset = 0;
  for (size_t i = separate; i < count; ++i) {
    out.push_back(part_of(block, offset, specs[i]));
    offset += packed_bytes(specs[i]);
  }
  return out;
}

PyObject* empty(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  std::vector<OutputSpec> specs;
  if (!parse_specs("empty", args, nargs, 1, &specs)) return nullptr;
  const at::TensorOptions on = at::TensorOptions().device(reinterpret_cast<THPDevice*>(args[0])->device);
  return tuple_of(make_outputs(on, specs.data(), specs.size(), specs.size()));
  END_HANDLE_TH_ERRORS
}

PyObject* empty_packed(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  std::vector<OutputSpec> specs;
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError,
                    "empty_packed(device, separate, (code, rows, cols) ...): wrong number of arguments");
    return nullptr;
  }
  const long separate = PyLong_AsLong(args[1]);
  if (separate == -1 && PyErr_Occurred()) return nullptr;
  if (separate < 0) {
    PyErr_Format(PyExc_ValueError, "empty_packed: separate must be >= 0, got %ld", separate);
    return nullptr;
  }
  if (!parse_specs("empty_packed", args, nargs, 2, &specs)) return nullptr;
  const at::TensorOptions on = at::TensorOptions().device(reinterpret_cast<THPDevice*>(args[0])->device);
  return tuple_of(make_outputs(on, specs.data(), specs.size(), static_cast<size_t>(separate)));
  END_HANDLE_TH_ERRORS
}

}  // namespace turnout::torch_ext
