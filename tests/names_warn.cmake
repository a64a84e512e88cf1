# cmake -DCC=<compiler> -DINCLUDE=<include dir> -DSOURCE=tests/names_old_calls.c -P names_warn.cmake
# Compiles SOURCE and fails unless the compiler warned about every name
# from before dmem_noun_verb, each time naming the new function, and about
# nothing else.
set(renames
  alloc:buffer_alloc free:buffer_free lock:buffer_lock unlock:buffer_unlock
  set_priority:buffer_set_priority spill:buffer_spill unspill:buffer_unspill
  prefetch:buffer_prefetch evict:runtime_evict set_controller:controller_set
  copy:stream_copy ipc_handle:device_ipc_handle)
execute_process(
  COMMAND ${CC} -std=c11 -Wall -Wextra -fsyntax-only -I${INCLUDE} ${SOURCE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
set(missing "")
set(count 0)
foreach(pair ${renames})
  string(REPLACE ":" ";" pair "${pair}")
  list(GET pair 0 old)
  list(GET pair 1 new)
  if(NOT out MATCHES "dmem_${old}[^a-z_A-Z0-9 ]* is deprecated: use dmem_${new}")
    list(APPEND missing dmem_${old})
  endif()
  math(EXPR count "${count} + 1")
endforeach()
string(REGEX MATCHALL "warning:" warnings "${out}")
list(LENGTH warnings nwarn)
if(NOT rc EQUAL 0 OR missing OR NOT nwarn EQUAL count)
  message(FATAL_ERROR "exit ${rc}; no deprecation warning for: ${missing}; "
                      "${nwarn} warnings for ${count} names:\n${out}")
endif()
message(STATUS "${nwarn} deprecation warnings, one per old name")
