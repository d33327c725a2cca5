"""Oracle for dasktensor tests: a graph must compute what PyTensor's default mode computes.

In the spirit of PyTensor's ``compare_jax_and_py``: :func:`assert_matches_default` compiles
a graph twice, with :func:`dasktensor.function` and with plain ``pytensor.function``
(the line's default mode: C VM on PyTensor 2.38, Numba on PyTensor 3.x), calls both a few
times and compares, after every call,

* every output (exactly for integers and booleans, ``allclose`` for floats, bit-generator
  states for random generators), with dtypes, shapes and container types;
* the value of every shared variable either function reads or updates (so updates,
  including random generator updates, must agree call after call);
* the arguments passed to the dasktensor function, which it may not modify;
* the outputs the dasktensor function returned earlier, which later calls may not
  overwrite.

Both functions share the graph and therefore its shared variables.  The oracle keeps them
independent by snapshotting every shared value before each call and restoring it before
the other function's call: each call of either function starts from the same state (the
state the *reference* function reached after the previous call), so random graphs draw the
same numbers from identically seeded generators without building the graph twice.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytensor
from numpy.testing import assert_allclose, assert_array_equal

import dasktensor as dt

__all__ = ["assert_matches_default", "assert_values_equal"]

# Warnings the *reference* backend may emit for test Ops (a Python ``perform`` run by the
# Numba backend in object mode).  They say nothing about dasktensor and are silenced for
# the reference function only: dasktensor's own compilation and calls stay under the
# test suite's ``filterwarnings = error``.
_REFERENCE_NOISE = (r".*Numba will use object mode.*",)


def _tolerances(dtype: np.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing values of a floating-point or complex dtype."""
    if np.finfo(dtype).bits <= 32:  # float16/32, complex64
        return 1e-4, 1e-6
    return 1e-7, 1e-12


def assert_values_equal(actual: Any, expected: Any, what: str = "value", *, rtol=None, atol=None):
    """Assert that ``actual`` (from dasktensor) equals ``expected`` (from the reference).

    Arrays must agree in container type, dtype and shape; integer and boolean arrays
    exactly, floating-point ones within a tolerance that depends on the dtype.  Random
    generators must be in the same bit-generator state.
    """
    if isinstance(expected, np.random.Generator):
        assert isinstance(actual, np.random.Generator), (
            f"{what}: expected a numpy Generator, got {type(actual).__name__}"
        )
        _assert_state_equal(
            actual.bit_generator.state, expected.bit_generator.state, f"{what} (generator)"
        )
        return
    if isinstance(expected, np.random.RandomState):
        assert isinstance(actual, np.random.RandomState), what
        _assert_state_equal(actual.get_state(legacy=False), expected.get_state(legacy=False), what)
        return
    if expected is None:
        assert actual is None, f"{what}: expected None, got {actual!r}"
        return
    if isinstance(expected, (list, tuple)) and not isinstance(expected, np.ndarray):
        assert type(actual) is type(expected), (
            f"{what}: expected a {type(expected).__name__}, got {type(actual).__name__}"
        )
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_values_equal(a, e, f"{what}[{i}]", rtol=rtol, atol=atol)
        return
    assert type(actual) is type(expected), (
        f"{what}: expected a {type(expected).__name__}, got {type(actual).__name__} ({actual!r})"
    )
    a = np.asarray(actual)
    e = np.asarray(expected)
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != expected {e.dtype}"
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    if np.issubdtype(e.dtype, np.inexact):
        r, t = _tolerances(e.dtype)
        assert_allclose(
            a,
            e,
            rtol=r if rtol is None else rtol,
            atol=t if atol is None else atol,
            equal_nan=True,
            err_msg=what,
        )
    else:
        assert_array_equal(a, e, err_msg=what, strict=True)


def _assert_state_equal(actual, expected, what):
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), what
        for k in expected:
            _assert_state_equal(actual[k], expected[k], f"{what}[{k!r}]")
    elif isinstance(expected, np.ndarray):
        assert_array_equal(actual, expected, err_msg=what)
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def _shared_variables(*fns) -> list:
    """The shared variables that any of the compiled functions reads or updates."""
    seen: dict[int, Any] = {}
    for fn in fns:
        for inp in fn.maker.inputs:
            if inp.implicit:
                seen.setdefault(id(inp.variable), inp.variable)
    return list(seen.values())


def _snapshot(shared: Sequence) -> list:
    return [copy.deepcopy(sv.get_value(borrow=True)) for sv in shared]


def _restore(shared: Sequence, values: Sequence) -> None:
    for sv, value in zip(shared, values):
        sv.set_value(copy.deepcopy(value), borrow=True)


def _as_list(result, n_outputs_is_list: bool) -> list:
    return list(result) if n_outputs_is_list else [result]


def assert_matches_default(
    inputs,
    outputs,
    input_values: Sequence | Callable[[int], Sequence] = (),
    *,
    updates=None,
    givens=None,
    scheduler=None,
    heavy_flops: float | None = None,
    n_calls: int = 2,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs,
):
    """Compile ``inputs -> outputs`` with dasktensor and with PyTensor's default mode,
    call both ``n_calls`` times, and assert that they agree after every call.

    Parameters
    ----------
    inputs, outputs, updates, givens, **kwargs
        As for ``pytensor.function`` (both functions get the same arguments).
    input_values : sequence, or callable ``call_index -> sequence``
        Values of the explicit inputs, the same for every call or one set per call.
    scheduler, heavy_flops
        Passed to :func:`dasktensor.function`.
    n_calls : int
        How many times each function is called (shared variables carry over).
    rtol, atol : float, optional
        Override the dtype-dependent tolerances for floating-point values.

    Returns
    -------
    dasktensor.DaskFunction
        The dasktensor function, to inspect ``f.plan``.
    """
    fn_kwargs = dict(kwargs)
    if updates is not None:
        fn_kwargs["updates"] = updates
    if givens is not None:
        fn_kwargs["givens"] = givens
    is_list = isinstance(outputs, (list, tuple))

    f = dt.function(inputs, outputs, scheduler=scheduler, heavy_flops=heavy_flops, **fn_kwargs)
    with warnings.catch_warnings():
        for pattern in _REFERENCE_NOISE:
            warnings.filterwarnings("ignore", message=pattern)
        g = pytensor.function(inputs, outputs, **fn_kwargs)

    shared = _shared_variables(f, g)
    names = [sv.name or f"shared[{i}]" for i, sv in enumerate(shared)]
    state = _snapshot(shared)
    returned: list[tuple[str, Any, Any]] = []  # (what, object returned, copy of it)

    for k in range(n_calls):
        values = input_values(k) if callable(input_values) else input_values
        values = list(values)

        # reference first: its end state is the next call's start state
        _restore(shared, state)
        args = copy.deepcopy(values)
        with warnings.catch_warnings():
            for pattern in _REFERENCE_NOISE:
                warnings.filterwarnings("ignore", message=pattern)
            expected = _as_list(g(*args), is_list)
        expected_state = _snapshot(shared)

        _restore(shared, state)
        args = copy.deepcopy(values)
        actual = _as_list(f(*args), is_list)
        actual_state = _snapshot(shared)

        assert len(actual) == len(expected), f"call {k}: {len(actual)} outputs != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_values_equal(a, e, f"call {k}: output {i}", rtol=rtol, atol=atol)
            returned.append((f"call {k}: output {i}", a, copy.deepcopy(a)))
        for name, a, e in zip(names, actual_state, expected_state):
            assert_values_equal(
                a, e, f"call {k}: shared variable {name} after the call", rtol=rtol, atol=atol
            )
        for i, (arg, value) in enumerate(zip(args, values)):
            assert_values_equal(arg, value, f"call {k}: argument {i} was modified by the call")
        state = expected_state

    # results handed to the caller belong to the caller: later calls must not reuse them
    for what, obj, snapshot in returned:
        assert_values_equal(obj, snapshot, f"{what} was overwritten by a later call")

    _restore(shared, state)
    return f
