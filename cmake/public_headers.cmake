# kiln_public_headers(<out-var> <umbrella>): the umbrella header and every kiln header it reaches
# through `#include "..."`, as paths relative to the source root. These are the public headers:
# the ones installed. Configuration fails if one of them includes a private header (the kernel IR,
# the scheduler, the executor, backends/), so a private include cannot leak into an install.
# Each header in the closure is a configure dependency: an edited include list re-runs CMake.
set(KILN_PRIVATE_HEADER_REGEX
    "^(backends/|memory/planner\\.h|jit/(kernel_ir|index_expr|schedule|executor|lower|collect|plan|render_[a-z_]*|random_prelude|math_prelude|disk_cache)\\.h)")
# Library headers that a public header must not include (<...> includes).
set(KILN_LIBRARY_HEADER_REGEX "^(dnnl|oneapi/|cuda|cublas|cudnn|nvrtc|omp\\.h|nlohmann/|zlib\\.h|mpi\\.h|nccl\\.h)")

function(kiln_public_headers out umbrella)
  set(todo ${umbrella})
  set(done)
  while(todo)
    list(POP_FRONT todo header)
    if(header IN_LIST done)
      continue()
    endif()
    list(APPEND done ${header})
    set_property(DIRECTORY ${CMAKE_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/${header})
    file(STRINGS ${CMAKE_SOURCE_DIR}/${header} system_lines REGEX "^[ \t]*#[ \t]*include[ \t]*<")
    foreach(line ${system_lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*<([^>]+)>.*" "\\1" included "${line}")
      if(included MATCHES "${KILN_LIBRARY_HEADER_REGEX}")
        message(FATAL_ERROR "kiln: the public header ${header} includes <${included}>, a library kiln links privately")
      endif()
    endforeach()
    file(STRINGS ${CMAKE_SOURCE_DIR}/${header} lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
    foreach(line ${lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" included "${line}")
      if(included MATCHES "${KILN_PRIVATE_HEADER_REGEX}")
        message(FATAL_ERROR "kiln: the public header ${header} includes the private ${included}; "
                            "forward-declare what it needs or move the type to a public header")
      endif()
      if(NOT EXISTS ${CMAKE_SOURCE_DIR}/${included})
        message(FATAL_ERROR "kiln: ${header} includes \"${included}\", which is not a path from the source root")
      endif()
      list(APPEND todo ${included})
    endforeach()
  endwhile()
  list(SORT done)
  set(${out} ${done} PARENT_SCOPE)
endfunction()
