// Lets `import rope_ext._C` load the library (and with it the op registrations). The
// module itself is empty: every entry point is a dispatcher op under torch.ops.rope_ext.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
