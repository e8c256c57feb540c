# Passes only when SOURCE fails to compile AND its control build (-DVRAM_CONTROL, the
# same file with the offending line replaced by a legal one) compiles: so a case cannot
# "pass" because of an unrelated error such as a missing include.
set(flags -std=c++20 -fsyntax-only -DLIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
  -I${INCLUDES} -I${CUDA_INCLUDES} -I${CUDA_INCLUDES}/cccl)
execute_process(COMMAND ${CXX} ${flags} -DVRAM_CONTROL ${SOURCE}
  RESULT_VARIABLE control_result ERROR_VARIABLE control_errors)
if(NOT control_result EQUAL 0)
  message(FATAL_ERROR "control build of ${SOURCE} failed, so the case proves nothing:\n${control_errors}")
endif()
execute_process(COMMAND ${CXX} ${flags} ${SOURCE}
  RESULT_VARIABLE result ERROR_VARIABLE errors)
if(result EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it must not")
endif()
message(STATUS "rejected as expected: ${SOURCE}")
