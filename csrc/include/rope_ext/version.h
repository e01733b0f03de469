// rope_ext's version: the one place it is written. CMakeLists.txt (project version, soname),
// setup.py (the Python package's version) and the compiled code (rope_ext.__version__, the
// rope_ext::_version op that tells two loaded copies apart) all read it from here.
#pragma once

#define ROPE_EXT_VERSION "0.1.0"
