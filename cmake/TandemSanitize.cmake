# Sanitizer and fuzzer builds (included by the top-level CMakeLists.txt before the library).
#
#   -DTANDEM_SANITIZE=address,undefined   every target (library, tests, examples) is compiled and
#                                         linked with -fsanitize=<list>; UB aborts the process
#                                         (-fno-sanitize-recover=all) so a test that hits it fails.
#   -DTANDEM_FUZZ=ON                      builds the libFuzzer targets of tests/fuzz/ (clang only;
#                                         implies TANDEM_SANITIZE=address,undefined when unset).
#
# scripts/sanitize.sh drives both; docs/10-testing.md explains what they catch.
set(TANDEM_SANITIZE "" CACHE STRING
    "Comma-separated sanitizers for every target, e.g. address,undefined (empty: none)")
option(TANDEM_FUZZ "Build the libFuzzer targets in tests/fuzz (clang only)" OFF)

if(TANDEM_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "TANDEM_FUZZ=ON needs clang (libFuzzer), but the C++ compiler is "
                        "${CMAKE_CXX_COMPILER_ID}: configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  if(NOT TANDEM_SANITIZE)
    set(TANDEM_SANITIZE "address,undefined" CACHE STRING
        "Comma-separated sanitizers for every target, e.g. address,undefined (empty: none)" FORCE)
  endif()
endif()

if(TANDEM_SANITIZE)
  if(TANDEM_WITH_CUDA)
    # nvcc does not take -fsanitize; host code of .cu files stays uninstrumented.
    message(STATUS "tandem: TANDEM_SANITIZE applies to C++ sources only, not to CUDA sources")
  endif()
  set(_tandem_san -fsanitize=${TANDEM_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_tandem_san}>")
  add_link_options(-fsanitize=${TANDEM_SANITIZE})
  # Line tables only (-g1): a report names file and line without the cost of full debug info.
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-g1>")
  message(STATUS "tandem: sanitizers ${TANDEM_SANITIZE}")
endif()
