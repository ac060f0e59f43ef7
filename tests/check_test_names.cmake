# A ctest check: no test case name may contain ';'. catch_discover_tests reads the names as a
# CMake list, so a name with ';' becomes two ctest entries that match no test case.
# Run as: cmake -DTEST_EXE=... "-DLIST_ARGS=--list-test-names-only" -P check_test_names.cmake
separate_arguments(list_args UNIX_COMMAND "${LIST_ARGS}")
execute_process(COMMAND "${TEST_EXE}" ${list_args} OUTPUT_VARIABLE names RESULT_VARIABLE rc)
if(rc LESS 0 OR names STREQUAL "")
  message(FATAL_ERROR "could not list the test cases of ${TEST_EXE} (exit ${rc})")
endif()
string(REGEX MATCH "[^\n]*;[^\n]*" bad "${names}")
if(NOT bad STREQUAL "")
  message(FATAL_ERROR "test case name contains ';', which ctest splits into entries that run nothing: \"${bad}\"")
endif()
