# Runs doc_snippets on a fixture checkout that it must reject: passes only when it exits
# non-zero and its output matches EXPECT (so it failed for the expected reason).
#   cmake -DTOOL=... -DROOT=... -DOUT=... -DFLAGS=... -DEXPECT=<regex> -P expect_failure.cmake
execute_process(COMMAND ${TOOL} --root ${ROOT} --out ${OUT} --flags ${FLAGS} --jobs 1
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
message("${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "doc_snippets accepted ${ROOT}, which it must reject")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "doc_snippets rejected ${ROOT}, but its output does not match: ${EXPECT}")
endif()
