// PlanRunner: a metric's planned update as ONE call from Python into C++.
//
// d9d_kernels/core/plan.py records, per input signature, which statistic op
// gets which update input; d9d_kernels/core/compiled.py lowers such a plan to
// a PlanRunner signature: the metadata every input must have (tensor dtype,
// device and sizes, or None / float / int / bool), and per op a template
// argument stack (the state views and constants) with the slots that take an
// input. run(args, kwargs) checks the inputs against each signature in turn
// and, on a match, calls every op through the c10 dispatcher (boxed), so a
// group update costs one Python->C++ transition and no per-member Python.
// It returns the matched signature's index (in the order added), or -1 (and
// touches nothing) when none matches: the caller then takes the Python plan
// path. Device-agnostic host code: it lives with the CPU sources because it
// is compiled by the host compiler.
//
// forward(args, kwargs, reset, select) is a forward's whole step on CPU
// buffers for a runner bound to the storage's scratch copy (set_forward gives
// it, per signature, the ranges its ops write and the group_values arguments
// of its owner): the scratch ranges of the last forward reset, the ops, the
// batch values of `select` ((key, value index) pairs: the routed members),
// and the ranges folded into the state and reset in one pass. It returns
// {key: value}, or None, touching nothing, when no signature matches.
//
// The module function fast_update(metric, args, kwargs) is the planned
// wrapper's whole compiled branch, reaching the runner through handle() (a
// capsule): the per-update entry, with no pybind11 and no wrapper Python.
// fast_forward(owner, args, kwargs) is the same for a forward in its steady
// state.
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "host_calls.h"

namespace py = pybind11;

namespace d9d {
namespace {

enum class Kind : int { None = 0, Tensor = 1, Float = 2, Int = 3, Bool = 4 };

// What one update input must look like (the plan's input signature).
struct Check {
  Kind kind;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::kCPU);
  std::vector<int64_t> sizes;
};

// How an op argument is made from an input.
enum class Source : int {
  AsIs = 0,      // the tensor (or None)
  Flat = 1,      // tensor.reshape(-1), or None
  Fill1 = 2,     // a number as a float64 [1] tensor on `device`, made once per new value
  FillLike = 3,  // a number as a tensor of the flattened shape of input `like`, in `like`'s
                 // dtype when the number is exact there, else float64; made once per new value
};

struct Slot {
  int arg;  // position in the op's stack
  Source source;
  int input;
  int like = -1;
  c10::Device device = c10::Device(c10::kCPU);
  // the last fill: the ops only read it, so an equal number reuses it
  bool filled = false;
  double value = 0.0;
  at::Tensor fill;
};

struct Step {
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;
  std::vector<Slot> slots;
};

struct Signature {
  size_t nargs = 0;
  std::vector<py::object> kwnames;  // interned names, after the positional inputs
  std::vector<Check> checks;
  std::vector<Step> steps;
};

bool exact_in(double v, c10::ScalarType t) {
  switch (t) {
    case c10::kDouble:
      return v == v;
    case c10::kFloat:
      return static_cast<double>(static_cast<float>(v)) == v;
    case c10::kHalf:
      return static_cast<double>(static_cast<float>(c10::Half(static_cast<float>(v)))) == v &&
             static_cast<double>(static_cast<float>(v)) == v;
    case c10::kBFloat16:
      return static_cast<double>(static_cast<float>(c10::BFloat16(static_cast<float>(v)))) == v &&
             static_cast<double>(static_cast<float>(v)) == v;
    default:
      return false;
  }
}

bool matches(PyObject* v, const Check& c) {
  switch (c.kind) {
    case Kind::None:
      return v == Py_None;
    case Kind::Float:
      return PyFloat_CheckExact(v);
    case Kind::Int: {
      // an int past the float64 range is not this signature: the checked update raises OverflowError
      if (!PyLong_CheckExact(v)) return false;
      if (PyLong_AsDouble(v) == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      return true;
    }
    case Kind::Bool:
      return PyBool_Check(v);
    case Kind::Tensor: {
      if (!THPVariable_Check(v)) return false;
      const at::Tensor& t = THPVariable_Unpack(v);
      return t.scalar_type() == c.dtype && t.device() == c.device && t.sizes().equals(c.sizes);
    }
  }
  return false;
}

// t.reshape(-1). A plain contiguous tensor (a 0-d loss, a [B, T] mask) gets
// its view made directly as a TensorImpl on t's storage: the dispatched
// reshape of a 0-d weight cost as much as the whole weighted-mean update.
// Anything else (a tensor subclass, a wrapper, a strided view, autograd) reshapes.
at::Tensor flat_of(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (typeid(*impl) == typeid(c10::TensorImpl) && !impl->is_python_dispatch() && t.layout() == at::kStrided &&
      t.has_storage() && !t.requires_grad() && !t.is_conj() && !t.is_neg() && t.is_contiguous()) {
    return value_view(t, t.storage_offset(), 1, {t.numel()});
  }
  return t.reshape(-1);
}

double number(PyObject* v) { return PyFloat_Check(v) ? PyFloat_AS_DOUBLE(v) : PyLong_AsDouble(v); }

class PlanRunner {
 public:
  // Adds one signature. checks: [(kind, dtype name, device str, sizes)];
  // steps: [(op name, overload, [(arg position, constant)], [(arg position, source, input, like, device)])].
  void add(size_t nargs, const std::vector<std::string>& kwnames, const py::list& checks, const py::list& steps) {
    Signature sig;
    sig.nargs = nargs;
    for (const auto& n : kwnames) {
      PyObject* s = PyUnicode_InternFromString(n.c_str());
      if (s == nullptr) throw py::error_already_set();
      sig.kwnames.push_back(py::reinterpret_steal<py::object>(s));
    }
    for (auto item : checks) {
      auto t = item.cast<py::tuple>();
      Check c{static_cast<Kind>(t[0].cast<int>())};
      if (c.kind == Kind::Tensor) {
        TORCH_CHECK(THPDtype_Check(t[1].ptr()), "PlanRunner.add: a torch.dtype");
        c.dtype = reinterpret_cast<THPDtype*>(t[1].ptr())->scalar_type;
        c.device = c10::Device(t[2].cast<std::string>());
        c.sizes = t[3].cast<std::vector<int64_t>>();
      }
      sig.checks.push_back(std::move(c));
    }
    TORCH_CHECK(sig.checks.size() == nargs + sig.kwnames.size(), "PlanRunner.add: one check per input");
    for (auto item : steps) {
      auto t = item.cast<py::tuple>();
      Step step{c10::Dispatcher::singleton().findSchemaOrThrow(t[0].cast<std::string>().c_str(),
                                                              t[1].cast<std::string>().c_str())};
      const auto& args = step.op.schema().arguments();
      step.stack.resize(args.size());
      for (auto c : t[2].cast<py::list>()) {
        auto ct = c.cast<py::tuple>();
        int pos = ct[0].cast<int>();
        step.stack[pos] = torch::jit::toIValue(ct[1], args[pos].type());
      }
      for (auto s : t[3].cast<py::list>()) {
        auto st = s.cast<py::tuple>();
        Slot slot{st[0].cast<int>(), static_cast<Source>(st[1].cast<int>()), st[2].cast<int>(), st[3].cast<int>(),
                  c10::Device(st[4].cast<std::string>())};
        TORCH_CHECK(slot.input >= 0 && static_cast<size_t>(slot.input) < sig.checks.size(), "PlanRunner.add: input");
        step.slots.push_back(std::move(slot));
      }
      sig.steps.push_back(std::move(step));
    }
    sigs_.push_back(std::move(sig));
  }

  // The index of the signature that matched and whose ops ran; -1: nothing was touched.
  int64_t run(py::handle args, py::handle kwargs) { return run_raw(args.ptr(), kwargs.ptr()); }

  // args: a tuple; kwargs: a dict or None.
  int64_t run_raw(PyObject* args, PyObject* kwargs) {
    PyObject* inputs[kMaxInputs];
    const int64_t si = match(args, kwargs, inputs);
    if (si >= 0) {
      for (auto& step : sigs_[si].steps) call(step, inputs);
    }
    return si;
  }

  // What forward needs besides the inputs: per signature, the scratch ranges
  // its ops write; the scratch buffers and the owner's group_values program.
  void set_forward(std::vector<std::vector<ScratchRange>> folds, at::Tensor sum, at::Tensor max, at::Tensor replica,
                   at::Tensor program, at::Tensor beta, int64_t out_size, int64_t n_scalar,
                   std::vector<std::vector<int64_t>> shapes) {
    TORCH_CHECK(folds.size() == sigs_.size(), "PlanRunner.set_forward: one list of ranges per signature");
    Forward f{std::move(folds), std::move(sum), std::move(max), std::move(replica), std::move(program),
              std::move(beta),  out_size,       n_scalar,       {}};
    int64_t offset = 0;
    for (int64_t i = 0; i < n_scalar; ++i) f.values.push_back({offset++, {}});
    for (auto& shape : shapes) {
      const int64_t n = c10::multiply_integers(shape);
      f.values.push_back({offset, std::move(shape)});
      offset += n;
    }
    TORCH_CHECK(offset <= out_size, "PlanRunner.set_forward: the values need ", offset, " elements, out_size is ",
                out_size);
    fwd_ = std::move(f);
  }

  // select: [(key, value index)]; returns {key: value}, or None when no signature matches.
  py::object forward(py::handle args, py::handle kwargs, py::handle reset, py::list select) {
    return forward_raw(args.ptr(), kwargs.ptr(), reset.ptr(), select.ptr());
  }

  // forward with borrowed arguments (args: a tuple; kwargs: a dict or None; select: a list).
  py::object forward_raw(PyObject* args, PyObject* kwargs, PyObject* reset, PyObject* select) {
    TORCH_CHECK(fwd_.has_value(), "PlanRunner.forward: set_forward was not called");
    const Forward& f = *fwd_;
    const Py_ssize_t k = PyList_GET_SIZE(select);
    for (Py_ssize_t j = 0; j < k; ++j) {  // before anything is touched
      PyObject* item = PyList_GET_ITEM(select, j);
      TORCH_CHECK(PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 && PyLong_Check(PyTuple_GET_ITEM(item, 1)),
                  "PlanRunner.forward: argument 'select' must hold (key, value index) pairs");
      const long i = PyLong_AsLong(PyTuple_GET_ITEM(item, 1));
      if (i == -1 && PyErr_Occurred()) PyErr_Clear();  // too large for a long: out of range below
      TORCH_CHECK(0 <= i && static_cast<size_t>(i) < f.values.size(), "PlanRunner.forward: value index ", i,
                  " outside the ", f.values.size(), " values");
    }
    // reset is a storage's FoldRanges.reset, a list never changed once made: converted once per list
    if (!reset_list_ || reset != reset_list_.ptr()) {
      reset_ = py::handle(reset).cast<std::vector<ScratchRange>>();
      reset_list_ = py::reinterpret_borrow<py::object>(reset);
    }
    PyObject* inputs[kMaxInputs];
    const int64_t si = match(args, kwargs, inputs);
    if (si < 0) return py::none();
    scratch_ranges(reset_, false);
    for (auto& step : sigs_[si].steps) call(step, inputs);
    // the batch values from the scratch, then the fold that also resets it (the caller's next reset:
    // the REPLICA copy only)
    const at::Tensor out = host_values_out(f.sum, f.max, f.replica, f.program, f.beta, f.out_size, f.n_scalar);
    fold_and_clear(f.folds[si]);
    // only the selected values become tensors: each is a Python object the caller keeps or frees
    py::dict values;
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* item = PyList_GET_ITEM(select, j);
      const auto& [offset, shape] = f.values[PyLong_AsLong(PyTuple_GET_ITEM(item, 1))];
      PyObject* v = THPVariable_Wrap(value_view(out, offset, 1, shape));
      if (v == nullptr || PyDict_SetItem(values.ptr(), PyTuple_GET_ITEM(item, 0), v) != 0) {
        Py_XDECREF(v);
        throw py::error_already_set();
      }
      Py_DECREF(v);
    }
    return std::move(values);
  }

  size_t size() const { return sigs_.size(); }

 private:
  static constexpr size_t kMaxInputs = 16;
  struct Forward {
    std::vector<std::vector<ScratchRange>> folds;
    at::Tensor sum, max, replica, program, beta;
    int64_t out_size, n_scalar;
    std::vector<std::pair<int64_t, std::vector<int64_t>>> values;  // per value: (offset in the output, shape)
  };
  std::vector<Signature> sigs_;
  std::optional<Forward> fwd_;
  py::object reset_list_;  // the last forward's reset argument (kept alive: its id stays its own)
  std::vector<ScratchRange> reset_;

  // The first signature the inputs match (inputs[i] set to input i), or -1.
  int64_t match(PyObject* a, PyObject* kw, PyObject** inputs) const {
    const Py_ssize_t na = PyTuple_GET_SIZE(a);
    const Py_ssize_t nk = kw == Py_None ? 0 : PyDict_GET_SIZE(kw);
    for (size_t si = 0; si < sigs_.size(); ++si) {
      const auto& sig = sigs_[si];
      if (static_cast<size_t>(na) != sig.nargs || static_cast<size_t>(nk) != sig.kwnames.size()) continue;
      const size_t n = sig.checks.size();
      if (n > kMaxInputs) continue;
      bool ok = true;
      for (size_t i = 0; i < n && ok; ++i) {
        PyObject* v = i < sig.nargs ? PyTuple_GET_ITEM(a, i) : PyDict_GetItem(kw, sig.kwnames[i - sig.nargs].ptr());
        ok = v != nullptr && matches(v, sig.checks[i]);
        inputs[i] = v;
      }
      if (ok) return static_cast<int64_t>(si);
    }
    return -1;
  }

  static void call(Step& step, PyObject* const* inputs) {
    torch::jit::Stack stack(step.stack);
    for (auto& s : step.slots) {
      PyObject* v = inputs[s.input];
      switch (s.source) {
        case Source::AsIs:
          stack[s.arg] = v == Py_None ? c10::IValue() : c10::IValue(THPVariable_Unpack(v));
          break;
        case Source::Flat: {
          if (v == Py_None) {
            stack[s.arg] = c10::IValue();
            break;
          }
          const at::Tensor& t = THPVariable_Unpack(v);
          stack[s.arg] = t.dim() == 1 ? t : flat_of(t);  // a 1-D input is its own flattening
          break;
        }
        case Source::Fill1:
        case Source::FillLike: {
          const double x = number(v);
          if (!(s.filled && s.value == x)) {
            if (s.source == Source::Fill1) {
              s.fill = at::full({1}, x, at::TensorOptions().dtype(at::kDouble).device(s.device));
            } else {
              const at::Tensor& like = THPVariable_Unpack(inputs[s.like]);
              const auto dt = exact_in(x, like.scalar_type()) ? like.scalar_type() : at::kDouble;
              s.fill = at::full({like.numel()}, x, like.options().dtype(dt));
            }
            s.filled = true;
            s.value = x;
          }
          stack[s.arg] = s.fill;
          break;
        }
      }
    }
    step.op.callBoxed(stack);
  }
};

// A capsule holding the runner (and a reference to its Python object):
// how fast_update reaches it. Called right after a training step's other
// work, pybind11's dispatch (function records, overload and type lookups)
// costs more than the match; the capsule is one pointer read.
constexpr const char* kRunnerCapsule = "d9d_kernels._C.PlanRunner";

struct Bound {
  PlanRunner* runner;
  PyObject* owner;  // the Python PlanRunner, kept alive by the capsule
};

void drop_bound(PyObject* capsule) {
  auto* b = static_cast<Bound*>(PyCapsule_GetPointer(capsule, kRunnerCapsule));
  if (b == nullptr) {
    PyErr_Clear();
    return;
  }
  Py_DECREF(b->owner);
  delete b;
}

py::object handle_of(py::object runner) {
  auto* b = new Bound{runner.cast<PlanRunner*>(), runner.ptr()};
  Py_INCREF(b->owner);
  PyObject* capsule = PyCapsule_New(b, kRunnerCapsule, &drop_bound);
  if (capsule == nullptr) {
    Py_DECREF(b->owner);
    delete b;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

// storage.compiled[id(owner)], the owner's compiled Runner (d9d_kernels/core/
// compiled.py), as a new reference: fast_update's and fast_forward's first
// lookup. Null with no Python error set when there is none; null with an
// error set when a read failed.
py::object compiled_entry(PyObject* storage, PyObject* owner) {
  static PyObject* const s_compiled = PyUnicode_InternFromString("compiled");
  const auto compiled = py::reinterpret_steal<py::object>(PyObject_GetAttr(storage, s_compiled));
  const auto id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(owner));  // id(owner)
  if (!compiled || !id) return {};
  return py::reinterpret_borrow<py::object>(
      PyDict_Check(compiled.ptr()) ? PyDict_GetItemWithError(compiled.ptr(), id.ptr()) : nullptr);
}

// fast_update(metric, args, kwargs) -> bool: the planned wrapper's
// (d9d_kernels/core/plan.py) compiled branch, the same reads in C API calls:
// True when the owner's runner (storage.compiled[id(metric)], bound to the
// storage's current local views) matched and ran, storage.dirty then set;
// False (nothing touched) inside a group's routing (_collector set), with no
// runner, while a forward points the update at the scratch copy, or when no
// signature matches. After a training step's other work each of these reads
// misses the caches; in the wrapper's Python they cost more than the runner.
// 1: ran; 0: not taken, nothing touched; -1: a Python error is set.
int fast_update_impl(PyObject* metric, PyObject* args, PyObject* kwargs) {
  static PyObject* const s_collector = PyUnicode_InternFromString("_collector");
  static PyObject* const s_storage = PyUnicode_InternFromString("_storage");
  static PyObject* const s_local = PyUnicode_InternFromString("local_views");
  static PyObject* const s_views = PyUnicode_InternFromString("views");
  static PyObject* const s_handle = PyUnicode_InternFromString("handle");
  static PyObject* const s_dirty = PyUnicode_InternFromString("dirty");
  auto own = [](PyObject* o) { return py::reinterpret_steal<py::object>(o); };
  const py::object d = own(PyObject_GenericGetDict(metric, nullptr));
  if (!d) return -1;
  PyObject* collector = PyDict_GetItemWithError(d.ptr(), s_collector);  // borrowed
  PyObject* storage = collector == Py_None ? PyDict_GetItemWithError(d.ptr(), s_storage) : nullptr;
  if (storage == nullptr || storage == Py_None) return PyErr_Occurred() ? -1 : 0;
  const py::object entry = compiled_entry(storage, metric);
  if (!entry) return PyErr_Occurred() ? -1 : 0;
  const py::object views = own(PyObject_GetAttr(entry.ptr(), s_views));
  const py::object local = own(PyObject_GetAttr(storage, s_local));
  const py::object handle = own(PyObject_GetAttr(entry.ptr(), s_handle));
  if (!views || !local || !handle) return -1;
  if (views.ptr() != local.ptr()) return 0;
  auto* b = static_cast<Bound*>(PyCapsule_GetPointer(handle.ptr(), kRunnerCapsule));  // TypeError if not one
  if (b == nullptr) return -1;
  if (b->runner->run_raw(args, kwargs) < 0) return 0;
  return PyObject_SetAttr(storage, s_dirty, Py_True) == 0 ? 1 : -1;
}

PyObject* fast_update(PyObject*, PyObject* const* argv, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n != 3 || !PyTuple_Check(argv[1]) || !(argv[2] == Py_None || PyDict_Check(argv[2]))) {
    PyErr_SetString(PyExc_TypeError, "fast_update(metric, args: tuple, kwargs: dict | None)");
    return nullptr;
  }
  const int r = fast_update_impl(argv[0], argv[1], argv[2]);
  if (r < 0) return nullptr;
  return PyBool_FromLong(r);
  END_HANDLE_TH_ERRORS
}

PyMethodDef kFastUpdate = {"fast_update",
                           reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_update)), METH_FASTCALL,
                           "fast_update(metric, args, kwargs) -> bool: a planned update's compiled branch"};

// fast_forward(owner, args, kwargs) -> dict | None: a forward in its steady
// state, the previous forward of the same input names having run as one call
// (d9d_kernels/metrics/formulas/fused.py::fused_forward) and left a
// ForwardShortcut in the owner's compiled entry (storage.compiled[id(owner)]
// .shortcuts[frozenset(kwargs)]). It holds while that entry is on the local
// views, no forward runs (saved_views None), the scratch is as that forward
// left it (scratch_dirty is the same FoldRanges) and the owner's fused plan
// is the same; then the scratch runner's forward runs and storage.dirty is
// set. None: not taken, nothing touched. Same reads as fused_forward's
// Python, without the frames that miss the caches after a training step's
// other work.
namespace shortcut {  // ForwardShortcut's fields (a tuple subclass)
enum : Py_ssize_t { kDirty, kReset, kPlan, kHandle, kSelect, kAllDirty, kSize };
}

PyObject* fast_forward_impl(PyObject* owner, PyObject* args, PyObject* kwargs) {
  static PyObject* const s_storage = PyUnicode_InternFromString("_storage");
  static PyObject* const s_plan = PyUnicode_InternFromString("_fused_plan");
  static PyObject* const s_shortcuts = PyUnicode_InternFromString("shortcuts");
  static PyObject* const s_views = PyUnicode_InternFromString("views");
  static PyObject* const s_local = PyUnicode_InternFromString("local_views");
  static PyObject* const s_saved = PyUnicode_InternFromString("saved_views");
  static PyObject* const s_scratch_dirty = PyUnicode_InternFromString("scratch_dirty");
  static PyObject* const s_dirty = PyUnicode_InternFromString("dirty");
  auto own = [](PyObject* o) { return py::reinterpret_steal<py::object>(o); };
  auto none = []() { Py_RETURN_NONE; };
  const py::object d = own(PyObject_GenericGetDict(owner, nullptr));
  if (!d) return nullptr;
  // owned references: the ops may run Python (a dispatch mode) that rebinds these dict items
  const py::object storage_ref = py::reinterpret_borrow<py::object>(PyDict_GetItemWithError(d.ptr(), s_storage));
  PyObject* storage = storage_ref.ptr();
  if (storage == nullptr || storage == Py_None) return PyErr_Occurred() ? nullptr : none();
  const py::object entry = compiled_entry(storage, owner);
  if (!entry) return PyErr_Occurred() ? nullptr : none();
  const py::object table = own(PyObject_GetAttr(entry.ptr(), s_shortcuts));
  const py::object key = own(PyFrozenSet_New(kwargs == Py_None ? nullptr : kwargs));
  if (!table || !key) return nullptr;
  const py::object sc_ref = py::reinterpret_borrow<py::object>(
      PyDict_Check(table.ptr()) ? PyDict_GetItemWithError(table.ptr(), key.ptr()) : nullptr);
  PyObject* sc = sc_ref.ptr();
  if (sc == nullptr || !PyTuple_Check(sc) || PyTuple_GET_SIZE(sc) != shortcut::kSize) {
    return PyErr_Occurred() ? nullptr : none();
  }
  if (PyDict_GetItemWithError(d.ptr(), s_plan) != PyTuple_GET_ITEM(sc, shortcut::kPlan)) {
    return PyErr_Occurred() ? nullptr : none();
  }
  const py::object views = own(PyObject_GetAttr(entry.ptr(), s_views));
  const py::object local = own(PyObject_GetAttr(storage, s_local));
  const py::object saved = own(PyObject_GetAttr(storage, s_saved));
  const py::object dirty = own(PyObject_GetAttr(storage, s_scratch_dirty));
  if (!views || !local || !saved || !dirty) return nullptr;
  if (views.ptr() != local.ptr() || saved.ptr() != Py_None || dirty.ptr() != PyTuple_GET_ITEM(sc, shortcut::kDirty)) {
    return none();
  }
  auto* b = static_cast<Bound*>(PyCapsule_GetPointer(PyTuple_GET_ITEM(sc, shortcut::kHandle), kRunnerCapsule));
  if (b == nullptr) return nullptr;
  py::object vals;
  try {
    vals = b->runner->forward_raw(args, kwargs, PyTuple_GET_ITEM(sc, shortcut::kReset),
                                  PyTuple_GET_ITEM(sc, shortcut::kSelect));
  } catch (...) {
    // the reset ran and some ops may have written: the next forward resets every range (as fused_forward)
    if (PyObject_SetAttr(storage, s_scratch_dirty, PyTuple_GET_ITEM(sc, shortcut::kAllDirty)) != 0) PyErr_Clear();
    throw;
  }
  if (!vals.is_none() && PyObject_SetAttr(storage, s_dirty, Py_True) != 0) return nullptr;
  return vals.release().ptr();
}

PyObject* fast_forward(PyObject*, PyObject* const* argv, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n != 3 || !PyTuple_Check(argv[1]) || !(argv[2] == Py_None || PyDict_Check(argv[2]))) {
    PyErr_SetString(PyExc_TypeError, "fast_forward(owner, args: tuple, kwargs: dict | None)");
    return nullptr;
  }
  return fast_forward_impl(argv[0], argv[1], argv[2]);
  END_HANDLE_TH_ERRORS
}

PyMethodDef kFastForward = {"fast_forward",
                            reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_forward)), METH_FASTCALL,
                            "fast_forward(owner, args, kwargs) -> dict | None: a forward's steady state in one call"};

}  // namespace

// Adds the PlanRunner class to the module; without it (an error here) the
// Python plan path serves every update, so the import itself never fails.
void add_plan_runner(PyObject* module) {
  try {
    py::module_ m = py::reinterpret_borrow<py::module_>(module);
    py::class_<PlanRunner>(m, "PlanRunner")
        .def(py::init<>())
        .def("add", &PlanRunner::add)
        .def("run", &PlanRunner::run)
        .def("handle", &handle_of)
        .def("set_forward", &PlanRunner::set_forward)
        .def("forward", &PlanRunner::forward)
        .def("__len__", &PlanRunner::size);
    for (PyMethodDef* def : {&kFastUpdate, &kFastForward}) {
      PyObject* f = PyCFunction_NewEx(def, nullptr, nullptr);
      if (f == nullptr || PyModule_AddObject(module, def->ml_name, f) != 0) {
        Py_XDECREF(f);
        throw py::error_already_set();
      }
    }
  } catch (const std::exception&) {
    PyErr_Clear();
  }
}

}  // namespace d9d
