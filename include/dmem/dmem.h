/*
 * dmem/dmem.h - umbrella header of dmem, a runtime for deferrable
 * (spillable) GPU memory.
 *
 * Conventions: every fallible call returns dmem_status_t (DMEM_OK = 0, errors
 * negative); outputs come last, end in _out, and are written only on success;
 * every function is thread-safe unless its documentation says otherwise.
 *
 * Two statuses may come from calls whose lists do not name them:
 * DMEM_ERR_DEVICE_FATAL once the runtime's device context is lost (from
 * calls that start new work; freeing, statistics and synchronisation go on
 * working), and DMEM_ERR_FORKED in a child made by fork(), from every call
 * on a runtime the child inherited but the few named in dmem/runtime.h.
 *
 * Bad input (a NULL pointer, a zero, freed, forged or another runtime's
 * handle, an unknown enum value or flag, a size of 0 or one no memory can
 * hold, an unlock without a lock) gives the status the function documents
 * for it and changes nothing: no output is written, no buffer moves or
 * changes its lock count, callbacks are not called, and the statistics stay
 * as they were (tests/test_badinput.c checks every public function).
 */
#ifndef DMEM_DMEM_H
#define DMEM_DMEM_H

#define DMEM_VERSION_MAJOR 0
#define DMEM_VERSION_MINOR 1
#define DMEM_VERSION_PATCH 0

#include "dmem/status.h"
#include "dmem/types.h"
#include "dmem/config.h"
#include "dmem/runtime.h"
#include "dmem/buffer.h"
#include "dmem/launch.h"
#include "dmem/stream.h"
#include "dmem/spill.h"
#include "dmem/stats.h"
#include "dmem/controller.h"
#include "dmem/device.h"

#endif /* DMEM_DMEM_H */
