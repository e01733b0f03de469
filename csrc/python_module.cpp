// Lets `import rope_ext._C` load the library (and with it the op registrations). The module
// holds only __version__, the version this extension was built as (rope_ext/version.h); every
// entry point is a dispatcher op under torch.ops.rope_ext.
#include <Python.h>

#include "rope_ext/version.h"

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr && PyModule_AddStringConstant(m, "__version__", ROPE_EXT_VERSION) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
