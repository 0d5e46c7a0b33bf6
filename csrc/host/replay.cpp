// A recorded update plan (d9d_kernels/core/plan.py) replayed in one call from
// Python: replay_new binds its op calls to state views, replay_run makes them on
// new inputs of the same signature through the c10 dispatcher (boxed stacks made
// once). Every fill and reshape is made before the first op runs, so an input
// that cannot be converted (an int past the float64 range) leaves the state as it was.
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace d9d {
namespace {

// where an op argument comes from (d9d_kernels/core/plan.py's _INPUT, _RESHAPE, _FILL)
enum Source : int { kInput = 1, kReshape = 2, kFill = 4 };

struct Arg {
  size_t pos = 0;
  int source = kInput;
  Py_ssize_t input = 0;
  std::vector<int64_t> shape;  // kReshape, kFill
  at::TensorOptions options;   // kFill
  bool filled = false;         // kFill: the last number filled (the ops only read it: an equal one reuses it)
  bool was_float = false;
  double value = 0.0;
  at::Tensor fill;
};

struct Step {
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;  // constants and state views in place
  std::vector<Arg> args;
};

using Replay = std::vector<Step>;

const char* kCapsule = "d9d_kernels.Replay";

std::vector<int64_t> int_list(PyObject* seq) {
  std::vector<int64_t> out;
  for (Py_ssize_t i = 0; i < PySequence_Size(seq); ++i) {
    PyObject* v = PySequence_GetItem(seq, i);
    out.push_back(static_cast<int64_t>(PyLong_AsLongLong(v)));
    Py_DECREF(v);
  }
  if (PyErr_Occurred()) throw python_error();
  return out;
}

// A constant of the recorded call as the schema's argument type wants it.
c10::IValue constant(PyObject* v, const c10::Argument& arg) {
  if (v == Py_None) return c10::IValue();
  if (THPVariable_Check(v)) return THPVariable_Unpack(v);
  if (PyBool_Check(v)) return c10::IValue(v == Py_True);
  c10::TypePtr type = arg.type();
  if (type->kind() == c10::TypeKind::OptionalType) type = type->containedType(0);
  const bool wants_float = type->kind() == c10::TypeKind::FloatType;
  if (PyLong_Check(v)) return wants_float ? c10::IValue(PyLong_AsDouble(v)) : c10::IValue(static_cast<int64_t>(PyLong_AsLongLong(v)));
  if (PyFloat_Check(v)) return c10::IValue(PyFloat_AsDouble(v));
  if (PyList_Check(v) || PyTuple_Check(v)) return c10::IValue(int_list(v));
  TORCH_CHECK(false, "replay_new: constant of type ", Py_TYPE(v)->tp_name, " for argument ", arg.name());
}

void destroy(PyObject* capsule) { delete static_cast<Replay*>(PyCapsule_GetPointer(capsule, kCapsule)); }

// replay_new([(qualified op name, overload, [constant or state view or None per argument],
//              [(position, source, shape, input, dtype, device)])]) -> capsule
PyObject* replay_new(PyObject*, PyObject* steps) {
  HANDLE_TH_ERRORS
  auto replay = std::make_unique<Replay>();
  for (Py_ssize_t s = 0; s < PyList_Size(steps); ++s) {
    PyObject *name, *overload, *base, *dyn;
    TORCH_CHECK(PyArg_ParseTuple(PyList_GetItem(steps, s), "UUOO", &name, &overload, &base, &dyn),
                "replay_new: a step is (name, overload, constants, inputs)");
    Step step{c10::Dispatcher::singleton().findSchemaOrThrow(PyUnicode_AsUTF8(name), PyUnicode_AsUTF8(overload)),
              {}, {}};
    const auto& schema = step.op.schema().arguments();
    TORCH_CHECK(PyList_Size(base) == static_cast<Py_ssize_t>(schema.size()), "replay_new: ", schema.size(),
                " arguments expected by ", PyUnicode_AsUTF8(name));
    for (size_t i = 0; i < schema.size(); ++i) step.stack.push_back(constant(PyList_GetItem(base, i), schema[i]));
    for (Py_ssize_t i = 0; i < PyList_Size(dyn); ++i) {
      PyObject *shape, *dtype, *device;
      Py_ssize_t pos;
      Arg a;
      TORCH_CHECK(PyArg_ParseTuple(PyList_GetItem(dyn, i), "niOnOO", &pos, &a.source, &shape, &a.input, &dtype, &device),
                  "replay_new: an input is (position, source, shape, input, dtype, device)");
      a.pos = static_cast<size_t>(pos);
      if (shape != Py_None) a.shape = int_list(shape);
      if (a.source == kFill)
        a.options = at::TensorOptions().dtype(reinterpret_cast<THPDtype*>(dtype)->scalar_type)
                        .device(reinterpret_cast<THPDevice*>(device)->device);
      step.args.push_back(std::move(a));
    }
    replay->push_back(std::move(step));
  }
  return PyCapsule_New(replay.release(), kCapsule, destroy);
  END_HANDLE_TH_ERRORS
}

// Whether v is exact in the floating type t (d9d_kernels/metrics/moments.py exact_in):
// a number is filled in a narrower recorded dtype only when it is, else in float64.
bool exact_in(double v, c10::ScalarType t) {
  const float f = static_cast<float>(v);
  switch (t) {
    case c10::kFloat:
      return static_cast<double>(f) == v;
    case c10::kHalf:
      return static_cast<double>(static_cast<float>(c10::Half(f))) == v && static_cast<double>(f) == v;
    case c10::kBFloat16:
      return static_cast<double>(static_cast<float>(c10::BFloat16(f))) == v && static_cast<double>(f) == v;
    default:
      return true;
  }
}

// The value of argument `a` from the update inputs.
c10::IValue argument(Arg& a, PyObject* inputs) {
  PyObject* v = PyTuple_GET_ITEM(inputs, a.input);
  if (a.source != kFill) {
    TORCH_CHECK(THPVariable_Check(v), "replay_run: input ", a.input, " is not a tensor");
    const at::Tensor& t = THPVariable_Unpack(v);
    return a.source == kReshape ? t.reshape(a.shape) : t;
  }
  const bool is_float = PyFloat_Check(v);
  const double x = is_float ? PyFloat_AS_DOUBLE(v) : PyLong_AsDouble(v);
  if (x == -1.0 && PyErr_Occurred()) throw python_error();  // an int past the float64 range
  if (!a.filled || a.was_float != is_float || !(a.value == x)) {  // NaN: filled again
    const bool exact = exact_in(x, c10::typeMetaToScalarType(a.options.dtype()));
    a.fill = at::full(a.shape, x, exact ? a.options : a.options.dtype(at::kDouble));
    a.filled = true, a.was_float = is_float, a.value = x;
  }
  return a.fill;
}

// replay_run(capsule, inputs tuple) -> None
PyObject* replay_run(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *capsule, *inputs;
  if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyTuple_Type, &inputs)) return nullptr;
  auto* replay = static_cast<Replay*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (replay == nullptr) return nullptr;
  std::vector<std::vector<c10::IValue>> stacks;
  stacks.reserve(replay->size());
  for (Step& step : *replay) {
    stacks.push_back(step.stack);
    for (Arg& a : step.args) stacks.back()[a.pos] = argument(a, inputs);
  }
  for (size_t s = 0; s < replay->size(); ++s) (*replay)[s].op.callBoxed(&stacks[s]);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef kMethods[] = {
    {"replay_new", replay_new, METH_O, "binds a recorded update plan's op calls to state views"},
    {"replay_run", replay_run, METH_VARARGS, "makes a bound plan's op calls on new inputs"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace
}  // namespace d9d

// Importing d9d_kernels._C also runs the static TORCH_LIBRARY initialisers (csrc/registration.cpp).
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, d9d::kMethods};
  return PyModule_Create(&module_def);
}
