// rope_ext's version: the one place it is written. CMakeLists.txt (project version, the soname
// librope_ext.so.<major.minor>), setup.py (the Python package's version) and the compiled code (the
// rope_ext::_version op, which gives rope_ext.__version__) all read it from here.
#pragma once

#define ROPE_EXT_VERSION "0.1.0"
