// The _C module: the C++ core's errors and interrupts as Python's, and the
// bindings of each part (bindings.hpp).
#include <exception>
#include <new>

#include "bindings.hpp"

namespace nb = nanobind;

namespace {

// What the interrupt check took out of Python's error state: a wait whose
// Interrupted the core catches itself (destroy) must not leave it set, so the
// translator puts it back only when the exception reaches Python.
struct SignalError {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};
thread_local SignalError t_signal_error;

// GIL held.
void stash_signal_error() {
  Py_XDECREF(t_signal_error.type);
  Py_XDECREF(t_signal_error.value);
  Py_XDECREF(t_signal_error.traceback);
  PyErr_Fetch(&t_signal_error.type, &t_signal_error.value, &t_signal_error.traceback);
}

// GIL held. True if there was one to put back.
bool restore_signal_error() {
  if (!t_signal_error.type) return false;
  PyErr_Restore(t_signal_error.type, t_signal_error.value, t_signal_error.traceback);
  t_signal_error = {};
  return true;
}

void translate_errors(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const turnout::Interrupted& e) {
    // The signal handler's own exception (KeyboardInterrupt, or the user's).
    if (!restore_signal_error()) PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
  } catch (const turnout::InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const turnout::NotSupported& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what());
  } catch (const turnout::TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
  } catch (const turnout::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

}  // namespace

namespace turnout::bindings {

void set_python_error(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (nb::python_error& e) {
    e.restore();
  } catch (const turnout::Error&) {
    translate_errors(p, nullptr);
  } catch (const std::bad_alloc& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "an unknown C++ exception");
  }
}

}  // namespace turnout::bindings

namespace {

// The host waits' interrupt check: runs Python's signal handlers (the waits
// release the GIL), so Ctrl-C raises KeyboardInterrupt out of a wait.
bool python_signal_pending() {
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return false;
#else
  if (_Py_IsFinalizing()) return false;
#endif
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  stash_signal_error();
  return true;
}

}  // namespace

NB_MODULE(_C, m) {
  namespace bindings = turnout::bindings;
  m.doc() = "turnout's C++ core";
  nb::register_exception_translator(translate_errors);
  turnout::set_interrupt_check(python_signal_pending);
  m.def("is_sm90_compiled", &turnout::is_sm90_compiled);
  bindings::bind_config(m);
  bindings::bind_events(m);
  bindings::BufferClass buffer = bindings::bind_buffer(m);
  bindings::bind_layout(buffer);
  bindings::bind_intranode(buffer);
  bindings::bind_internode(buffer);
  bindings::bind_low_latency(m, buffer);
}
