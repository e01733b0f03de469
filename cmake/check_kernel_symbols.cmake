# Run after librope_ext.so links (CMakeLists.txt): the CPU kernel objects (rotary_kernel_*.cpp) must
# call no libtorch function and use no OpenMP of their own. Their undefined symbols may be the C++
# runtime's, the C library's, the sanitizers' and rope_ext's own; any in namespace at, c10, torch or
# caffe2, any of torch's C shim (aoti_torch_*) and any OpenMP entry fails the build. That is the
# property that lets these objects be linked into a library on torch's stable ABI (issue 37).
# Inputs: NM (the toolchain's nm) and OBJECTS (a ;-separated list, or the file named by OBJECTS_FILE).
cmake_policy(SET CMP0007 NEW)
if(NOT NM OR (NOT OBJECTS AND NOT OBJECTS_FILE))
  message(FATAL_ERROR "check_kernel_symbols.cmake: needs -DNM=... and -DOBJECTS=... or -DOBJECTS_FILE=...")
endif()
if(OBJECTS_FILE)
  file(STRINGS "${OBJECTS_FILE}" OBJECTS)
endif()
set(forbidden "^(at|c10|torch|caffe2)::|^aoti_torch_|^GOMP_|^omp_|^__kmpc_")
set(checked 0)
foreach(object IN LISTS OBJECTS)
  execute_process(COMMAND "${NM}" --undefined-only --demangle --format=just-symbols "${object}"
                  OUTPUT_VARIABLE symbols RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check_kernel_symbols.cmake: ${NM} failed on ${object}: ${err}")
  endif()
  string(REPLACE "\n" ";" symbols "${symbols}")
  list(REMOVE_ITEM symbols "")
  set(bad "")
  foreach(symbol IN LISTS symbols)
    if(symbol MATCHES "${forbidden}")
      list(APPEND bad "${symbol}")
    endif()
  endforeach()
  if(bad)
    list(JOIN bad "\n  " bad)
    message(FATAL_ERROR "rope_ext: the CPU kernel object ${object} calls into libtorch or OpenMP, which a "
                        "stable-ABI library may not (csrc/cpu/rotary_cpu.h, KernelOperands):\n  ${bad}")
  endif()
  math(EXPR checked "${checked} + 1")
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "check_kernel_symbols.cmake: no kernel object to check")
endif()
message(STATUS "rope_ext: ${checked} CPU kernel objects call no libtorch or OpenMP function")
