# turnout._torch_outputs: the normal ops' output tensors made through torch's
# C++ allocator (python/turnout/ops/outputs.py). Built only where torch can be
# imported at build time, against that torch, whose version is installed
# beside it: the Python layer imports the module only under that version.
if(NOT TURNOUT_TORCH_OUTPUTS)
  return()
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  RESULT_VARIABLE _turnout_torch_result OUTPUT_VARIABLE _turnout_torch_info ERROR_QUIET
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _turnout_torch_result EQUAL 0)
  message(STATUS "turnout._torch_outputs: torch is not importable here; outputs come from new_empty")
  return()
endif()
string(REPLACE "\n" ";" _turnout_torch_info "${_turnout_torch_info}")
list(GET _turnout_torch_info 0 _turnout_torch_dir)
list(GET _turnout_torch_info 1 _turnout_torch_version)
list(GET _turnout_torch_info 2 _turnout_torch_abi)
message(STATUS "turnout._torch_outputs: against torch ${_turnout_torch_version} (${_turnout_torch_dir})")
Python_add_library(_torch_outputs MODULE WITH_SOABI python/ext_torch/torch_outputs.cpp)
target_compile_features(_torch_outputs PRIVATE cxx_std_17)
target_include_directories(_torch_outputs SYSTEM PRIVATE "${_turnout_torch_dir}/include"
                           "${_turnout_torch_dir}/include/torch/csrc/api/include")
target_compile_definitions(_torch_outputs PRIVATE _GLIBCXX_USE_CXX11_ABI=${_turnout_torch_abi})
target_compile_options(_torch_outputs PRIVATE -Wall -Wextra)
foreach(_lib torch torch_cpu c10 torch_python)
  target_link_libraries(_torch_outputs PRIVATE "${_turnout_torch_dir}/lib/lib${_lib}.so")
endforeach()
file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/_torch_outputs_build.py"
     "\"\"\"The torch turnout._torch_outputs was built against (generated).\"\"\"\ntorch_version = \"${_turnout_torch_version}\"\n")
install(TARGETS _torch_outputs LIBRARY DESTINATION turnout)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/_torch_outputs_build.py" DESTINATION turnout)
