"""dmem.Controller: the base class of Python controllers.

A controller sees every buffer of a runtime, may choose spill victims, and may
keep spilled bytes itself (the "controller" tier). Install one with
``rt.set_controller(ctrl)``; ``rt.set_controller(None)`` removes it (BusyError
while buffers are held in the controller tier).

Only the methods a subclass overrides are called, so a controller that does not
override the ``on_*`` notifications costs nothing per allocation.

Threading: callbacks run on the thread that caused the event (possibly a
runtime thread), with the GIL held and no dmem-internal lock held, so they may
call back into the runtime (``buf.state``, ``rt.stats()``, ``other.spill()``,
``rt.alloc(n)``, ...). The rules (the table in ``dmem/controller.h``):

- ``store`` and ``retrieve`` may not lock, read, peek, spill or unspill the
  buffer they were called for, and no callback may do so on a buffer whose
  lock, unspill or prefetch on the same thread made it run: that raises
  BusyError at once, also after the callback moved other buffers.
  ``buf.free()`` is allowed.
- An allocation from a callback spills other buffers as usual, but does not
  wait for the caller's own spill: OutOfMemoryError at once when only that
  could make room.
- ``rt.set_controller(...)`` from a ``store``, or while the controller holds
  bytes, raises BusyError (it cannot be removed or replaced then).
- A buffer freed while its ``store`` runs gets its ``on_free`` after
  ``store`` returns: drop what was stored for that handle there.

Errors: an exception raised by a callback is not lost. If a Python call on the
same thread triggered the callback (``rt.alloc``, ``buf.spill``, ...), that call
raises :class:`dmem.CallbackError` whose ``__cause__`` is the original
exception (``rt.alloc`` then frees the new buffer). Otherwise (a runtime thread,
a Buffer being collected) it goes to ``sys.unraisablehook``. A failing
``select_victims``, ``store`` or ``retrieve`` makes the runtime operation fail
with DMEM_ERR_CALLBACK and leaves the buffer where it was.

``buf`` arguments are Buffer objects that do not own the handle (collecting
them frees nothing); they compare equal to, and hash like, the Buffer that
``rt.alloc`` returned. Keep ``buf.handle`` rather than the object if you need a
key that outlives the buffer.
"""

__all__ = ["Controller"]


class Controller:
    """Base class: every method is a no-op / default."""

    def on_alloc(self, buf):
        """A buffer was allocated (resident)."""

    def on_free(self, handle):
        """The buffer with this handle (int) was freed; also called for every
        buffer still alive when the runtime closes (drop any bytes kept for
        it in :meth:`store`)."""

    def on_spill(self, buf, tier):
        """buf was moved to tier: 'host', 'disk' or 'controller'."""

    def on_unspill(self, buf, tier):
        """buf was brought back to the device from tier: 'host', 'disk' or
        'controller'. (An override taking only ``buf`` is still called, without
        the tier.)"""

    def on_pressure(self, nbytes):
        """An allocation needs nbytes of room (called before eviction)."""

    def select_victims(self, nbytes):
        """Return buffers (or int handles) to spill so that nbytes are freed,
        or None for the runtime's policy (within priority classes: the
        eviction_policy, 'reuse' or 'lru'). Locked,
        pinned or stale victims are skipped; if they do not free enough the
        default policy frees the rest."""
        return None

    def store(self, buf, data):
        """Keep a copy of a spilled buffer's bytes. ``data`` is a read-only
        memoryview valid only during the call: copy it (``bytes(data)``).
        The return value is ignored (returning ``data`` is fine).
        Override together with :meth:`retrieve` to enable the controller tier
        (``buf.spill("controller")``)."""
        raise NotImplementedError

    def retrieve(self, buf, out):
        """Write the bytes stored for buf into ``out`` (a writable memoryview
        of buf.size bytes, valid only during the call). The runtime asks once
        per store; the stored copy may be dropped afterwards."""
        raise NotImplementedError
