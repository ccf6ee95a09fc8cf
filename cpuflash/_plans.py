"""What a call's shapes, dtypes and options decide, kept for the next call that has the same.

A decoding step calls cpuflash once per layer (30 calls with the same shapes per token), and for
a few hundred cached keys checking the arguments and choosing the plan from scratch costs more
than the kernel's work; the layers of a small model (or a short prompt) call the forward the
same way, and there the checks cost a large share of a call (measured: docs/history.md,
"Per-call cost", small calls). So once a call has passed every check, what those checks and
choices derived from everything that stays the same from call to call (shapes, dtypes, the
options and their types, so that ``True`` never stands in for ``1``) is stored under a key of
exactly those things; the next call with the same key skips to the kernel.
What can fail for the same shapes (the values of `cache_seqlens`, the alignment of the arrays,
an `out` that overlaps an input) is checked on every call, and a call that does not fit a stored
entry takes the full path, so errors are raised as they always were.

An entry keeps no array of the calls, and its own arrays are read-only. Once stored it changes
only where it remembers what later calls worked out (its compiled kernel and work items, the key
counts of the last cache length), each a whole value replaced at once. So Python threads share
the entries without a lock (a dict's get and set are atomic); the table is bounded, oldest
entries leaving first. A child process forked after entries were stored inherits them, and
they hold there too (the same shapes decide the same things).
"""

import numpy as np

from . import tiling

MAX_ENTRIES = 256
_entries = {}
_decode_plans = {}
_schedules = {}


def get(key):
    """The entry stored under `key`, or None."""
    return _entries.get(key)


def put(key, entry):
    """Store `entry` under `key`, making room by dropping the oldest entries."""
    _make_room(_entries)
    _entries[key] = entry


def clear():
    """Forget every entry (tests compare a cached and an uncached call)."""
    _entries.clear()
    _decode_plans.clear()
    _schedules.clear()


def decode_plan(n_keys, n_items, n_threads, head_dim, dtype, num_splits):
    """`tiling.decode_plan`, remembered: keyed on its arguments and on the tiling functions it
    runs (so a replaced `choose_tiles`, as tests do, gets plans of its own)."""
    key = (n_keys, n_items, n_threads, head_dim, dtype, num_splits, tiling.decode_plan,
           tiling.choose_tiles, tiling.MIN_SPLIT_KEYS, tiling.MAX_SPLITS)
    plan = _decode_plans.get(key)
    if plan is None:
        plan = tiling.decode_plan(n_keys, n_items, n_threads, head_dim, dtype, num_splits)
        _make_room(_decode_plans)
        _decode_plans[key] = plan  # a frozen dataclass
    return plan


def schedule(key, make):
    """``make()``, remembered under `key`: the tiles and the work items dealt to the threads
    of the FA-2 kernels, which cost a small call (a layer of a small model) more than its
    kernel does (measured: docs/history.md, "Per-call cost", Numba's dispatcher). `key`
    must hold everything `make` reads, the tiling functions it calls included (tests replace
    them). The plan's arrays are made read-only: every later call shares them."""
    plan = _schedules.get(key)
    if plan is None:
        plan = make()
        for part in plan:
            if isinstance(part, np.ndarray):
                part.flags.writeable = False
        _make_room(_schedules)
        _schedules[key] = plan
    return plan


def launch(plan, valid, make):
    """``make()``, kept on `plan` (its `launch` attribute) for as long as `valid` compares
    equal: what a stored plan's kernel launch derives from the thread count and from the
    functions tests replace (the compiled kernel, the work items, the modifiers), so that a
    repeated call only reads it. Replaced whole, as entries are (see the module's notes)."""
    kept = plan.launch
    if kept is not None and kept[0] == valid:
        return kept[1]
    value = make()
    plan.launch = (valid, value)
    return value


def _make_room(table):
    while len(table) >= MAX_ENTRIES:
        try:
            del table[next(iter(table))]
        except (KeyError, RuntimeError, StopIteration):  # another thread took it first
            break
