# NVSHMEM, the transport to ranks on other hosts, lives in a shared library of
# its own, turnout_nvshmem, which the core dlopens on first need
# (src/runtime/nvshmem_loader.cpp): the core and the Python module never link
# NVSHMEM, so a process that stays on one host never loads it, and a build
# without NVSHMEM gives everything else unchanged.
#
# TURNOUT_NVSHMEM: AUTO builds it where NVSHMEM is found, ON requires it, OFF
# never builds it. NVSHMEM is taken from NVSHMEM_HOME (CMake or environment
# variable) if set, else from the pip wheel nvidia-nvshmem-cu13 of the Python
# interpreter.

set(TURNOUT_NVSHMEM AUTO CACHE STRING "Build the NVSHMEM transport library: AUTO (where NVSHMEM is found), ON, OFF")
set_property(CACHE TURNOUT_NVSHMEM PROPERTY STRINGS AUTO ON OFF)
set(TURNOUT_NVSHMEM_WHEEL "nvidia-nvshmem-cu13==3.4.5")

# Sets TURNOUT_NVSHMEM_ROOT (with include/ and lib/ below it) and
# TURNOUT_NVSHMEM_FROM_WHEEL, or TURNOUT_NVSHMEM_MISSING to why not.
function(turnout_locate_nvshmem)
  set(home "${NVSHMEM_HOME}")
  if(home STREQUAL "")
    set(home "$ENV{NVSHMEM_HOME}")
  endif()
  if(NOT home STREQUAL "")
    set(TURNOUT_NVSHMEM_ROOT "${home}" PARENT_SCOPE)
    set(TURNOUT_NVSHMEM_FROM_WHEEL OFF PARENT_SCOPE)
    return()
  endif()
  if(NOT Python_EXECUTABLE)
    find_package(Python 3.9 COMPONENTS Interpreter)
  endif()
  if(NOT Python_EXECUTABLE)
    set(TURNOUT_NVSHMEM_MISSING "no NVSHMEM_HOME and no Python interpreter to ask for the wheel" PARENT_SCOPE)
    return()
  endif()
  # nvidia.nvshmem is a namespace package: its folder is its __path__.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
    RESULT_VARIABLE rc OUTPUT_VARIABLE root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT rc EQUAL 0 OR root STREQUAL "")
    set(TURNOUT_NVSHMEM_MISSING
      "no NVSHMEM_HOME, and ${Python_EXECUTABLE} cannot import nvidia.nvshmem (pip install ${TURNOUT_NVSHMEM_WHEEL})"
      PARENT_SCOPE)
    return()
  endif()
  set(TURNOUT_NVSHMEM_ROOT "${root}" PARENT_SCOPE)
  set(TURNOUT_NVSHMEM_FROM_WHEEL ON PARENT_SCOPE)
endfunction()

# Sets the include folder, the library folder and both libraries under
# TURNOUT_NVSHMEM_ROOT, or TURNOUT_NVSHMEM_MISSING to what is not there.
function(turnout_check_nvshmem root)
  if(NOT EXISTS "${root}/include/nvshmem.h")
    set(TURNOUT_NVSHMEM_MISSING "${root}/include/nvshmem.h does not exist" PARENT_SCOPE)
    return()
  endif()
  foreach(dir IN ITEMS "${root}/lib" "${root}/lib64")
    # The wheel has only the versioned file name; an NVSHMEM_HOME install has both.
    foreach(name IN ITEMS libnvshmem_host.so.3 libnvshmem_host.so)
      if(NOT host AND EXISTS "${dir}/${name}" AND EXISTS "${dir}/libnvshmem_device.a")
        set(host "${dir}/${name}")
        set(libdir "${dir}")
      endif()
    endforeach()
  endforeach()
  if(NOT host)
    set(TURNOUT_NVSHMEM_MISSING "${root}/lib holds no libnvshmem_host.so.3 with libnvshmem_device.a" PARENT_SCOPE)
    return()
  endif()
  file(STRINGS "${root}/include/non_abi/nvshmem_version.h" version_lines
    REGEX "#define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION ")
  set(version "")
  foreach(line IN LISTS version_lines)
    string(REGEX REPLACE ".* ([0-9]+)$" "\\1" number "${line}")
    list(APPEND version "${number}")
  endforeach()
  list(JOIN version "." version)
  set(TURNOUT_NVSHMEM_INCLUDE_DIR "${root}/include" PARENT_SCOPE)
  set(TURNOUT_NVSHMEM_LIB_DIR "${libdir}" PARENT_SCOPE)
  set(TURNOUT_NVSHMEM_HOST_LIBRARY "${host}" PARENT_SCOPE)
  set(TURNOUT_NVSHMEM_DEVICE_LIBRARY "${libdir}/libnvshmem_device.a" PARENT_SCOPE)
  set(TURNOUT_NVSHMEM_VERSION "${version}" PARENT_SCOPE)
endfunction()

string(TOUPPER "${TURNOUT_NVSHMEM}" turnout_nvshmem_mode)
if(NOT turnout_nvshmem_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "TURNOUT_NVSHMEM must be AUTO, ON or OFF, not '${TURNOUT_NVSHMEM}'")
endif()
set(TURNOUT_NVSHMEM_FOUND OFF)
if(turnout_nvshmem_mode STREQUAL "OFF")
  message(STATUS "NVSHMEM transport: off (TURNOUT_NVSHMEM=OFF)")
else()
  set(TURNOUT_NVSHMEM_MISSING "")
  turnout_locate_nvshmem()
  if(TURNOUT_NVSHMEM_MISSING STREQUAL "")
    turnout_check_nvshmem("${TURNOUT_NVSHMEM_ROOT}")
  endif()
  if(TURNOUT_NVSHMEM_MISSING STREQUAL "")
    set(TURNOUT_NVSHMEM_FOUND ON)
    message(STATUS "NVSHMEM transport: NVSHMEM ${TURNOUT_NVSHMEM_VERSION} from ${TURNOUT_NVSHMEM_ROOT}")
  elseif(turnout_nvshmem_mode STREQUAL "ON")
    message(FATAL_ERROR "TURNOUT_NVSHMEM=ON, but NVSHMEM was not found: ${TURNOUT_NVSHMEM_MISSING}")
  else()
    message(STATUS "NVSHMEM transport: not built (${TURNOUT_NVSHMEM_MISSING}); one host only")
  endif()
endif()

if(TURNOUT_NVSHMEM_FOUND)
  # The low-latency kernels are compiled again here, on NVSHMEM's transport;
  # error.cpp gives their launch checks the core's exception, caught at the
  # table's boundary.
  add_library(turnout_nvshmem SHARED src/nvshmem/api.cpp src/nvshmem/ring_test.cu src/nvshmem/low_latency.cu
    src/nvshmem/internode.cu
    src/runtime/error.cpp)
  target_include_directories(turnout_nvshmem PRIVATE src include)
  target_include_directories(turnout_nvshmem SYSTEM PRIVATE "${TURNOUT_NVSHMEM_INCLUDE_DIR}")
  # The device library's host half (nvshmemi_init_thread, which sets up the
  # device state this library's kernels read) and its device half both come
  # from libnvshmem_device.a: the device link below resolves them together.
  target_link_libraries(turnout_nvshmem PRIVATE "${TURNOUT_NVSHMEM_DEVICE_LIBRARY}" "${TURNOUT_NVSHMEM_HOST_LIBRARY}"
    CUDA::cudart)
  target_compile_options(turnout_nvshmem PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra --expt-relaxed-constexpr -Xptxas=-v -lineinfo>)
  # In the wheel, turnout/ and nvidia/nvshmem/ sit in one site-packages: the
  # relative entry survives a moved environment, the absolute one a build tree.
  set(turnout_nvshmem_rpath "\$ORIGIN")
  if(TURNOUT_NVSHMEM_FROM_WHEEL)
    list(APPEND turnout_nvshmem_rpath "\$ORIGIN/../nvidia/nvshmem/lib")
  endif()
  list(APPEND turnout_nvshmem_rpath "${TURNOUT_NVSHMEM_LIB_DIR}")
  set_target_properties(turnout_nvshmem PROPERTIES
    CUDA_SEPARABLE_COMPILATION ON
    CUDA_RESOLVE_DEVICE_SYMBOLS ON
    # The process's one CUDA runtime (PyTorch's): streams and the primary
    # context are the same objects as the core's.
    CUDA_RUNTIME_LIBRARY Shared
    # Only turnout_nvshmem_api_v1 is exported (exports.map, below).
    CXX_VISIBILITY_PRESET hidden
    CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    BUILD_RPATH "${turnout_nvshmem_rpath}"
    INSTALL_RPATH "${turnout_nvshmem_rpath}")
  target_link_options(turnout_nvshmem PRIVATE
    "LINKER:--version-script=${CMAKE_CURRENT_SOURCE_DIR}/src/nvshmem/exports.map" "LINKER:--no-undefined")
  set_property(TARGET turnout_nvshmem APPEND PROPERTY LINK_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/src/nvshmem/exports.map")
  # The library lands in the build folder's root, beside the test binaries,
  # where the loader looks (next to the object that holds the core); in the
  # package, beside _C.
  if(TURNOUT_BUILD_PYTHON)
    install(TARGETS turnout_nvshmem LIBRARY DESTINATION turnout)
  endif()

  if(TURNOUT_BUILD_TESTS)
    # Multi-process smoke test of the window and the device path (TCP
    # bootstrap); run by tests/gpu/test_nvshmem_window.py.
    add_executable(turnout_nvshmem_smoke tests/gpu/nvshmem_smoke.cpp)
    target_link_libraries(turnout_nvshmem_smoke PRIVATE turnout)
    target_include_directories(turnout_nvshmem_smoke PRIVATE src)
    target_compile_options(turnout_nvshmem_smoke PRIVATE -Wall -Wextra)
    # Loaded at run time, not linked: built with it.
    add_dependencies(turnout_nvshmem_smoke turnout_nvshmem)
    if(TURNOUT_BUILD_PYTHON)
      install(TARGETS turnout_nvshmem_smoke RUNTIME DESTINATION turnout/bin)
    endif()
  endif()
endif()
