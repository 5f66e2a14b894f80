# turnout._torch_ext: the parts of the Python layer built against torch's C++
# API (python/ext_torch: the ops' outputs from torch's allocator; the common
# intranode dispatch and combine and the low-latency combine, each in one
# call). Built only where torch can be imported at build time, against that
# torch, whose version is installed beside it: the Python layer imports the
# module only under that version (turnout/torch_ext.py).
if(NOT TURNOUT_TORCH_EXT)
  return()
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  RESULT_VARIABLE _turnout_torch_result OUTPUT_VARIABLE _turnout_torch_info ERROR_QUIET
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _turnout_torch_result EQUAL 0)
  message(STATUS "turnout._torch_ext: torch is not importable here; the Python layer does without it")
  return()
endif()
string(REPLACE "\n" ";" _turnout_torch_info "${_turnout_torch_info}")
list(GET _turnout_torch_info 0 _turnout_torch_dir)
list(GET _turnout_torch_info 1 _turnout_torch_version)
list(GET _turnout_torch_info 2 _turnout_torch_abi)
message(STATUS "turnout._torch_ext: against torch ${_turnout_torch_version} (${_turnout_torch_dir})")
Python_add_library(_torch_ext MODULE WITH_SOABI python/ext_torch/module.cpp python/ext_torch/outputs.cpp
                   python/ext_torch/intranode_ops.cpp python/ext_torch/low_latency_ops.cpp)
target_compile_features(_torch_ext PRIVATE cxx_std_17)
target_include_directories(_torch_ext PRIVATE "${PROJECT_SOURCE_DIR}/include" "${PROJECT_SOURCE_DIR}/python/ext")
target_include_directories(_torch_ext SYSTEM PRIVATE "${_turnout_torch_dir}/include"
                           "${_turnout_torch_dir}/include/torch/csrc/api/include")
target_compile_definitions(_torch_ext PRIVATE _GLIBCXX_USE_CXX11_ABI=${_turnout_torch_abi})
target_compile_options(_torch_ext PRIVATE -Wall -Wextra)
foreach(_lib torch torch_cpu c10 torch_python)
  target_link_libraries(_torch_ext PRIVATE "${_turnout_torch_dir}/lib/lib${_lib}.so")
endforeach()
file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/_torch_ext_build.py"
     "\"\"\"The torch turnout._torch_ext was built against (generated).\"\"\"\ntorch_version = \"${_turnout_torch_version}\"\n")
install(TARGETS _torch_ext LIBRARY DESTINATION turnout)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/_torch_ext_build.py" DESTINATION turnout)
