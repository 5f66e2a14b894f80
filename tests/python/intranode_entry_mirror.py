"""A stand-in for _C's intranode entry (python/ext/intranode_entry.hpp),
built with ctypes as a mirror of its structs: ``Recorder`` keeps each call's
arguments and returns ``code`` (0: queued, 1: not taken). The CPU tests of
turnout._torch_ext use it, and scripts/host_profile.py times the one-call
dispatch with it (a callback from C into Python costs about 1 us of that)."""
import ctypes


class Counts(ctypes.Structure):  # DispatchCountsArgs
    _fields_ = [("num_tokens", ctypes.c_int), ("is_token_in_rank", ctypes.c_void_p),
                ("num_tokens_per_expert", ctypes.c_void_p), ("num_experts", ctypes.c_int),
                ("topk_idx", ctypes.c_void_p), ("num_topk", ctypes.c_int), ("expert_alignment", ctypes.c_int),
                ("num_worst_tokens", ctypes.c_int), ("num_sms", ctypes.c_int), ("num_max_send_tokens", ctypes.c_int),
                ("num_max_recv_tokens", ctypes.c_int), ("rank_prefix_matrix", ctypes.c_void_p)]


class Outputs(ctypes.Structure):  # DispatchOutputs
    _fields_ = [(name, ctypes.c_void_p) for name in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                                                     "recv_src_idx", "source_num_tokens")]


class Args(ctypes.Structure):  # DispatchArgs
    _fields_ = [("x", ctypes.c_void_p), ("num_tokens", ctypes.c_int), ("row_bytes", ctypes.c_int),
                ("x_scales", ctypes.c_void_p), ("num_scales", ctypes.c_int), ("scale_stride_token", ctypes.c_int64),
                ("scale_stride_group", ctypes.c_int64), ("topk_idx", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p), ("num_topk", ctypes.c_int), ("num_experts", ctypes.c_int),
                ("is_token_in_rank", ctypes.c_void_p), ("rank_prefix_matrix", ctypes.c_void_p),
                ("num_recv_rows", ctypes.c_int), ("num_worst_tokens", ctypes.c_int), ("num_sms", ctypes.c_int),
                ("num_max_send_tokens", ctypes.c_int), ("num_max_recv_tokens", ctypes.c_int), ("out", Outputs)]


class CombineArgs(ctypes.Structure):  # CombineArgs
    _fields_ = [("x", ctypes.c_void_p), ("num_rows", ctypes.c_int), ("hidden", ctypes.c_int),
                ("topk_weights", ctypes.c_void_p), ("num_topk", ctypes.c_int), ("bias0", ctypes.c_void_p),
                ("bias1", ctypes.c_void_p), ("rank_prefix_matrix", ctypes.c_void_p),
                ("source_num_tokens", ctypes.c_void_p), ("recv_src_idx", ctypes.c_void_p),
                ("is_token_in_rank", ctypes.c_void_p), ("num_tokens", ctypes.c_int), ("num_sms", ctypes.c_int),
                ("num_max_send_tokens", ctypes.c_int), ("num_max_recv_tokens", ctypes.c_int),
                ("combined_x", ctypes.c_void_p), ("combined_topk_weights", ctypes.c_void_p),
                ("own_rows_begin", ctypes.c_int), ("num_own_rows", ctypes.c_int)]


class WaitedCounts(ctypes.Structure):  # WaitedCounts
    _fields_ = [("num_recv_tokens", ctypes.c_int), ("own_rows_begin", ctypes.c_int), ("num_own_rows", ctypes.c_int),
                ("num_local_experts", ctypes.c_int), ("per_expert", ctypes.POINTER(ctypes.c_int))]


ENTRY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.POINTER(Counts),
                            ctypes.POINTER(Args), ctypes.c_size_t)
COMBINE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.POINTER(CombineArgs),
                              ctypes.c_size_t)
COUNTS_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.POINTER(Counts),
                             ctypes.POINTER(WaitedCounts), ctypes.c_size_t)
DATA_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.POINTER(Args), ctypes.c_size_t)


class Entry(ctypes.Structure):  # IntranodeEntry
    _fields_ = [("entry_size", ctypes.c_uint32), ("args_size", ctypes.c_uint32), ("counts_size", ctypes.c_uint32),
                ("combine_size", ctypes.c_uint32), ("waited_size", ctypes.c_uint32),
                ("dispatch_known_rows", ENTRY_FN), ("combine", COMBINE_FN), ("dispatch_counts", COUNTS_FN),
                ("dispatch", DATA_FN)]


def sizes(**changes):
    """The four sizes of an entry, as this build's structs have them, with ``changes``."""
    return dict(dict(entry_size=ctypes.sizeof(Entry), args_size=ctypes.sizeof(Args),
                     counts_size=ctypes.sizeof(Counts), combine_size=ctypes.sizeof(CombineArgs),
                     waited_size=ctypes.sizeof(WaitedCounts)), **changes)


def capsule(entry, name=b"turnout._C.intranode_entry"):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name_buffer = ctypes.create_string_buffer(name)
    made = new(ctypes.addressof(entry), name_buffer, None)
    return made, name_buffer


def values(structure):
    return {name: getattr(structure, name) for name, _ in structure._fields_ if name != "out"}


class Recorder:
    """Keeps each call's arguments in ``calls`` (``op`` "dispatch",
    "combine", or a dispatch that waits for its counts: "counts" then
    "data"); with ``keep`` false it only counts them (for timing). A counts
    call answers ``num_recv`` rows, ``own_rows`` and per-expert counts 1, 2,
    ...; ``counts_code`` is its return, ``code`` every other's."""

    def __init__(self, keep: bool = True):
        self.calls, self.count, self.code, self.counts_code = [], 0, 0, 0
        self.num_recv, self.own_rows = 5, (1, 2)
        per_expert = {}  # by count: 1, 2, ..., made once

        def counts(native, config, counts, out, stream):
            self.count += 1
            got = out.contents
            if keep:
                self.calls.append(dict(op="counts", native=native, config=config, counts=values(counts.contents),
                                       num_local_experts=got.num_local_experts, stream=stream))
            if self.counts_code == 0:
                got.num_recv_tokens = self.num_recv
                got.own_rows_begin, got.num_own_rows = self.own_rows
                n = got.num_local_experts
                if n not in per_expert:
                    per_expert[n] = (ctypes.c_int * n)(*range(1, n + 1))
                ctypes.memmove(got.per_expert, per_expert[n], ctypes.sizeof(per_expert[n]))
            return self.counts_code

        def data(native, config, args, stream):
            self.count += 1
            if keep:
                self.calls.append(dict(op="data", native=native, config=config, args=values(args.contents),
                                       out=values(args.contents.out), stream=stream))
            return self.code

        def dispatch(native, config, counts, args, stream):
            self.count += 1
            if keep:
                self.calls.append(dict(op="dispatch", native=native, config=config, counts=values(counts.contents),
                                       args=values(args.contents), out=values(args.contents.out), stream=stream))
            return self.code

        def combine(native, config, args, stream):
            self.count += 1
            if keep:
                self.calls.append(dict(op="combine", native=native, config=config, args=values(args.contents),
                                       stream=stream))
            return self.code

        self.fns = ENTRY_FN(dispatch), COMBINE_FN(combine), COUNTS_FN(counts), DATA_FN(data)
        self.entry = Entry(**sizes(), **self.functions())

    def functions(self):
        return dict(dispatch_known_rows=self.fns[0], combine=self.fns[1], dispatch_counts=self.fns[2],
                    dispatch=self.fns[3])


def install(module, recorder):
    """Makes ``recorder`` the entry of ``module`` (turnout._torch_ext); returns
    what must stay alive while it is."""
    made, name = capsule(recorder.entry)
    module.set_intranode_entry(made)
    return made, name
