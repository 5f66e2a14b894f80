// Low-latency mode (turnout/low_latency.hpp). The Python layer keeps two
// output sets per call shape and builds a LowLatencyDispatchArgs for each
// once, holding its sizes and output addresses; a call then passes only what
// changes from call to call, positionally: each argument converted costs time
// on a path whose whole host budget is a few microseconds.
//
// A launch given an EventRing (an async_finish call) also records the ring's
// next event on its stream and returns it; given None it returns None. Both
// ops also go to turnout._torch_ext behind a capsule (low_latency_entry.hpp).
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>

#include <string>

#include "bindings.hpp"
#include "comm_events.hpp"
#include "low_latency_entry.hpp"

namespace turnout::bindings {

using namespace nb::literals;

namespace {

LowLatencyPhase to_phase(int phase, const char* op) {
  if (phase < static_cast<int>(LowLatencyPhase::kSendAndReceive) || phase > static_cast<int>(LowLatencyPhase::kReceive))
    throw InvalidArgument(std::string(op) + ": phase must be 0 (send and receive), 1 (send) or 2 (receive), got " +
                          std::to_string(phase));
  return static_cast<LowLatencyPhase>(phase);
}

nb::object recorded(EventRing* ring, uintptr_t s) {
  return ring ? ring->record(stream(s)) : nb::none();
}

// The fixed part of a dispatch: sizes, format and the output set it writes.
void dispatch_outputs(LowLatencyDispatchArgs* self, int hidden, int num_max_tokens, int num_experts, bool use_fp8,
                      bool use_ue8m0, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_packed_scales,
                      uintptr_t recv_count, uintptr_t src_info, uintptr_t layout_range, uintptr_t plan) {
  auto* a = new (self) LowLatencyDispatchArgs();
  a->hidden = hidden;
  a->num_max_tokens = num_max_tokens;
  a->num_experts = num_experts;
  a->use_fp8 = use_fp8;
  a->use_ue8m0 = use_ue8m0;
  a->recv_x = ptr<void>(recv_x);
  a->recv_scales = ptr<float>(recv_scales);
  a->recv_packed_scales = ptr<int32_t>(recv_packed_scales);
  a->recv_count = ptr<int32_t>(recv_count);
  a->src_info = ptr<int32_t>(src_info);
  a->layout_range = ptr<int64_t>(layout_range);
  a->plan = ptr<void>(plan);
}

// The output set's args with the fields that change from call to call taken
// from `call`. round_scale only matters with FP8 (the core pairs it with
// use_fp8).
LowLatencyDispatchArgs with_call(const LowLatencyDispatchArgs& outputs, const LowLatencyDispatchArgs& call) {
  LowLatencyDispatchArgs a = outputs;
  a.x = call.x;
  a.num_tokens = call.num_tokens;
  a.topk_idx = call.topk_idx;
  a.num_topk = call.num_topk;
  a.topk_weights = call.topk_weights;
  a.round_scale = call.round_scale && outputs.use_fp8;
  a.cumulative_local_expert_recv_stats = call.cumulative_local_expert_recv_stats;
  a.wait_recv_cost_stats = call.wait_recv_cost_stats;
  return a;
}

// A dispatch with its arguments in their struct: the binding's and the capsule's.
nb::object queue_dispatch(Buffer& b, const LowLatencyDispatchArgs& a, int phase, uintptr_t s, MaybeStream wait_for,
                          EventRing* ring) {
  const LowLatencyPhase p = to_phase(phase, "low_latency_dispatch");
  join_before(b, s, wait_for);
  b.low_latency_dispatch(a, p, stream(s));
  return recorded(ring, s);
}

nb::object low_latency_dispatch(Buffer& b, const LowLatencyDispatchArgs& outputs, uintptr_t x, int num_tokens,
                                uintptr_t topk_idx, int num_topk, uintptr_t topk_weights, bool round_scale,
                                uintptr_t cumulative_local_expert_recv_stats, uintptr_t wait_recv_cost_stats, int phase,
                                uintptr_t s, MaybeStream wait_for, EventRing* ring) {
  LowLatencyDispatchArgs call;
  call.x = ptr<const void>(x);
  call.num_tokens = num_tokens;
  call.topk_idx = ptr<const int64_t>(topk_idx);
  call.num_topk = num_topk;
  call.topk_weights = ptr<const float>(topk_weights);
  call.round_scale = round_scale;
  call.cumulative_local_expert_recv_stats = ptr<int32_t>(cumulative_local_expert_recv_stats);
  call.wait_recv_cost_stats = ptr<int64_t>(wait_recv_cost_stats);
  return queue_dispatch(b, with_call(outputs, call), phase, s, wait_for, ring);
}

// A combine with its arguments in their struct: the binding's and the capsule's.
nb::object queue_combine(Buffer& b, const LowLatencyCombineArgs& a, int phase, uintptr_t s, MaybeStream wait_for,
                         EventRing* ring) {
  const LowLatencyPhase p = to_phase(phase, "low_latency_combine");
  join_before(b, s, wait_for);
  b.low_latency_combine(a, p, stream(s));
  return recorded(ring, s);
}

nb::object low_latency_combine(Buffer& b, uintptr_t x, int num_tokens, int num_topk, int hidden, int num_max_tokens,
                               int num_experts, uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t plan,
                               bool use_logfmt, uintptr_t out, uintptr_t wait_recv_cost_stats, int phase, uintptr_t s,
                               MaybeStream wait_for, EventRing* ring) {
  LowLatencyCombineArgs a;
  a.x = ptr<const void>(x);
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.hidden = hidden;
  a.num_max_tokens = num_max_tokens;
  a.num_experts = num_experts;
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.topk_weights = ptr<const float>(topk_weights);
  a.plan = ptr<const void>(plan);
  a.use_logfmt = use_logfmt;
  a.out = ptr<void>(out);
  a.wait_recv_cost_stats = ptr<int64_t>(wait_recv_cost_stats);
  return queue_combine(b, a, phase, s, wait_for, ring);
}

// The capsule's functions (low_latency_entry.hpp): `queue(buffer, events)`
// runs where `native` and `ring` are of _C's types (else 1); a C++ exception
// becomes the Python error (-1).
template <typename Queue>
int run_entry(PyObject* native, PyObject* ring, PyObject** event, Queue queue) {
  if (!nb::isinstance<Buffer>(nb::handle(native))) return 1;
  EventRing* events = nullptr;
  if (ring != Py_None) {
    if (!nb::isinstance<EventRing>(nb::handle(ring))) return 1;
    events = nb::inst_ptr<EventRing>(nb::handle(ring));
  }
  try {
    *event = queue(*nb::inst_ptr<Buffer>(nb::handle(native)), events).release().ptr();
    return 0;
  } catch (...) {
    set_python_error(std::current_exception());
    return -1;
  }
}

MaybeStream maybe(const uintptr_t* wait_for) {
  return wait_for ? MaybeStream(*wait_for) : std::nullopt;
}

int entry_dispatch(PyObject* native, PyObject* outputs, const LowLatencyDispatchArgs* call, int phase, uintptr_t s,
                   const uintptr_t* wait_for, PyObject* ring, PyObject** event) {
  if (!nb::isinstance<LowLatencyDispatchArgs>(nb::handle(outputs))) return 1;
  const auto& set = *nb::inst_ptr<LowLatencyDispatchArgs>(nb::handle(outputs));
  return run_entry(native, ring, event, [&](Buffer& b, EventRing* events) {
    return queue_dispatch(b, with_call(set, *call), phase, s, maybe(wait_for), events);
  });
}

int entry_combine(PyObject* native, const LowLatencyCombineArgs* a, int phase, uintptr_t s, const uintptr_t* wait_for,
                  PyObject* ring, PyObject** event) {
  return run_entry(native, ring, event, [&](Buffer& b, EventRing* events) {
    return queue_combine(b, *a, phase, s, maybe(wait_for), events);
  });
}

const LowLatencyEntry kEntry = {sizeof(LowLatencyEntry), sizeof(LowLatencyDispatchArgs), sizeof(LowLatencyCombineArgs),
                                entry_dispatch, entry_combine};

void clean_low_latency_buffer(Buffer& b, uintptr_t s, MaybeStream wait_for, MaybeStream join_to, uint64_t first_call) {
  join_before(b, s, wait_for);
  b.clean_low_latency_buffer(stream(s), first_call);
  join_after(b, s, join_to);
}

// The size functions divide by the rank count and index fixed tables: what
// no call could use is refused before they see it.
void require_in(const char* fn, const char* arg, int value, int low, int high, int multiple_of = 1) {
  if (value >= low && value <= high && value % multiple_of == 0) return;
  std::string what = std::string(fn) + ": " + arg + " must be ";
  if (multiple_of > 1) what += "a multiple of " + std::to_string(multiple_of) + " ";
  throw InvalidArgument(what + "in [" + std::to_string(low) + ", " + std::to_string(high) + "], got " +
                        std::to_string(value));
}

size_t required_bytes(int num_max_tokens, int hidden, int num_ranks, int num_topk) {
  const char* fn = "low_latency_required_bytes";
  require_in(fn, "num_max_tokens", num_max_tokens, 1, kLowLatencyMaxTokens);
  require_in(fn, "hidden", hidden, 8, kLowLatencyMaxHidden, 8);
  require_in(fn, "num_ranks", num_ranks, 1, kLowLatencyMaxExperts);
  require_in(fn, "num_topk", num_topk, 1, kLowLatencyMaxTopk);
  return low_latency_required_bytes(num_max_tokens, hidden, num_ranks, num_topk);
}

nb::dict region_offsets(int num_max_tokens, int hidden, int num_ranks) {
  const char* fn = "low_latency_region_offsets";
  require_in(fn, "num_max_tokens", num_max_tokens, 1, kLowLatencyMaxTokens);
  require_in(fn, "hidden", hidden, 8, kLowLatencyMaxHidden, 8);
  require_in(fn, "num_ranks", num_ranks, 1, kLowLatencyMaxExperts);
  const LowLatencyRegionOffsets o = low_latency_region_offsets(num_max_tokens, hidden, num_ranks);
  nb::dict d;
  d["message_bytes"] = o.message_bytes;
  d["dispatch_slots"] = nb::make_tuple(o.dispatch_slots[0], o.dispatch_slots[1]);
  d["weights"] = nb::make_tuple(o.weights[0], o.weights[1]);
  return d;
}

size_t plan_bytes(int num_max_tokens, int num_ranks, int num_experts) {
  const char* fn = "low_latency_plan_bytes";
  require_in(fn, "num_max_tokens", num_max_tokens, 1, kLowLatencyMaxTokens);
  require_in(fn, "num_ranks", num_ranks, 1, kLowLatencyMaxExperts);
  require_in(fn, "num_experts", num_experts, num_ranks, kLowLatencyMaxExperts, num_ranks);
  return low_latency_plan_bytes(num_max_tokens, num_ranks, num_experts);
}

}  // namespace

void bind_low_latency(nb::module_& m, BufferClass& buffer) {
  m.attr("low_latency_max_topk") = kLowLatencyMaxTopk;
  m.attr("low_latency_max_tokens") = kLowLatencyMaxTokens;
  m.attr("low_latency_max_experts") = kLowLatencyMaxExperts;
  m.attr("low_latency_max_hidden") = kLowLatencyMaxHidden;
  m.attr("low_latency_scale_group") = kLowLatencyScaleGroup;
  // The phase goes over as an int: an enum argument costs a lookup per call.
  m.attr("LOW_LATENCY_SEND_AND_RECEIVE") = static_cast<int>(LowLatencyPhase::kSendAndReceive);
  m.attr("LOW_LATENCY_SEND") = static_cast<int>(LowLatencyPhase::kSend);
  m.attr("LOW_LATENCY_RECEIVE") = static_cast<int>(LowLatencyPhase::kReceive);
  m.def("low_latency_required_bytes", &required_bytes, "num_max_tokens"_a, "hidden"_a, "num_ranks"_a, "num_topk"_a);
  m.def("low_latency_plan_bytes", &plan_bytes, "num_max_tokens"_a, "num_ranks"_a, "num_experts"_a);
  m.def("low_latency_region_offsets", &region_offsets, "num_max_tokens"_a, "hidden"_a, "num_ranks"_a);

  nb::class_<LowLatencyDispatchArgs>(m, "LowLatencyDispatchArgs")
      .def("__init__", &dispatch_outputs, "hidden"_a, "num_max_tokens"_a, "num_experts"_a, "use_fp8"_a, "use_ue8m0"_a,
           "recv_x"_a, "recv_scales"_a, "recv_packed_scales"_a, "recv_count"_a, "src_info"_a, "layout_range"_a,
           "plan"_a)
      .def_ro("hidden", &LowLatencyDispatchArgs::hidden)
      .def_ro("num_max_tokens", &LowLatencyDispatchArgs::num_max_tokens)
      .def_ro("num_experts", &LowLatencyDispatchArgs::num_experts)
      .def_ro("use_fp8", &LowLatencyDispatchArgs::use_fp8)
      .def_ro("use_ue8m0", &LowLatencyDispatchArgs::use_ue8m0);

  buffer.attr("low_latency_entry") = nb::capsule(&kEntry, kLowLatencyEntryName);
  buffer.def_prop_ro("num_low_latency_bytes", &Buffer::num_low_latency_bytes)
      .def("low_latency_dispatch", &low_latency_dispatch, "outputs"_a, "x"_a, "num_tokens"_a, "topk_idx"_a,
           "num_topk"_a, "topk_weights"_a, "round_scale"_a, "cumulative_local_expert_recv_stats"_a,
           "wait_recv_cost_stats"_a, "phase"_a, "stream"_a, "wait_for"_a, "ring"_a.none())
      .def("low_latency_combine", &low_latency_combine, "x"_a, "num_tokens"_a, "num_topk"_a, "hidden"_a,
           "num_max_tokens"_a, "num_experts"_a, "topk_idx"_a, "topk_weights"_a, "plan"_a, "use_logfmt"_a, "out"_a,
           "wait_recv_cost_stats"_a, "phase"_a, "stream"_a, "wait_for"_a, "ring"_a.none())
      .def("clean_low_latency_buffer", &clean_low_latency_buffer, "stream"_a, "wait_for"_a, "join_to"_a,
           "first_call"_a = 1)
      .def("low_latency_call_numbers", &Buffer::low_latency_call_numbers);
}

}  // namespace turnout::bindings
