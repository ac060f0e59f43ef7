# cmake -DTANDEM_SOURCE_DIR=... -DTANDEM_BINARY_DIR=... -DWORK_DIR=... -DCONSUMER_DIR=... -DCXX=...
#       [-DCXX_LAUNCHER=...] [-DBUILD_TYPE=...] [-DPREFIX_PATH=a|b] [-DWITH_CUDA=ON|OFF] [-DWITH_GLOO=ON|OFF]
#       -P run_package_test.cmake
# Fails, with the output of the step that failed, unless every step below works.
foreach(var TANDEM_SOURCE_DIR TANDEM_BINARY_DIR WORK_DIR CONSUMER_DIR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_package_test.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()
string(REPLACE "|" ";" PREFIX_PATH "${PREFIX_PATH}")

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${ARGN}\n${out}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
set(common -G "Unix Makefiles" -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=${BUILD_TYPE})
if(CXX_LAUNCHER)
  list(APPEND common -DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER})
endif()

# 1. Install this build (the library it already built, the headers, the config files, the
# launcher).
step("cmake --install" ${CMAKE_COMMAND} --install ${TANDEM_BINARY_DIR} --prefix ${prefix} --component tandem)
foreach(f include/tandem/tandem.h include/tandem/core/tensor.h include/tandem/nn/nn.h bin/tandem-run
          include/tandem/parallel/distributed/ddp.h lib/cmake/tandem/tandemConfig.cmake
          lib/cmake/tandem/tandemConfigVersion.cmake lib/cmake/tandem/tandemTargets.cmake)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "the install has no ${f}")
  endif()
endforeach()
file(GLOB_RECURSE installed_sources ${prefix}/include/*.cpp ${prefix}/include/*.cu ${prefix}/include/*.md)
if(installed_sources)
  message(FATAL_ERROR "the install holds more than headers: ${installed_sources}")
endif()

# 2. find_package(tandem) against the install; the program's line is checked.
set(find_dir ${WORK_DIR}/find_package)
step("configuring the find_package consumer"
     ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${find_dir} ${common} -DTANDEM_CONSUMER=find_package
     -DFIRST_PROGRAM_SOURCE=${TANDEM_SOURCE_DIR}/examples/first_program.cpp
     "-DCMAKE_PREFIX_PATH=${prefix};${PREFIX_PATH}")
step("building the find_package consumer" ${CMAKE_COMMAND} --build ${find_dir})
step("running the find_package consumer" ${find_dir}/consumer ${WORK_DIR})
set(expected "y=17 sum(dW)=4 labels=314")
if(NOT step_output STREQUAL "${expected}\n")
  message(FATAL_ERROR "the consumer printed '${step_output}', expected '${expected}'")
endif()
# The first program (docs/00-first-program.md) prints what the chapter shows: alone, then
# under the installed tandem-run as 2 Gloo processes (rank 0 prints, "[rank 0] " first).
set(chapter ${TANDEM_SOURCE_DIR}/docs/00-first-program.md)
file(READ ${chapter} chapter_text)
function(check_in_chapter what output)
  string(FIND "${chapter_text}" "${output}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what} printed what ${chapter} does not show:\n${output}")
  endif()
endfunction()
step("running first_program" ${find_dir}/first_program ${WORK_DIR})
check_in_chapter("first_program" "${step_output}")
if(NOT EXISTS ${WORK_DIR}/first_program.safetensors)
  message(FATAL_ERROR "first_program wrote no ${WORK_DIR}/first_program.safetensors")
endif()
file(READ ${find_dir}/tandem_run_path.txt tandem_run)
if(NOT tandem_run STREQUAL "${prefix}/bin/tandem-run")
  message(FATAL_ERROR "the package's tandem_RUN_EXECUTABLE is '${tandem_run}', not ${prefix}/bin/tandem-run")
endif()
if(WITH_GLOO)
  file(MAKE_DIRECTORY ${WORK_DIR}/ddp)
  step("running first_program under tandem-run" ${tandem_run} --nproc-per-node 2
       ${find_dir}/first_program ${WORK_DIR}/ddp)
  check_in_chapter("first_program under tandem-run" "${step_output}")
else()
  message(STATUS "package test: this build has no Gloo; first_program under tandem-run not run")
endif()

# A version the package does not claim to be compatible with is refused.
file(WRITE ${WORK_DIR}/too_new/CMakeLists.txt
     "cmake_minimum_required(VERSION 3.25)\nproject(too_new LANGUAGES CXX)\nfind_package(tandem 99 REQUIRED)\n")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/too_new -B ${WORK_DIR}/too_new/build ${common}
                        "-DCMAKE_PREFIX_PATH=${prefix};${PREFIX_PATH}"
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(rc EQUAL 0)
  message(FATAL_ERROR "find_package(tandem 99) accepted the 0.x package")
endif()

# 3. add_subdirectory(<checkout>): configure, then compile the consumer's source against the
# tree's headers through tandem::tandem (the per-object target builds no library).
set(sub_dir ${WORK_DIR}/add_subdirectory)
step("configuring the add_subdirectory consumer"
     ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${sub_dir} ${common} -DTANDEM_CONSUMER=add_subdirectory
     -DTANDEM_SOURCE_DIR=${TANDEM_SOURCE_DIR} -DTANDEM_CUDA=${WITH_CUDA} "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}")
step("compiling the add_subdirectory consumer" ${CMAKE_COMMAND} --build ${sub_dir} --target main.cpp.o)
message(STATUS "package test passed: ${expected}")
