# Installs the built vram into a scratch prefix, then configures, builds and runs three
# user projects against it with find_package(vram):
#   examples/consumer      C++ only, sets no C++ standard (vram::vram must carry C++20)
#   examples               the README's examples, one of them a .cu file built by nvcc
#   examples/weight_pager  the runnable WeightPager example (nvcc)
# Each example program exits 0, with a "no CUDA device" line when no GPU is usable.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "install failed")
endif()
foreach(internal include/vram/detail include/vram/virtual_memory.hpp include/vram/testing)
  if(EXISTS ${WORK_DIR}/prefix/${internal})
    message(FATAL_ERROR "the internal ${internal} was installed")
  endif()
endforeach()

function(build_project name source_dir)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${source_dir} -B ${WORK_DIR}/${name}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release
    RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "configuring ${source_dir} against the installed vram failed")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/${name} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "building ${source_dir} against the installed vram failed")
  endif()
endfunction()

function(run_program path)
  execute_process(COMMAND ${path} RESULT_VARIABLE result OUTPUT_VARIABLE output
    ERROR_VARIABLE error)
  message(STATUS "${path}: ${output}${error}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${path} exited with ${result}")
  endif()
endfunction()

build_project(consumer ${EXAMPLE_DIR}/consumer)
run_program(${WORK_DIR}/consumer/vram_consumer)

build_project(examples ${EXAMPLE_DIR})
foreach(program device_pool stream_ordered_pool pinned_staging_pool)
  run_program(${WORK_DIR}/examples/${program})
endforeach()

# Every example exits 0 without a GPU (it says so and runs nothing).
build_project(weight_pager ${EXAMPLE_DIR}/weight_pager)
run_program(${WORK_DIR}/weight_pager/weight_pager_example)
