# cmake -DEXE=<test executable> -DLIB=<rope_ext::rope_ext's file> -P check_linked_library.cmake:
# the executable's loader resolves librope_ext.so to LIB, the file of the installed package. Used by
# ctest (tests/cpp), make dist-check and make cuda-check.
execute_process(COMMAND ldd ${EXE} OUTPUT_VARIABLE LDD RESULT_VARIABLE RC)
if(NOT RC EQUAL 0)
  message(FATAL_ERROR "ldd ${EXE} failed")
endif()
string(REGEX MATCH "librope_ext\\.so[.0-9]* => ([^ ]+)" LINE "${LDD}")
get_filename_component(RESOLVED "${CMAKE_MATCH_1}" REALPATH)
get_filename_component(EXPECTED "${LIB}" REALPATH)
if(NOT RESOLVED STREQUAL EXPECTED)
  message(FATAL_ERROR "${EXE} loads librope_ext.so from '${RESOLVED}', not from ${EXPECTED}\n${LDD}")
endif()
message(STATUS "${EXE} loads ${RESOLVED}")
