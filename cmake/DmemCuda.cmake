# cmake/DmemCuda.cmake - the CUDA language for the .cu files of examples/,
# bench/ and tests/gpu/ (included by the top CMakeLists.txt).
#
#   dmem_enable_cuda(found)     check for nvcc; if there, default the
#                               architectures (Hopper, the lent H100/H200,
#                               and cheaply Ampere; PTX for newer ones) and
#                               enable CUDA in the calling directory. `found`
#                               is set TRUE or FALSE there. A macro:
#                               enable_language must run at file scope.
#   dmem_cuda_warnings(target)  nvcc and host-compiler warnings, errors
#                               under DMEM_WERROR
include(CheckLanguage)

macro(dmem_enable_cuda found)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    endif()
    enable_language(CUDA)
    set(${found} TRUE)
  else()
    set(${found} FALSE)
  endif()
endmacro()

function(dmem_cuda_warnings target)
  target_compile_options(${target} PRIVATE -Xcompiler=-Wall,-Wextra
    $<$<BOOL:${DMEM_WERROR}>:-Werror=all-warnings -Xcompiler=-Werror>)
endfunction()
