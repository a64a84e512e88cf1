# tests/install/run_install_test.cmake - install the current build tree into a
# temporary prefix, then build and run a consumer against it twice:
#   1. CMake: find_package(dmem CONFIG REQUIRED) + dmem::dmem
#   2. pkg-config (if installed): cc $(pkg-config --cflags --libs dmem)
#      -Wl,-rpath,$(pkg-config --variable=libdir dmem)
# as README.md ("Use dmem from C") tells a user to, with LD_LIBRARY_PATH unset.
#
# cmake -DBUILD_DIR=... -DSOURCE_DIR=<tests/install> -DWORK_DIR=... -DLIBDIR=lib
#       -DC_COMPILER=cc -DGENERATOR=... [-DCONFIG=...] [-DSANITIZE=...]
#       -P run_install_test.cmake
cmake_minimum_required(VERSION 3.25)

foreach(v BUILD_DIR SOURCE_DIR WORK_DIR LIBDIR C_COMPILER GENERATOR)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "run_install_test.cmake: -D${v}=... is required")
  endif()
endforeach()

set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/consumer-build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# The consumer runs on the host backend whatever the machine has.
set(ENV{DMEM_BACKEND} host)

set(failures "")

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test: ${what} failed (${rc}):\n${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "install test: ${what}: ok")
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

# A sanitized build tree installs a sanitized libdmem: the consumer needs the
# same runtime.
set(extra_flags "")
if(SANITIZE)
  set(extra_flags "-fsanitize=${SANITIZE}")
endif()

# ---- 1. install ------------------------------------------------------------
set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
run("cmake --install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" ${config_args})

foreach(f include/dmem/dmem.h include/dmem/buffer.h "${LIBDIR}/cmake/dmem/dmemConfig.cmake"
          "${LIBDIR}/cmake/dmem/dmemConfigVersion.cmake" "${LIBDIR}/pkgconfig/dmem.pc")
  if(NOT EXISTS "${prefix}/${f}")
    message(FATAL_ERROR "install test: ${prefix}/${f} was not installed")
  endif()
endforeach()
file(GLOB libs "${prefix}/${LIBDIR}/libdmem.so*" "${prefix}/${LIBDIR}/libdmem.dylib")
if(NOT libs)
  message(FATAL_ERROR "install test: no libdmem shared library in ${prefix}/${LIBDIR}")
endif()
# Internal headers must not leak into the install.
file(GLOB_RECURSE leaked "${prefix}/include/*internal*" "${prefix}/include/*atomic.h"
     "${prefix}/include/*api.h" "${prefix}/include/*core.h" "${prefix}/include/*backend.h"
     "${prefix}/include/*memory.h")
if(leaked)
  list(APPEND failures "internal headers installed: ${leaked}")
endif()

# ---- 2. the CMake consumer ----------------------------------------------------
run("configure the consumer with find_package(dmem)"
  "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/consumer" -B "${consumer_build}" -G "${GENERATOR}"
  "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_C_COMPILER=${C_COMPILER}"
  "-DCMAKE_C_FLAGS=${extra_flags}" "-DCMAKE_EXE_LINKER_FLAGS=${extra_flags}"
  -DCMAKE_BUILD_TYPE=Debug)
run("build the consumer" "${CMAKE_COMMAND}" --build "${consumer_build}" ${config_args})
set(app "${consumer_build}/app")
if(CONFIG AND EXISTS "${consumer_build}/${CONFIG}/app")
  set(app "${consumer_build}/${CONFIG}/app")
endif()
# (no LD_LIBRARY_PATH: the rpath CMake gives the program finds libdmem)
set(saved_ld "$ENV{LD_LIBRARY_PATH}")
unset(ENV{LD_LIBRARY_PATH})
run("run the CMake consumer" "${app}")
set(ENV{LD_LIBRARY_PATH} "${saved_ld}")
message(STATUS "${run_output}")

# ---- 3. pkg-config ---------------------------------------------------------------
find_program(PKG_CONFIG NAMES pkg-config pkgconf)
if(NOT PKG_CONFIG)
  message(STATUS "install test: pkg-config not found, skipping the pkg-config consumer")
else()
  set(ENV{PKG_CONFIG_PATH} "${prefix}/${LIBDIR}/pkgconfig")
  run("pkg-config --cflags --libs dmem" "${PKG_CONFIG}" --cflags --libs dmem)
  string(STRIP "${run_output}" pc_flags)
  message(STATUS "install test: pkg-config says: ${pc_flags}")
  set(define_prefix "")
  # The -I and -L directories must be the installed ones (compared as real
  # paths: a relocatable .pc gives ${pcfiledir}/../.. forms).
  file(REAL_PATH "${prefix}/include" want_inc)
  file(REAL_PATH "${prefix}/${LIBDIR}" want_lib)
  set(at_inc -1)
  set(at_lib -1)
  separate_arguments(pc_items UNIX_COMMAND "${pc_flags}")
  foreach(item ${pc_items})
    if(NOT item MATCHES "^-([IL])(.+)$")
      continue()
    endif()
    set(kind "${CMAKE_MATCH_1}")
    set(dir "${CMAKE_MATCH_2}")
    if(NOT EXISTS "${dir}")
      continue()
    endif()
    file(REAL_PATH "${dir}" dir)
    if(kind STREQUAL "I" AND dir STREQUAL want_inc)
      set(at_inc 0)
    elseif(kind STREQUAL "L" AND dir STREQUAL want_lib)
      set(at_lib 0)
    endif()
  endforeach()
  if(at_inc EQUAL -1 OR at_lib EQUAL -1)
    list(APPEND failures "dmem.pc does not point into the install prefix ${prefix} (pkg-config gives '${pc_flags}'): cmake/dmem.pc.in bakes in CMAKE_INSTALL_PREFIX at configure time, so 'cmake --install --prefix' produces a wrong .pc (use prefix=\${pcfiledir}/<relative>)")
    # Go on with the prefix forced, so that the rest is still checked.
    set(define_prefix "--define-variable=prefix=${prefix}")
    run("pkg-config with the prefix forced" "${PKG_CONFIG}" ${define_prefix} --cflags --libs dmem)
    string(STRIP "${run_output}" pc_flags)
  endif()
  separate_arguments(pc_list UNIX_COMMAND "${pc_flags}")
  separate_arguments(extra_list UNIX_COMMAND "${extra_flags}")
  # The README's command: the rpath from pkg-config's libdir, nothing else
  # tells the program where libdmem.so is (LD_LIBRARY_PATH is cleared).
  run("pkg-config --variable=libdir dmem" "${PKG_CONFIG}" ${define_prefix} --variable=libdir dmem)
  string(STRIP "${run_output}" pc_libdir)
  run("cc main.c -o app $(pkg-config --cflags --libs dmem) -Wl,-rpath,$(pkg-config --variable=libdir dmem)"
    "${C_COMPILER}" -std=c11 -Wall -Wextra -Werror ${extra_list}
    "${SOURCE_DIR}/consumer/main.c" -o "${WORK_DIR}/app_pc" ${pc_list}
    "-Wl,-rpath,${pc_libdir}")
  set(saved_ld "$ENV{LD_LIBRARY_PATH}")
  unset(ENV{LD_LIBRARY_PATH})
  run("run the pkg-config consumer" "${WORK_DIR}/app_pc")
  set(ENV{LD_LIBRARY_PATH} "${saved_ld}")
endif()

if(failures)
  string(REPLACE ";" "\n  " msg "${failures}")
  message(FATAL_ERROR "install test: FAILED:\n  ${msg}")
endif()
message(STATUS "install test: OK")
