"""The controller kernels as C function pointers, for the native round loop.

The same Numba code as :mod:`.kernels` (one implementation of each controller), compiled
as ``cfunc``s over the state passed as (double*, length); the native loop calls them
through ``address``. Compiled on first import (cached on disk like the kernels).
"""

from __future__ import annotations

from numba import carray, types

from eesd_local.speculative.controllers.jitcache import kernel_cfunc
from eesd_local.speculative.controllers.kernels import (
    controller_begin,
    controller_decide,
    controller_hindsight,
    controller_update,
)

_state = types.CPointer(types.float64)


@kernel_cfunc(types.void(_state, types.int64))
def begin_c(ptr, n):
    controller_begin(carray(ptr, n))


@kernel_cfunc(types.int64(_state, types.int64, types.int64, types.float64))
def decide_c(ptr, n, step, confidence):
    return controller_decide(carray(ptr, n), step, confidence)


@kernel_cfunc(types.void(_state, types.int64, types.CPointer(types.float64), types.int64, types.int64, types.float64, types.float64))
def update_c(ptr, n, conf, n_conf, n_accepted, t_draft, t_verify):
    controller_update(carray(ptr, n), carray(conf, n_conf), n_accepted, t_draft, t_verify)


@kernel_cfunc(types.void(_state, types.int64, types.int64, types.int64, types.int64))
def hindsight_c(ptr, n, match, n_offered, n_matched):
    controller_hindsight(carray(ptr, n), match, n_offered, n_matched)


def hindsight_address() -> int:
    """The entry point of learning in hindsight (``Rounds.set_hindsight``)."""
    addr = hindsight_c.address
    assert addr, "Numba did not compile the controller cfuncs"
    return addr


def addresses() -> tuple[int, int, int]:
    """(begin, decide, update) entry points for ``eesd_local._native.Rounds``."""
    begin, decide, update = begin_c.address, decide_c.address, update_c.address
    assert begin and decide and update, "Numba did not compile the controller cfuncs"
    return begin, decide, update
