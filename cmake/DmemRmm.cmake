# cmake/DmemRmm.cmake - RMM's C++ headers and libraries, when they are there
# (included by the top CMakeLists.txt). Everything RMM-specific in dmem is
# optional: without RMM, nothing of it is built.
#
#   dmem_find_rmm()   looks for RMM in DMEM_RMM_ROOT (a folder holding
#                     librmm/ and rapids_logger/ as the librmm-cu13 and
#                     rapids-logger wheels unzip, or a site-packages where
#                     they are installed), else in the site-packages of
#                     Python3_EXECUTABLE (the installed librmm wheel). When
#                     found (with the CUDA toolkit's headers and a C++
#                     compiler), enables C++ and makes the INTERFACE target
#                     dmem_rmm: RMM's headers and its CCCL (plain -I, ahead
#                     of the toolkit's older CCCL), the definitions RMM's own
#                     CMake package puts on CCCL, librmm and
#                     librapids_logger. Sets DMEM_RMM_FOUND (ON/OFF),
#                     DMEM_RMM_VERSION, DMEM_RMM_LIBDIRS (for an RPATH) in
#                     the caller's scope. A macro: enable_language must run
#                     at file scope.
#
# DMEM_RMM_ROOT given but without RMM in it is an error; RMM not found
# otherwise is a status message. The wheels' own CMake package
# (lib64/cmake/rmm) asks for CMake >= 4.0, hence the target made here.
include(CheckLanguage)

set(DMEM_RMM_ROOT "" CACHE PATH
  "Folder with librmm/ and rapids_logger/ (unzipped or installed wheels): builds dmem's RMM resource and bench_alloc's RMM columns")

macro(dmem_find_rmm)
  set(DMEM_RMM_FOUND OFF)
  set(_dmem_rmm_root "${DMEM_RMM_ROOT}")
  set(_dmem_rmm_why "")
  if(NOT _dmem_rmm_root AND Python3_EXECUTABLE)
    # The installed wheel: librmm/ and rapids_logger/ side by side.
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
        "import importlib.util as u, os; s = u.find_spec('librmm'); print(os.path.dirname(list(s.submodule_search_locations)[0]) if s else '')"
      OUTPUT_VARIABLE _dmem_rmm_root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  if(_dmem_rmm_root)
    set(_dmem_rmm_lib ${_dmem_rmm_root}/librmm/lib64/librmm.so)
    set(_dmem_rmm_logger ${_dmem_rmm_root}/rapids_logger/lib64/librapids_logger.so)
    if(NOT EXISTS ${_dmem_rmm_root}/librmm/include/rmm/mr/pool_memory_resource.hpp
       OR NOT EXISTS ${_dmem_rmm_lib} OR NOT EXISTS ${_dmem_rmm_logger})
      string(CONCAT _dmem_rmm_why "${_dmem_rmm_root} has no librmm/include/rmm, "
        "librmm/lib64/librmm.so and rapids_logger/lib64/librapids_logger.so (unzip or "
        "install the librmm-cu13 and rapids-logger wheels there)")
      if(DMEM_RMM_ROOT)
        message(FATAL_ERROR "DMEM_RMM_ROOT=${_dmem_rmm_why}")
      endif()
    elseif(NOT CUDAToolkit_INCLUDE_DIRS)
      set(_dmem_rmm_why "the CUDA toolkit's headers were not found (RMM's CCCL needs them)")
    else()
      check_language(CXX)
      if(NOT CMAKE_CXX_COMPILER)
        set(_dmem_rmm_why "no C++ compiler was found")
      else()
        enable_language(CXX)
        set(DMEM_RMM_FOUND ON)
      endif()
    endif()
  else()
    set(_dmem_rmm_why "no DMEM_RMM_ROOT and no librmm wheel in ${Python3_EXECUTABLE}")
  endif()
  if(DMEM_RMM_FOUND AND NOT TARGET dmem_rmm)
    file(READ ${_dmem_rmm_root}/librmm/VERSION DMEM_RMM_VERSION)
    string(STRIP "${DMEM_RMM_VERSION}" DMEM_RMM_VERSION)
    set(DMEM_RMM_LIBDIRS ${_dmem_rmm_root}/librmm/lib64 ${_dmem_rmm_root}/rapids_logger/lib64)
    add_library(dmem_rmm INTERFACE)
    target_include_directories(dmem_rmm INTERFACE
      ${_dmem_rmm_root}/librmm/include ${_dmem_rmm_root}/librmm/include/rapids
      ${_dmem_rmm_root}/rapids_logger/include)
    target_include_directories(dmem_rmm SYSTEM INTERFACE ${CUDAToolkit_INCLUDE_DIRS})
    target_compile_definitions(dmem_rmm INTERFACE CUB_DISABLE_NAMESPACE_MAGIC
      CUB_IGNORE_NAMESPACE_MAGIC_ERROR THRUST_DISABLE_ABI_NAMESPACE
      THRUST_IGNORE_ABI_NAMESPACE_ERROR CCCL_DISABLE_PDL)
    target_compile_features(dmem_rmm INTERFACE cxx_std_17)
    target_link_libraries(dmem_rmm INTERFACE ${_dmem_rmm_lib} ${_dmem_rmm_logger})
    # librmm needs librapids_logger, which its RUNPATH ($ORIGIN) does not
    # find in the wheels' layout: keep it a direct dependency (a toolchain
    # linking --as-needed would drop it when no symbol of it is used), so
    # that the loader has it, through our RPATH, before librmm asks.
    target_link_options(dmem_rmm INTERFACE "LINKER:--no-as-needed")
    message(STATUS "dmem: RMM ${DMEM_RMM_VERSION} from ${_dmem_rmm_root}")
  elseif(NOT DMEM_RMM_FOUND)
    message(STATUS "dmem: RMM not used (${_dmem_rmm_why})")
  endif()
endmacro()

# C++ warnings for the RMM code, errors under DMEM_WERROR.
function(dmem_rmm_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${DMEM_WERROR}>>:-Werror>)
endfunction()
