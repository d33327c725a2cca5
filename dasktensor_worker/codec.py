"""The call messages: the handler's name, and arrays as ``(dtype, shape, bytes, is_scalar)``.

A call is one request to the handler :data:`CALL_HANDLER` of a worker (installed by
``dasktensor_worker.plugin.ModelHost``) with ``key`` (the model), ``method`` and ``args``
(packed), answered by one reply (see the plugin).

Dask's comm layer packs messages with msgpack and pickles what msgpack cannot carry,
NumPy arrays included.  Packing a numeric array as its dtype string, shape and raw bytes
lets msgpack carry the bytes as they are: about 0.25 ms per round trip faster than the
pickling (measured on loopback with a 10-float logp+grad), which is a quarter of a call.

* Only numeric arrays and NumPy scalars (kinds ``b i u f c``) are packed; anything else
  (object arrays, strings, other Python objects) goes as Dask sends it.
* Non-contiguous arrays (strided views, Fortran order) are packed in C order.
* Unpacked arrays are writeable copies: the receiver (the model, or PyTensor, which owns
  a node's outputs) may write into them.
* Tuples and lists are walked; both come back as tuples (a model returning
  ``[logp, grad]`` gives ``(logp, grad)``).

Both sides use this module: the caller packs arguments and unpacks results, the worker
(:mod:`dasktensor_worker.replica`) the other way round.
"""

from __future__ import annotations

import numpy as np

#: the name of the workers' call handler (``worker.handlers``), i.e. the request's ``op``
CALL_HANDLER = "dasktensor_call"
#: the key marking a packed array in a message
ND = "__dasktensor_nd__"


def pack(value):
    """``value`` with its numeric arrays (at any depth of tuples/lists) packed for msgpack.

    Examples
    --------
    >>> import numpy as np
    >>> pack(np.arange(3.0)[::2])  # doctest: +ELLIPSIS
    {'__dasktensor_nd__': ('<f8', (2,), b'...', False)}
    >>> pack(("text", [np.int8(2)]))
    ('text', [{'__dasktensor_nd__': ('|i1', (), b'\\x02', True)}])
    """
    if isinstance(value, np.ndarray | np.generic) and value.dtype.kind in "biufc":
        arr = np.asarray(value)
        return {ND: (arr.dtype.str, arr.shape, arr.tobytes(), isinstance(value, np.generic))}
    if isinstance(value, tuple | list):
        return type(value)(pack(v) for v in value)
    return value


def unpack(value):
    """The inverse of :func:`pack`: arrays are writeable copies, sequences tuples.

    Examples
    --------
    >>> import numpy as np
    >>> x, s, none = unpack(pack([np.arange(6.0).reshape(2, 3).T, np.float32(2.5), None]))
    >>> x
    array([[0., 3.],
           [1., 4.],
           [2., 5.]])
    >>> x.flags.writeable, type(s).__name__, float(s), none
    (True, 'float32', 2.5, None)
    """
    if isinstance(value, dict) and ND in value:
        dtype, shape, data, scalar = value[ND]
        arr = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
        return arr[()] if scalar else arr
    if isinstance(value, tuple | list):
        return tuple(unpack(v) for v in value)
    return value
