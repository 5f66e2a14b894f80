"""A stand-in for _C's low-latency entry (python/ext/low_latency_entry.hpp),
built with ctypes as a mirror of its structs: ``Recorder`` keeps each call's
arguments, returns ``code`` (0: queued, 1: not taken) and, when it queues,
hands back the ring's next event as _C does (None without a ring)."""
import ctypes


class DispatchArgs(ctypes.Structure):  # LowLatencyDispatchArgs
    _fields_ = [("x", ctypes.c_void_p), ("num_tokens", ctypes.c_int), ("hidden", ctypes.c_int),
                ("topk_idx", ctypes.c_void_p), ("num_topk", ctypes.c_int), ("topk_weights", ctypes.c_void_p),
                ("num_max_tokens", ctypes.c_int), ("num_experts", ctypes.c_int), ("use_fp8", ctypes.c_bool),
                ("round_scale", ctypes.c_bool), ("use_ue8m0", ctypes.c_bool), ("recv_x", ctypes.c_void_p),
                ("recv_scales", ctypes.c_void_p), ("recv_packed_scales", ctypes.c_void_p),
                ("recv_count", ctypes.c_void_p), ("src_info", ctypes.c_void_p), ("layout_range", ctypes.c_void_p),
                ("plan", ctypes.c_void_p), ("cumulative_local_expert_recv_stats", ctypes.c_void_p),
                ("wait_recv_cost_stats", ctypes.c_void_p)]


class CombineArgs(ctypes.Structure):  # LowLatencyCombineArgs
    _fields_ = [("x", ctypes.c_void_p), ("topk_idx", ctypes.c_void_p), ("topk_weights", ctypes.c_void_p),
                ("num_tokens", ctypes.c_int), ("num_topk", ctypes.c_int), ("hidden", ctypes.c_int),
                ("num_max_tokens", ctypes.c_int), ("num_experts", ctypes.c_int), ("plan", ctypes.c_void_p),
                ("use_logfmt", ctypes.c_bool), ("out", ctypes.c_void_p), ("wait_recv_cost_stats", ctypes.c_void_p)]


DISPATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.POINTER(DispatchArgs),
                               ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.py_object,
                               ctypes.POINTER(ctypes.c_void_p))
COMBINE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(CombineArgs), ctypes.c_int,
                              ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.py_object,
                              ctypes.POINTER(ctypes.c_void_p))


class Entry(ctypes.Structure):  # LowLatencyEntry
    _fields_ = [("entry_size", ctypes.c_uint32), ("dispatch_size", ctypes.c_uint32), ("combine_size", ctypes.c_uint32),
                ("dispatch", DISPATCH_FN), ("combine", COMBINE_FN)]


def sizes(**changes):
    """The sizes of an entry, as this build's structs have them, with ``changes``."""
    return dict(dict(entry_size=ctypes.sizeof(Entry), dispatch_size=ctypes.sizeof(DispatchArgs),
                     combine_size=ctypes.sizeof(CombineArgs)), **changes)


def capsule(entry, name=b"turnout._C.low_latency_entry"):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name_buffer = ctypes.create_string_buffer(name)
    made = new(ctypes.addressof(entry), name_buffer, None)
    return made, name_buffer


def _new_reference(obj) -> int:
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return id(obj)


class Recorder:
    """Keeps each call in ``calls``: ``op`` ("dispatch" or "combine"), the
    native object, dispatch's outputs object, the args by field, the phase,
    stream, ``wait_for`` (None for a null pointer) and ring; with ``keep``
    false it only counts them (for timing)."""

    def __init__(self, keep: bool = True):
        self.calls, self.count, self.code = [], 0, 0

        def record(op, native, outputs, args, phase, stream, wait_for, ring, event):
            self.count += 1
            if keep:
                a = args.contents
                self.calls.append(dict(op=op, native=native, outputs=outputs,
                                       args={name: getattr(a, name) for name, _ in a._fields_}, phase=phase,
                                       stream=stream, wait_for=wait_for[0] if wait_for else None, ring=ring))
            if self.code == 0:
                event[0] = _new_reference(None if ring is None else ring.record(stream))
            return self.code

        def dispatch(native, outputs, args, phase, stream, wait_for, ring, event):
            return record("dispatch", native, outputs, args, phase, stream, wait_for, ring, event)

        def combine(native, args, phase, stream, wait_for, ring, event):
            return record("combine", native, None, args, phase, stream, wait_for, ring, event)

        self.fns = DISPATCH_FN(dispatch), COMBINE_FN(combine)
        self.entry = Entry(**sizes(), dispatch=self.fns[0], combine=self.fns[1])


def install(module, recorder):
    """Makes ``recorder`` the low-latency entry of ``module``
    (turnout._torch_ext); returns what must stay alive while it is."""
    made, name = capsule(recorder.entry)
    module.set_low_latency_entry(made)
    return made, name
