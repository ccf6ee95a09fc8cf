"""One XLA FFI target on the CPU whose handler runs Python functions on XLA's buffers.

`jax.pure_callback` hands its callback copies of the operands and copies the results back;
this target's handler (a ctypes function speaking the XLA FFI C ABI of
``xla/ffi/api/c_api.h``) views XLA's operand and result buffers as numpy arrays in place, so a
job reads its inputs and writes its results where XLA keeps them. A call names its job by the
``plan`` attribute: an index into a table of ``functools.partial(function, options)``.

`cpuflash.jax` is its only user. It lives apart so that reloading that module cannot replace
the handler XLA holds a pointer to. Needs jax (and ml_dtypes, which jax depends on).
"""

import ctypes
import functools
import math

import jax
import ml_dtypes
import numpy as np

__all__ = ["TARGET", "call"]


# -- the XLA FFI C ABI (xla/ffi/api/c_api.h, API 0.x), as far as the handler reads it

class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                           ("next", ctypes.POINTER(_ExtensionBase))]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _ApiVersion), ("internal_api", ctypes.c_void_p),
                ("error_create", ctypes.CFUNCTYPE(ctypes.c_void_p,
                                                  ctypes.POINTER(_ErrorCreateArgs)))]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _List(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets: the same layout
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p),
                ("items", ctypes.POINTER(ctypes.POINTER(_Buffer)))]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
                ("attrs", ctypes.POINTER(ctypes.c_void_p))]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t),
                ("extension_start", ctypes.POINTER(_ExtensionBase)),
                ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", _List), ("rets", _List), ("attrs", _Attrs)]


_EXTENSION_METADATA = 1
_ERROR_INTERNAL = 13
_ATTR_SCALAR = 3
_DATA_S64 = 5
_DTYPES = {1: np.dtype(np.bool_), 4: np.dtype(np.int32), 5: np.dtype(np.int64),
           10: np.dtype(np.float16), 11: np.dtype(np.float32), 12: np.dtype(np.float64),
           16: np.dtype(ml_dtypes.bfloat16)}

TARGET = "cpuflash_attention"
_PLAN = "plan"  # the attribute naming the job: an index into `_JOBS`
_JOBS = []  # job number -> function(operands, results) on numpy views of XLA's buffers
_JOB_NUMBERS = {}  # (function, options) -> job number


def _as_numpy(buffer_pointer, writeable):
    """The numpy view of one XLA buffer (no copy). Valid only during the call."""
    buffer = buffer_pointer.contents
    dtype = _DTYPES[buffer.dtype]
    shape = tuple(buffer.dims[i] for i in range(buffer.rank))
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype=dtype)
    raw = (ctypes.c_char * size).from_address(buffer.data)
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    array.flags.writeable = writeable
    return array


def _job_number(attrs):
    for i in range(attrs.size):
        name = attrs.names[i].contents
        if (ctypes.string_at(name.ptr, name.len) == _PLAN.encode()
                and attrs.types[i] == _ATTR_SCALAR):
            scalar = ctypes.cast(attrs.attrs[i], ctypes.POINTER(_Scalar)).contents
            if scalar.dtype == _DATA_S64:
                return ctypes.cast(scalar.value, ctypes.POINTER(ctypes.c_int64)).contents.value
    raise RuntimeError(f"cpuflash's FFI target was called without its `{_PLAN}` attribute")


def _handle(frame_pointer):
    """XLA_FFI_Handler: run the job the call frame names; NULL means success."""
    frame = frame_pointer.contents
    try:
        extension = frame.extension_start
        if extension and extension.contents.type == _EXTENSION_METADATA:
            # XLA asks at registration which FFI API the handler speaks: the one it offers,
            # since the handler reads only fields that every 0.x version has
            metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension)).contents
            offered = frame.api.contents.api_version
            metadata.metadata.contents.api_version = _ApiVersion(
                ctypes.sizeof(_ApiVersion), None, offered.major_version, offered.minor_version)
            metadata.metadata.contents.traits = 0
            return None
        job = _JOBS[_job_number(frame.attrs)]
        operands = [_as_numpy(frame.args.items[i], False) for i in range(frame.args.size)]
        results = [_as_numpy(frame.rets.items[i], True) for i in range(frame.rets.size)]
        job(operands, results)
        return None
    except BaseException as exc:  # an exception must not cross into XLA: report it as an error
        args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None,
                                f"cpuflash: {type(exc).__name__}: {exc}".encode(),
                                _ERROR_INTERNAL)
        return frame.api.contents.error_create(ctypes.byref(args))


# XLA keeps this pointer for the life of the process: the module must never be reloaded
_handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))(_handle)
jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_handler), platform="cpu")


def call(function, options, operands, result_types):
    """``function(options, operands, results)`` as an XLA custom call; returns the results."""
    key = (function, options)
    number = _JOB_NUMBERS.get(key)
    if number is None:
        _JOBS.append(functools.partial(function, options))
        number = _JOB_NUMBERS[key] = len(_JOBS) - 1
    call = jax.ffi.ffi_call(TARGET, result_types, vmap_method="expand_dims")
    return call(*operands, plan=np.int64(number))
