# Run after librope_ext.so links (CMakeLists.txt): the CPU kernel objects (rotary_kernel_*.cpp, in the
# static archive ARCHIVE) must call no libtorch function and use no OpenMP of their own. Their
# undefined symbols may be the C++ runtime's, the C library's, the sanitizers' and rope_ext's own; a
# name with at::, c10::, torch:: or caffe2:: anywhere in it once demangled (a function, a template's
# argument, a vtable or typeinfo), any of torch's C shim (aoti_torch_*) and any OpenMP entry fail the
# build. That is what lets these objects be linked into a library on torch's stable ABI (issue 37).
# Inputs: NM (the toolchain's nm) and ARCHIVE, or OBJECTS (a ;-separated list of object files).
cmake_policy(SET CMP0007 NEW)
if(NOT NM OR (NOT ARCHIVE AND NOT OBJECTS))
  message(FATAL_ERROR "check_kernel_symbols.cmake: needs -DNM=... and -DARCHIVE=... or -DOBJECTS=...")
endif()
set(forbidden "(^|[^A-Za-z0-9_])(at|c10|torch|caffe2)::|^aoti_torch_|^GOMP_|^omp_|^__kmpc_")
set(inputs ${ARCHIVE} ${OBJECTS})
set(checked 0)
foreach(input IN LISTS inputs)
  # (nm's default output, "<spaces>U <name>" per undefined symbol and "<member>:" per archive member:
  # --format=just-symbols needs binutils 2.37)
  execute_process(COMMAND "${NM}" --undefined-only --demangle "${input}"
                  OUTPUT_VARIABLE listing RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check_kernel_symbols.cmake: ${NM} failed on ${input}: ${err}")
  endif()
  string(REPLACE "\n" ";" lines "${listing}")
  set(member "${input}")
  set(bad "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^(.+\\.o(bj)?):$")
      set(member "${CMAKE_MATCH_1}")
      math(EXPR checked "${checked} + 1")
    elseif(line MATCHES "^ *[A-Za-z] (.+)$")
      set(symbol "${CMAKE_MATCH_1}")
      if(symbol MATCHES "${forbidden}")
        list(APPEND bad "${member}: ${symbol}")
      endif()
    endif()
  endforeach()
  if(NOT ARCHIVE OR NOT input STREQUAL ARCHIVE)
    math(EXPR checked "${checked} + 1")
  endif()
  if(bad)
    list(JOIN bad "\n  " bad)
    message(FATAL_ERROR "rope_ext: a CPU kernel object calls into libtorch or OpenMP, which a stable-ABI "
                        "library may not (csrc/cpu/rotary_cpu.h, KernelOperands):\n  ${bad}")
  endif()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "check_kernel_symbols.cmake: no kernel object to check in ${inputs}")
endif()
message(STATUS "rope_ext: ${checked} CPU kernel objects call no libtorch or OpenMP function")
