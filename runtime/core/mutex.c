/*
 * runtime/core/mutex.c - the per-thread record of held internal mutexes
 * that Debug builds use to check the lock order written in core/core.h.
 */
#include "core/core.h"

#ifdef DMEM_DEBUG
_Thread_local unsigned dmem__held_ranks;
#else
/* Release builds keep no record (ISO C wants a declaration in every file). */
typedef int dmem__mutex_c_unused;
#endif
