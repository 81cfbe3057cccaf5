// The P2P connector's one-link round trip, compiled: afd_common.transport.one_link says why and
// when it is used; the Python halves (afd_attention/afd_ffn p2p_connector.py) keep every other
// path and every error message.
//
// Each class does, on one Gloo link, what the Python one-link path does with PeerIO: a send and
// the receive of its answer posted back to back, sends kept alive until a reply proves them
// taken and waited on (bounded) just before the next blocking wait, receives bounded. The FFN
// half posts one receive more: the next step's first, before its plan (FFNLink). What
// it refuses (a call out of order, a tensor of another shape) it leaves to the Python path by
// returning None / false; what fails on the wire it raises as LinkError(kind, detail), which the
// Python side words (PeerIO.failure). Bound to its connector (``bind``), each class also answers
// the connector's per-layer primitives itself, calling the connector's own methods for what it
// refuses and its wording for what fails.

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/headeronly/version.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kMaxStages = 64;  // afd_common.metadata.MAX_STAGES: tags are layer * 64 + stage

// A failure on the wire: kind is "send" (posting a send), "post" (posting a receive), "wait" (a
// receive's wait) or "settle" (a send's wait); detail is the backend's message, without c10's
// backtrace (PeerIO.failure takes its first line, and looks for a timeout in all of it).
struct LinkError {
  std::string kind;
  std::string detail;
};

// LinkError's Python type (a RuntimeError), made once and never freed: nothing to tear down
// after the interpreter is gone.
PyObject* link_error_type = nullptr;

// Raise ``e`` in Python as that type, args (kind, detail): for the pybind methods (the module's
// exception translator) and the primitives' C entries alike.
void set_link_error(const LinkError& e) {
  py::tuple args = py::make_tuple(e.kind, e.detail);
  PyErr_SetObject(link_error_type, args.ptr());
}

// "current_s", interned once and never freed: the attribute of the connector's Timeouts read on
// every wait (the bound is the first step's until one ends, then the step timeout's).
PyObject* current_s_name = nullptr;

// The attributes begin_step reads of a StepMetadata and sets on its half, interned once.
struct Names {
  PyObject *half_step, *half_expect, *step, *kind, *stage_tokens, *half_posted, *half_plan,
      *half_sources, *half_kind, *half_ready, *half_compiled_step, *half_net, *half_post_first,
      *per_source;
} names{};

std::string message(const std::exception& e) {
  const auto* c10e = dynamic_cast<const c10::Error*>(&e);
  return c10e ? c10e->what_without_backtrace() : e.what();
}

// A negative ``timeout_s`` is an idle wait (the next step's plan): as long as the peer is there,
// as PeerIO's IDLE_WAIT.
std::chrono::milliseconds bound(double timeout_s) {
  if (timeout_s < 0) return std::chrono::hours(24 * 3650);
  return std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
}

// One link's sends, kept until known taken: PeerIO's bookkeeping for one peer. Locked: the
// serving thread settles them without the GIL while another thread may close the connector
// (flush); the waits themselves run unlocked.
class Sends {
 public:
  void keep(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor) {
    std::lock_guard<std::mutex> lock(mutex_);
    sends_.push_back({std::move(work), std::move(tensor)});
  }
  // Before waiting for a reply: the sends the previous reply proved taken are waited on, and this
  // reply will prove the rest. Called without the GIL.
  void settle_proved(double timeout_s) {
    size_t n;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      n = proved_;
      proved_ = 0;
    }
    settle(n, timeout_s);
    std::lock_guard<std::mutex> lock(mutex_);
    proved_ = sends_.size();
  }
  void reply_failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    proved_ = 0;
  }
  void settle_all(double timeout_s) {
    size_t n;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      proved_ = 0;
      n = sends_.size();
    }
    settle(n, timeout_s);
  }
  // A step's start: every send but the one just posted (the previous steps', which the peer
  // took long ago if it answered them) waited on, as PeerIO.settle_older does. Called without
  // the GIL.
  void settle_all_but_last(double timeout_s) {
    size_t n;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      n = sends_.empty() ? 0 : sends_.size() - 1;
      proved_ = proved_ > n ? proved_ - n : 0;
    }
    settle(n, timeout_s);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    sends_.clear();
    proved_ = 0;
  }

 private:
  struct Sent {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor tensor;
  };
  void settle(size_t n, double timeout_s) {
    for (; n > 0; --n) {
      Sent sent;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (sends_.empty()) return;
        sent = std::move(sends_.front());
        sends_.pop_front();
      }
      try {
        sent.work->wait(bound(timeout_s));
      } catch (const std::exception& e) {
        throw LinkError{"settle", message(e)};
      }
    }
  }
  std::mutex mutex_;
  std::deque<Sent> sends_;
  size_t proved_ = 0;
};

// Post a send or a receive of one tensor, without the GIL as torch's own bindings do.
// ``pg`` by value: a close on another thread cannot free the group under the call; one that
// came between two posts (each lets the GIL go) left none, which fails as a closed link.
c10::intrusive_ptr<c10d::Work> post(c10::intrusive_ptr<c10d::Backend> pg, bool send,
                                    const at::Tensor& t, int peer, int tag) {
  if (!pg) throw LinkError{send ? "send" : "post", "the link was closed"};
  std::vector<at::Tensor> v{t};  // with the GIL: ``t`` may be a member a close resets
  py::gil_scoped_release nogil;
  try {
    return send ? pg->send(v, peer, tag) : pg->recv(v, peer, tag);
  } catch (const std::exception& e) {
    throw LinkError{send ? "send" : "post", message(e)};
  }
}

// Wait for a reply without the GIL, its proved sends first.
void wait_reply(Sends& sends, c10d::Work& work, double timeout_s) {
  py::gil_scoped_release nogil;
  sends.settle_proved(timeout_s);
  try {
    work.wait(bound(timeout_s));
  } catch (const std::exception& e) {
    sends.reply_failed();
    throw LinkError{"wait", message(e)};
  }
}

std::vector<bool> layer_mask(const std::vector<int64_t>& moe_layers, int64_t num_layers) {
  std::vector<bool> moe(static_cast<size_t>(num_layers), false);
  for (auto l : moe_layers) {
    if (l >= 0 && l < num_layers) moe[static_cast<size_t>(l)] = true;
  }
  return moe;
}

// ``t[0]`` and ``t[1]`` of a tuple of at least ``size`` items, as ints: a LayerCall (layer,
// stage), a WorkItemMeta (layer, stage, ...). False for anything else (the Python path names it).
bool as_int(PyObject* x, int64_t& v) {
  if (!PyLong_CheckExact(x)) return false;
  int over = 0;
  v = PyLong_AsLongLongAndOverflow(x, &over);
  return !over;
}

bool first_two_ints(py::handle t, Py_ssize_t size, int64_t& a, int64_t& b) {
  PyObject* p = t.ptr();
  return PyTuple_Check(p) && PyTuple_GET_SIZE(p) >= size && as_int(PyTuple_GET_ITEM(p, 0), a) &&
         as_int(PyTuple_GET_ITEM(p, 1), b);
}

// One of the contract's NamedTuples made from its fields, as ``metadata.new_tuple`` makes it.
py::object new_tuple(const py::object& type, const py::tuple& fields) {
  py::tuple args = py::make_tuple(fields);
  PyObject* made = PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(type.ptr()), args.ptr(),
                                       nullptr);
  if (made == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(made);
}

// An instance of a frozen dataclass made from its fields without its ``__init__``, whose
// ``object.__setattr__`` per field runs a Python frame, cold at a step's start on the path of
// its first layer: allocated as ``object.__new__`` allocates and each field set as
// ``object.__setattr__`` sets it. Only for the contract's StepMetadata and StepPlan, whose
// ``__init__`` does nothing else (tests/test_one_link.py holds them to that).
py::object new_dataclass(const py::object& type,
                         std::initializer_list<std::pair<PyObject*, PyObject*>> fields) {
  auto* tp = reinterpret_cast<PyTypeObject*>(type.ptr());
  py::object made = py::reinterpret_steal<py::object>(tp->tp_alloc(tp, 0));
  if (!made) throw py::error_already_set();
  for (const auto& [name, value] : fields) {
    if (PyObject_GenericSetAttr(made.ptr(), name, value) < 0) throw py::error_already_set();
  }
  return made;
}

// The connector's wait bound now (its Timeouts' current_s).
double current_timeout(const py::object& timeouts) {
  py::object s = py::reinterpret_steal<py::object>(PyObject_GetAttr(timeouts.ptr(),
                                                                    current_s_name));
  if (!s) throw py::error_already_set();
  double v = PyFloat_AsDouble(s.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Raise the connector's error for a failure on the wire: ``failure(LinkError(kind, detail),
// *where)`` words it as the Python path does, raised as it raises it (``from None``).
template <typename... Where>
[[noreturn]] void raise_failure(const py::object& failure, const LinkError& e, Where&&... where) {
  py::object err = py::handle(link_error_type)(e.kind, e.detail);
  py::object exc = failure(err, std::forward<Where>(where)...);
  PyException_SetCause(exc.ptr(), nullptr);  // no cause, and the context suppressed
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// The link's connector let go of it (closed) while, or before, one of its methods ran here.
[[noreturn]] void closed() {
  throw std::runtime_error("the connector this compiled link served is closed");
}

// The STEP frame of afd_common.transport.codec (encode_step_into, decode_step), little endian:
// header (magic, version, frame kind, payload length), then step (q), step kind (B), stages (H),
// the stage tokens (q each), zeros to the frame's end. The constants come from the codec
// (``bind``); tests/test_one_link.py holds both directions to the codec's bytes.
struct StepFrame {
  static constexpr int64_t kHead = 8 + 8 + 1 + 2;
  static constexpr int64_t kBytes = kHead + 8 * kMaxStages;
  std::string magic;
  int version = 0, kind = 0;
  int64_t max_tokens = 0;  // a stage's count must be below it

  void set(const std::string& magic_, int version_, int kind_, int64_t frame_bytes,
           int64_t max_tokens_) {
    TORCH_CHECK(magic_.size() == 2 && frame_bytes == kBytes, "a STEP frame of ", frame_bytes,
                " bytes: this module lays out ", kBytes);
    magic = magic_;
    version = version_;
    kind = kind_;
    max_tokens = max_tokens_;
  }
  void encode(uint8_t* b, int64_t step, int64_t step_kind, const int64_t* tokens,
              int64_t n) const {
    b[0] = static_cast<uint8_t>(magic[0]);
    b[1] = static_cast<uint8_t>(magic[1]);
    b[2] = static_cast<uint8_t>(version);
    b[3] = static_cast<uint8_t>(kind);
    put(b + 4, static_cast<uint64_t>(11 + 8 * n), 4);
    put(b + 8, static_cast<uint64_t>(step), 8);
    b[16] = static_cast<uint8_t>(step_kind);
    put(b + 17, static_cast<uint64_t>(n), 2);
    for (int64_t i = 0; i < n; ++i) put(b + kHead + 8 * i, static_cast<uint64_t>(tokens[i]), 8);
    std::memset(b + kHead + 8 * n, 0, static_cast<size_t>(kBytes - kHead - 8 * n));
  }
  // False for anything but a well-formed frame (the codec's decoder then names what is wrong).
  bool decode(const uint8_t* b, int64_t& step, int64_t& step_kind, int64_t* tokens,
              int64_t& n) const {
    if (b[0] != static_cast<uint8_t>(magic[0]) || b[1] != static_cast<uint8_t>(magic[1]) ||
        b[2] != version || b[3] != kind)
      return false;
    step = static_cast<int64_t>(get(b + 8, 8));
    step_kind = b[16];
    n = static_cast<int64_t>(get(b + 17, 2));
    if (step < 0 || n < 1 || n > kMaxStages || get(b + 4, 4) != static_cast<uint64_t>(11 + 8 * n))
      return false;
    for (int64_t i = 0; i < n; ++i) {
      tokens[i] = static_cast<int64_t>(get(b + kHead + 8 * i, 8));
      if (tokens[i] < 0 || tokens[i] >= max_tokens) return false;
    }
    return true;
  }

 private:
  static void put(uint8_t* at, uint64_t v, int size) {
    for (int i = 0; i < size; ++i) at[i] = static_cast<uint8_t>(v >> (8 * i));
  }
  static uint64_t get(const uint8_t* at, int size) {
    uint64_t v = 0;
    for (int i = 0; i < size; ++i) v |= static_cast<uint64_t>(at[i]) << (8 * i);
    return v;
  }
};

// What both halves hold: the group, the peer, the rows' dtype and width, the sends to settle.
class Link {
 public:
  Link(c10::intrusive_ptr<c10d::Backend> pg, int peer, at::ScalarType dtype, int64_t hidden)
      : pg_(std::move(pg)), peer_(peer), dtype_(dtype), hidden_(hidden) {}

  // Wait (bounded) until the peer took every send (closing).
  void flush(double timeout_s) {
    py::gil_scoped_release nogil;
    sends_.settle_all(timeout_s);
  }

  // Bound to its connector, whose per-layer primitives the link then answers itself, with no
  // Python frame on a layer's path (afd_common.transport.one_link.serve): the connector's
  // Timeouts, how it words a failure on the wire, and its own methods for those primitives (in
  // one_link.PRIMITIVES order), which take every call refused here. Each half binds the rest
  // it needs with ``bind``.
  // The connector's own method for primitive ``method`` (refused once it closed).
  py::object python_method(size_t method) const { return bound_for(method).python; }

  void bind_connector(py::object timeouts, py::object failure, py::args python) {
    timeouts_ = std::move(timeouts);
    failure_ = std::move(failure);
    python_.clear();
    for (auto method : python) python_.push_back(py::reinterpret_borrow<py::object>(method));
  }

 protected:
  // What an answering method needs of its connector, taken when it starts: a close on another
  // thread (while this one waits without the GIL) lets go of the link's own references.
  struct Bound {
    py::object timeouts, failure, python;
  };
  Bound bound_for(size_t method) const {
    if (method >= python_.size()) closed();
    return {timeouts_, failure_, python_[method]};
  }

  // The connector closed: let go of the group, the sends and the connector (it and this link
  // hold each other while bound, which only this parts); every call is refused from now on.
  void release() {
    pg_.reset();
    sends_.clear();
    timeouts_ = failure_ = step_type_ = plan_failure_ = py::object();
    python_.clear();
    for (auto& f : plans_) f = PlanFrame{};
    control_tag_ = -1;
  }

  // The plans are this link's (each half's ``bind``): the control plane's tag, where its frames
  // share this link's group and go between this link's two ranks only (else -1: the connector's
  // control plane carries every plan), the contract's StepMetadata, how the half words a
  // failure on the way of a plan, and the STEP frame's constants (codec.STEP_FRAME).
  void bind_plans(int control_tag, py::object step_type, py::object plan_failure,
                  const std::string& magic, int version, int frame_kind, int64_t frame_bytes,
                  int64_t max_tokens) {
    control_tag_ = control_tag;
    step_type_ = std::move(step_type);
    plan_failure_ = std::move(plan_failure);
    frame_.set(magic, version, frame_kind, frame_bytes, max_tokens);
    for (auto& f : plans_) f = PlanFrame{at::zeros({frame_bytes}, at::kByte), nullptr};
  }

  c10::intrusive_ptr<c10d::Backend> pg_;
  int peer_;
  at::ScalarType dtype_;
  int64_t hidden_;
  Sends sends_;
  py::object timeouts_, failure_;
  std::vector<py::object> python_;  // the connector's own methods (bind_connector)
  // The plans (bind_plans): two frames taken in turn, each with its last send or receive.
  int control_tag_ = -1;
  py::object step_type_, plan_failure_;
  StepFrame frame_;
  struct PlanFrame {
    at::Tensor bytes;
    c10::intrusive_ptr<c10d::Work> work;
  };
  PlanFrame plans_[2];
  int plan_turn_ = 0;
};

// The attention half: every row of the rank to one FFN rank, which computes the routing.
class AttentionLink : public Link {
 public:
  AttentionLink(c10::intrusive_ptr<c10d::Backend> pg, int dst, at::ScalarType dtype,
                int64_t hidden, const std::vector<int64_t>& moe_layers, int64_t num_layers)
      : Link(std::move(pg), dst, dtype, hidden), moe_(layer_mask(moe_layers, num_layers)),
        slots_(static_cast<size_t>(num_layers * kMaxStages)) {}

  // The step's rows per stage; nothing of the previous step is in flight (checked by the caller).
  void begin(std::vector<int64_t> stage_rows) { rows_ = std::move(stage_rows); }

  // Send and post its answer's receive, or false where the Python path must take the call.
  bool send(const at::Tensor& h, int64_t layer, int64_t stage) {
    if (!pg_ || layer < 0 || layer >= static_cast<int64_t>(moe_.size()) || !moe_[layer] ||
        stage < 0 || stage >= static_cast<int64_t>(rows_.size()) || stage >= kMaxStages)
      return false;
    Slot& slot = slots_[layer * kMaxStages + stage];
    if (slot.work || h.scalar_type() != dtype_ || h.dim() != 2 || h.size(0) != rows_[stage] ||
        h.size(0) == 0 || h.size(1) != hidden_ || !h.is_contiguous() || !h.is_cpu())
      return false;
    at::Tensor out = spare_.defined() && spare_.sizes() == h.sizes() ? spare_ : at::empty_like(h);
    spare_ = at::Tensor();
    int tag = static_cast<int>(layer * kMaxStages + stage);
    // The receive after the send, at every layer. A step's first rows once posted their answer's
    // receive first (the FFN side then woke for the plan, and a thread descheduled between the
    // send and the post left the answer without a receive, held back for a notification round
    // trip); with the FFN's step start compiled that order measured no better: steps
    // alternating between the two within one run were up to 5% longer with it at 1 and 16
    // tokens, 9 of 10 comparisons (five runs; the tenth 0.4% shorter).
    sends_.keep(post(pg_, true, h, peer_, tag), h);
    slot.work = post(pg_, false, out, peer_, tag);
    slot.out = std::move(out);
    ++in_flight_;
    rows_sent_ += h.size(0);
    return true;
  }

  // The result of a call ``send`` took, or None where it took no such call.
  py::object recv(int64_t layer, int64_t stage, double timeout_s) {
    if (layer < 0 || layer >= static_cast<int64_t>(moe_.size()) || stage < 0 ||
        stage >= kMaxStages)
      return py::none();
    Slot& slot = slots_[layer * kMaxStages + stage];
    if (!slot.work) return py::none();
    auto work = std::move(slot.work);
    at::Tensor out = std::move(slot.out);
    --in_flight_;
    // The next call's result tensor, and this one's Python object, while it is awaited.
    spare_ = at::empty_like(out);
    py::object result = py::cast(out);
    wait_reply(sends_, *work, timeout_s);
    return result;
  }

  std::vector<std::pair<int64_t, int64_t>> in_flight() const {
    std::vector<std::pair<int64_t, int64_t>> calls;
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].work) calls.emplace_back(i / kMaxStages, i % kMaxStages);
    }
    return calls;
  }
  int64_t num_in_flight() const { return in_flight_; }
  bool holds(int64_t layer, int64_t stage) const {
    return layer >= 0 && layer < static_cast<int64_t>(moe_.size()) && stage >= 0 &&
           stage < kMaxStages && slots_[layer * kMaxStages + stage].work;
  }

  // The step is over: rows sent in it (metrics), the spare let go.
  int64_t end_step() {
    spare_ = at::Tensor();
    int64_t rows = rows_sent_;
    rows_sent_ = 0;
    return rows;
  }

  // Forget every call in flight (the connector closes).
  void drop() {
    for (auto& slot : slots_) slot = Slot{};
    in_flight_ = 0;
    spare_ = at::Tensor();
    pending_type_ = inflight_ = py::object();
    release();
  }

  // What this half needs besides (bind_connector): PendingResult, and the connector's calls in
  // flight on its Python path; for ``begin_step``, the most tokens a step may bring
  // (max_num_tokens) and the plans' (bind_plans; -1: the Python method sends every plan).
  void bind(py::object pending_type, py::object inflight, int64_t max_tokens, int control_tag,
            py::object step_type, py::object plan_failure, std::string magic, int version,
            int frame_kind, int64_t frame_bytes, int64_t frame_max_tokens) {
    pending_type_ = std::move(pending_type);
    inflight_ = std::move(inflight);
    max_tokens_ = max_tokens;
    bind_plans(control_tag, std::move(step_type), std::move(plan_failure), magic, version,
               frame_kind, frame_bytes, frame_max_tokens);
  }

  // ``begin_step``: the step's plan encoded into one of two frames and sent, before anything
  // else (the peer's first rows wait for it), then the older sends settled, as the control
  // plane does (afd_common.transport.control_plane); or the Python method, which names what is
  // wrong, for anything else (a call still in flight, a plan above max_num_tokens, a plan the
  // control plane sends on another group).
  static py::object begin_step(AttentionLink& link, py::handle, const py::handle* args) {
    py::handle meta = args[0];
    Bound bound = link.bound_for(2);
    int64_t step, kind, tokens[kMaxStages];
    Py_ssize_t n = 0;
    if (link.control_tag_ >= 0 && link.pg_ && link.in_flight_ == 0 &&
        PyMethod_Check(bound.python.ptr()) &&
        PySet_GET_SIZE(link.inflight_.ptr()) == 0 &&
        Py_TYPE(meta.ptr()) == reinterpret_cast<PyTypeObject*>(link.step_type_.ptr()) &&
        link.read_plan(meta, step, kind, tokens, n)) {
      PyObject* half = PyMethod_GET_SELF(bound.python.ptr());
      // A close begun on another thread (its goodbye may be on the wire): the class's method
      // says so.
      py::object net = py::reinterpret_steal<py::object>(PyObject_GetAttr(half, names.half_net));
      if (!net) throw py::error_already_set();
      if (net.is_none()) return bound.python(meta);
      // The step's before its plan goes: a failure after that must not leave the last one's.
      if (PyObject_SetAttr(half, names.half_step, meta.ptr()) < 0 ||
          PyObject_SetAttr(half, names.half_expect, Py_None) < 0)
        throw py::error_already_set();
      double timeout_s = current_timeout(bound.timeouts);
      py::object failure = link.plan_failure_;
      try {
        link.send_plan(step, kind, tokens, n, timeout_s);
      } catch (const LinkError& e) {
        raise_failure(failure, e);
      }
      link.rows_.assign(tokens, tokens + n);
      return py::none();
    }
    return bound.python(meta);
  }

  // ``send_attn_output``: a PendingResult whose state is this link, or the Python method's
  // answer (a call sent by the Python path already, routing from the attention side, anything
  // ``send`` refuses).
  static py::object send_attn_output(AttentionLink& link, py::handle self,
                                     const py::handle* args) {
    py::handle hidden = args[0], call = args[1], topk_ids = args[2], topk_weights = args[3];
    Bound bound = link.bound_for(0);
    py::object pending_type = link.pending_type_;
    int64_t layer, stage;
    if (topk_ids.is_none() && THPVariable_Check(hidden.ptr()) &&
        first_two_ints(call, 2, layer, stage) && PyTuple_GET_SIZE(call.ptr()) == 2 &&
        !link.sent_by_python(call)) {
      bool took;
      try {
        took = link.send(THPVariable_Unpack(hidden.ptr()), layer, stage);
      } catch (const LinkError& e) {
        raise_failure(bound.failure, e, call);
      }
      if (took) return new_tuple(pending_type, py::make_tuple(call, self));
    }
    return bound.python(hidden, call, topk_ids, topk_weights);
  }

  // ``recv_ffn_output``: the result of a call this link took, or the Python method's answer.
  static py::object recv_ffn_output(AttentionLink& link, py::handle self,
                                    const py::handle* args) {
    py::handle pending = args[0];
    Bound bound = link.bound_for(1);
    PyObject* p = pending.ptr();
    int64_t layer, stage;
    if (PyTuple_Check(p) && PyTuple_GET_SIZE(p) == 2 && PyTuple_GET_ITEM(p, 1) == self.ptr()) {
      py::handle call = PyTuple_GET_ITEM(p, 0);
      if (first_two_ints(call, 2, layer, stage)) {
        py::object out;
        try {
          out = link.recv(layer, stage, current_timeout(bound.timeouts));
        } catch (const LinkError& e) {
          raise_failure(bound.failure, e, call);
        }
        if (!out.is_none()) return out;
      }
    }
    return bound.python(pending);
  }

 private:
  bool sent_by_python(py::handle call) const {
    PyObject* s = inflight_.ptr();
    if (PySet_GET_SIZE(s) == 0) return false;
    int in = PySet_Contains(s, call.ptr());
    if (in < 0) PyErr_Clear();  // unhashable: the Python path names it
    return in != 0;
  }

  // A plan's step, kind and stage tokens, read from a StepMetadata: false unless each is an int
  // the wire can carry and the tokens are 1 to kMaxStages counts within max_num_tokens in all.
  bool read_plan(py::handle meta, int64_t& step, int64_t& kind, int64_t* tokens,
                 Py_ssize_t& n) const {
    py::object s = py::reinterpret_steal<py::object>(PyObject_GetAttr(meta.ptr(), names.step));
    py::object k = py::reinterpret_steal<py::object>(PyObject_GetAttr(meta.ptr(), names.kind));
    py::object t = py::reinterpret_steal<py::object>(
        PyObject_GetAttr(meta.ptr(), names.stage_tokens));
    if (!s || !k || !t) {
      PyErr_Clear();
      return false;
    }
    int over = 0;
    if (!as_int(s.ptr(), step) || step < 0 || !PyLong_Check(k.ptr())) return false;
    kind = PyLong_AsLongLongAndOverflow(k.ptr(), &over);
    if (over || kind < 0 || kind > 255 || !PyTuple_CheckExact(t.ptr())) return false;
    n = PyTuple_GET_SIZE(t.ptr());
    if (n < 1 || n > kMaxStages) return false;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!as_int(PyTuple_GET_ITEM(t.ptr(), i), tokens[i]) || tokens[i] < 0 ||
          tokens[i] > max_tokens_)
        return false;
      total += tokens[i];
    }
    return total <= max_tokens_;
  }

  void send_plan(int64_t step, int64_t kind, const int64_t* tokens, Py_ssize_t n,
                 double timeout_s) {
    PlanFrame& f = plans_[plan_turn_];
    if (f.work && !f.work->isCompleted()) {
      // A failure left its send unsettled (the peer may still read it): a new frame; the old
      // one stays with its send in sends_ until that settles or the link closes.
      f.bytes = at::zeros_like(f.bytes);
    }
    frame_.encode(f.bytes.data_ptr<uint8_t>(), step, kind, tokens, n);
    f.work = post(pg_, true, f.bytes, peer_, control_tag_);
    sends_.keep(f.work, f.bytes);
    plan_turn_ ^= 1;
    py::gil_scoped_release nogil;
    sends_.settle_all_but_last(timeout_s);
  }

  py::object pending_type_, inflight_;
  int64_t max_tokens_ = 0;

  struct Slot {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor out;
  };
  std::vector<bool> moe_;
  std::vector<int64_t> rows_;
  std::vector<Slot> slots_;  // by layer * kMaxStages + stage
  int64_t in_flight_ = 0;
  int64_t rows_sent_ = 0;
  at::Tensor spare_;
};

// The FFN half: one attention rank's rows in every stage of the step, the routing computed here.
// The step is served in order (MoE layers ascending, each layer's stages ascending); each
// (layer, stage)'s receive is posted with the previous result's send (or as the empty item before
// it is handed out), and the next step's first one with the step's last send (``post_ahead``). A
// stage without rows has no message either way (the attention half sends none): its item is
// empty, and nothing is posted or sent for it.
class FFNLink : public Link {
 public:
  FFNLink(c10::intrusive_ptr<c10d::Backend> pg, int src, at::ScalarType dtype, int64_t hidden,
          std::vector<int64_t> moe_layers, int64_t max_rows)
      : Link(std::move(pg), src, dtype, hidden), layers_(std::move(moe_layers)),
        max_rows_(max_rows), empty_(at::empty({0, hidden}, at::TensorOptions().dtype(dtype))) {}

  // Take the step: post its first receive (or find it posted ahead). False where this link cannot
  // (closed, no MoE layer, no stage or more than the tags lay out): the Python path serves it.
  // ``step``, ``kind`` and ``sources`` (per stage, the attention ranks and rows) go into the
  // step's work items.
  bool begin(std::vector<int64_t> stage_rows, int64_t step, py::object kind, py::list sources) {
    state_ = State::kIdle;
    serving_ = frame_due_ = false;
    if (!pg_ || layers_.empty() || stage_rows.empty() ||
        static_cast<int64_t>(stage_rows.size()) > kMaxStages ||
        static_cast<size_t>(PyList_GET_SIZE(sources.ptr())) != stage_rows.size())
      return false;
    for (auto n : stage_rows) {
      // The Python side refused a plan above max_num_tokens before this (contract._on_step):
      // a row count outside [0, max_rows] here is a caller's bug, not a peer's word.
      TORCH_CHECK(n >= 0 && n <= max_rows_, "stage rows ", n, " outside [0, ", max_rows_, "]");
    }
    rows_ = std::move(stage_rows);
    if (rings_.size() < rows_.size()) rings_.resize(rows_.size());
    layer_pos_ = 0;
    stage_ = 0;
    empty_at_ = kNowhere;
    post_current();
    state_ = State::kPosted;
    step_ = step;
    kind_ = std::move(kind);
    sources_ = std::move(sources);
    serving_ = true;
    frame_due_ = control_tag_ < 0;  // the control plane's plans; this link's, recv_step posts
    return true;
  }

  // The rows of (layer, stage), or None unless that is the receive posted next.
  py::object recv(int64_t stage, int64_t layer, double timeout_s) {
    py::object rows = take(stage, layer);
    if (!rows.is_none()) await_rows(timeout_s);
    return rows;
  }

  // Send the result of the item ``recv`` returned last and post the next receive; false where the
  // Python path must check the call (another item, a result of the wrong shape or dtype).
  bool send(const at::Tensor& output, int64_t stage, int64_t layer) {
    if (output.scalar_type() != dtype_ || output.dim() != 2 || output.size(1) != hidden_ ||
        !output.is_cpu())
      return false;
    if (empty_at_ == std::make_pair(layer, stage) && output.size(0) == 0) {
      // The answer of the last empty item handed out, whenever it comes: nothing to send.
      empty_at_ = kNowhere;
      sent();
      return true;
    }
    if (state_ != State::kServing || layer != layers_[layer_pos_] || stage != stage_ ||
        output.size(0) != rows_[stage])
      return false;
    at::Tensor out = output.is_contiguous() ? output : output.contiguous();
    state_ = State::kIdle;  // until the next receive is posted
    sends_.keep(post(pg_, true, out, peer_, tag()), out);
    post_next();
    sent();
    return true;
  }

  // (layer, stage) the step expects next, or None when this link serves no step now.
  py::object expected() const {
    if (state_ == State::kIdle) return py::none();
    return py::make_tuple(layers_[layer_pos_], stage_, state_ == State::kServing);
  }

  // Forget the step and the receive posted ahead (the connector closes or leaves it).
  void drop() {
    work_.reset();
    ahead_.reset();
    state_ = State::kIdle;
    serving_ = frame_due_ = false;
    item_type_ = meta_type_ = after_first_send_ = kind_ = py::object();
    plan_type_ = source_ = take_plan_ = py::object();
    kinds_ = py::dict();
    posted_plans_.clear();
    sources_ = py::list();
    release();
  }

  // What this half needs besides (bind_connector): the work items' types, and what the
  // connector does after a step's first answer (its control plane posts the receive of the next
  // steps' plans, where they are not this link's); for
  // ``recv_step``, the plans' (bind_plans; -1: the connector's control plane receives every
  // plan), then the contract's StepPlan, StepKind's members by value and STOP's, the local rank
  // of the attention rank at the other end, and what the connector does with a frame this link
  // does not take (a STOP, a plan to refuse).
  void bind(py::object item_type, py::object meta_type, py::object after_first_send,
            int control_tag, py::object step_type, py::object plan_failure, std::string magic,
            int version, int frame_kind, int64_t frame_bytes, int64_t frame_max_tokens,
            py::object plan_type, py::dict kinds, int64_t stop_kind, int64_t source,
            py::object take_plan) {
    item_type_ = std::move(item_type);
    meta_type_ = std::move(meta_type);
    after_first_send_ = std::move(after_first_send);
    bind_plans(control_tag, std::move(step_type), std::move(plan_failure), magic, version,
               frame_kind, frame_bytes, frame_max_tokens);
    plan_type_ = std::move(plan_type);
    kinds_ = std::move(kinds);
    stop_kind_ = stop_kind;
    source_ = py::int_(source);
    take_plan_ = std::move(take_plan);
    posted_plans_.clear();
  }

  // The receives of the next two plans, posted (those of the step before were decoded): by
  // recv_step, as the FFN goes idle after a step, so that the next plan's is posted the whole
  // step long (a frame right behind it -- a goodbye just after a plan -- waits for that).
  // Posted at the step's first answer instead, it held up the second layer (the FFN's main
  // thread busy with the notification as the next rows came): in blocks of four steps
  // alternating between the two within one run of benchmarks/transport.py's loops (the three
  // after each switch; the posting carries from step to step), 0.1-7% shorter this way at 1
  // token, at 16 -2.6..+0.7% (three runs).
  void post_plans() {
    // Checked on every pass: each post lets another thread in, whose close may drop the link.
    while (control_tag_ >= 0 && pg_ && posted_plans_.size() < 2) {
      int slot = posted_plans_.empty() ? plan_turn_ : 1 - posted_plans_.back();
      auto work = post(pg_, false, plans_[slot].bytes, peer_, control_tag_);
      if (!pg_) return;
      plans_[slot].work = std::move(work);
      posted_plans_.push_back(slot);
    }
  }
  int64_t num_plans_posted() const { return static_cast<int64_t>(posted_plans_.size()); }

  // ``recv_step``: the next plan, received (an idle wait), decoded and begun here (the step's
  // first receive posted or found posted ahead), as the connector's recv_step would; a frame
  // this link does not take goes to the connector's ``take_plan``, which decodes, checks and
  // begins it or names what is wrong. The Python method answers where the plans are not this
  // link's, or a step is left unserved (it names that).
  static py::object recv_step(FFNLink& link, py::handle, const py::handle*) {
    Bound bound = link.bound_for(2);
    if (link.control_tag_ < 0 || link.state_ != State::kIdle || !PyMethod_Check(bound.python.ptr()))
      return bound.python();
    PyObject* half = PyMethod_GET_SELF(bound.python.ptr());
    py::object half_posted = py::reinterpret_steal<py::object>(
        PyObject_GetAttr(half, names.half_posted));
    if (!half_posted) throw py::error_already_set();
    if (!half_posted.is_none()) return bound.python();
    // What follows the wait, taken before it (a close on another thread lets go of it).
    py::object plan_failure = link.plan_failure_, take_plan = link.take_plan_;
    py::object step_type = link.step_type_, plan_type = link.plan_type_, source = link.source_;
    py::dict kinds = link.kinds_;
    int64_t stop_kind = link.stop_kind_;
    at::Tensor frame;
    try {
      link.post_plans();
      if (!link.pg_ || link.posted_plans_.empty()) closed();
      int slot = link.posted_plans_.front();
      link.posted_plans_.pop_front();
      link.plan_turn_ = 1 - slot;
      auto work = std::move(link.plans_[slot].work);
      frame = link.plans_[slot].bytes;
      wait_reply(link.sends_, *work, -1.0);
    } catch (const LinkError& e) {
      raise_failure(plan_failure, e);
    }
    // Closed meanwhile (the frame may be the peer's goodbye): an AFD error, as for a wait the
    // close ended.
    if (!link.pg_) raise_failure(plan_failure, LinkError{"wait", "closed while it waited"});
    int64_t step, kind, tokens[kMaxStages], n, total = 0;
    bool took = link.frame_.decode(frame.data_ptr<uint8_t>(), step, kind, tokens, n) &&
                kind != stop_kind;
    py::object kind_obj;
    if (took) {
      PyObject* k = PyDict_GetItem(kinds.ptr(), py::int_(kind).ptr());  // borrowed
      took = k != nullptr;
      if (took) kind_obj = py::reinterpret_borrow<py::object>(k);
    }
    for (int64_t i = 0; took && i < n; ++i) total += tokens[i];
    if (!took || total > link.max_rows_) return take_plan(frame);
    py::tuple stage_tokens(n);
    py::list sources(n);
    for (int64_t i = 0; i < n; ++i) {
      py::int_ rows(tokens[i]);
      stage_tokens[i] = rows;
      sources[i] = py::make_tuple(py::make_tuple(source, rows));
    }
    py::int_ step_obj(step);
    py::object meta = new_dataclass(step_type, {{names.step, step_obj.ptr()},
                                                {names.kind, kind_obj.ptr()},
                                                {names.stage_tokens, stage_tokens.ptr()}});
    py::dict per_source;
    per_source[source] = meta;
    py::object plan = new_dataclass(plan_type, {{names.step, step_obj.ptr()},
                                                {names.per_source, per_source.ptr()}});
    if (PyObject_SetAttr(half, names.half_plan, plan.ptr()) < 0 ||
        PyObject_SetAttr(half, names.half_sources, sources.ptr()) < 0 ||
        PyObject_SetAttr(half, names.half_compiled_step, Py_False) < 0)  // unless it begins
      throw py::error_already_set();
    bool began;
    try {
      began = link.begin(std::vector<int64_t>(tokens, tokens + n), step, kind_obj, sources);
    } catch (const LinkError& e) {
      raise_failure(plan_failure, e, link.layers_.empty() ? 0 : link.layers_[0], 0);
    }
    if (!began) {  // the Python path serves the step
      py::object post_first = py::reinterpret_steal<py::object>(
          PyObject_GetAttr(half, names.half_post_first));
      if (!post_first) throw py::error_already_set();
      post_first();
      return plan;
    }
    if (PyObject_SetAttr(half, names.half_kind, kind_obj.ptr()) < 0 ||
        PyObject_SetAttr(half, names.half_ready, Py_None) < 0 ||
        PyObject_SetAttr(half, names.half_compiled_step, Py_True) < 0)
      throw py::error_already_set();
    return plan;
  }

  // ``recv_layer``: the WorkItem of the (layer, stage) posted next, or the Python method's answer
  // (a step this link does not serve, a call out of order, more rows than max_num_tokens).
  static py::object recv_layer(FFNLink& link, py::handle, const py::handle* args) {
    return link.layer_item(args[0], args[1], args[2]);
  }
  py::object layer_item(py::handle stage_idx, py::handle layer_idx, py::handle max_num_tokens) {
    Bound bound = bound_for(0);
    int64_t layer, stage;
    if (serving_ && as_int(layer_idx.ptr(), layer) && as_int(stage_idx.ptr(), stage) &&
        within(max_num_tokens, stage)) {
      double timeout_s = current_timeout(bound.timeouts);
      try {
        py::object hidden = take(stage, layer);
        if (!hidden.is_none()) {
          // The item before the wait (made after it, it delayed the answer; and a close on
          // another thread lets go of what it is made of).
          py::object item = new_tuple(item_type_, py::make_tuple(
              hidden,
              new_tuple(meta_type_, py::make_tuple(
                  layer, stage, step_, py::handle(PyList_GET_ITEM(sources_.ptr(), stage)),
                  false, kind_)),
              py::none(), py::none(), py::none()));
          await_rows(timeout_s);
          return item;
        }
      } catch (const LinkError& e) {
        raise_failure(bound.failure, e, layer, stage);
      }
    }
    return bound.python(stage_idx, layer_idx, max_num_tokens);
  }

  // ``send_ffn_output``: the result of the item served, or the Python method for anything else.
  static py::object send_ffn_output(FFNLink& link, py::handle, const py::handle* args) {
    link.answer(args[0], args[1]);
    return py::none();
  }
  void answer(py::handle output, py::handle item) {
    Bound bound = bound_for(1);
    int64_t layer, stage;
    PyObject* it = item.ptr();
    if (serving_ && THPVariable_Check(output.ptr()) && PyTuple_Check(it) &&
        PyTuple_GET_SIZE(it) >= 2 && first_two_ints(PyTuple_GET_ITEM(it, 1), 2, layer, stage)) {
      bool took;
      try {
        took = send(THPVariable_Unpack(output.ptr()), stage, layer);
      } catch (const LinkError& e) {
        raise_failure(bound.failure, e, layer, stage);
      }
      if (took) return;
    }
    bound.python(output, item);
  }

 private:
  // The tensor the rows of (layer, stage) land in, or None unless that is the receive posted
  // next; ``await_rows`` then waits for them (nothing, for a stage without rows). Taken apart
  // so that what a caller makes of the rows (the WorkItem) is made before the wait, not after it
  // on the path from the rows' arrival to their answer.
  py::object take(int64_t stage, int64_t layer) {
    if (state_ != State::kPosted || layer != layers_[layer_pos_] || stage != stage_)
      return py::none();
    if (rows_[stage_] == 0) {
      // Nothing travels for it either way, so the step moves on now: a loop may answer the empty
      // item (``send`` takes that answer) or not, as on the Python path.
      empty_at_ = {layer, stage};
      state_ = State::kIdle;
      post_next();
      return py::cast(empty_);
    }
    state_ = State::kServing;
    return py::cast(rings_[stage_].current());
  }
  void await_rows(double timeout_s) {
    if (state_ != State::kServing) return;  // the empty item ``take`` handed out: nothing comes
    auto work = std::move(work_);
    try {
      wait_reply(sends_, *work, timeout_s);
    } catch (const LinkError&) {
      state_ = State::kIdle;
      throw;
    }
  }

  // Rows of ``stage`` within ``max_num_tokens`` (None: no bound asked).
  bool within(py::handle max_num_tokens, int64_t stage) const {
    if (max_num_tokens.is_none()) return true;
    int64_t bound;
    return stage >= 0 && stage < static_cast<int64_t>(rows_.size()) &&
           as_int(max_num_tokens.ptr(), bound) && rows_[stage] <= bound;
  }

  // After an answer taken: the step's first one also does what the connector does then (its
  // control plane posts the next plans' receive), where the plans are not this link's.
  void sent() {
    if (!frame_due_) return;
    frame_due_ = false;
    if (after_first_send_) after_first_send_();
  }

  py::object item_type_, meta_type_, after_first_send_;
  // What recv_step makes of a plan (``bind``), and the plan frames' receives posted, oldest
  // first.
  py::object plan_type_, source_, take_plan_;
  py::dict kinds_;
  int64_t stop_kind_ = -1;
  std::deque<int> posted_plans_;
  // The step this link serves (``begin``): what its work items carry.
  bool serving_ = false;
  bool frame_due_ = false;  // the connector's after_first_send_, until the step's first answer
  int64_t step_ = 0;
  py::object kind_;
  py::list sources_;

  enum class State { kIdle, kPosted, kServing };

  // Two buffers per stage, taken in turn: a (layer, stage)'s rows land where those of two layers
  // back did (afd_common.transport.p2p.ReceiveBuffers says why that is safe, and why a buffer
  // only grows: no allocation between a result's send and the next receive's post, but for the
  // first receive posted ahead, which grows a buffer to max_rows once).
  struct Ring {
    // A buffer and its views as ``rows`` rows: the current one, and the one before (a decode
    // step's rows and the next step's first receive's max_rows, in turn at every step's end and
    // start), each made once: a view is an ATen op, and both turns are on a step's path (its
    // last layer's answer, its first item).
    struct Buffer {
      at::Tensor storage, view, other;
      int64_t rows = -1, other_rows = -1;
      void show(int64_t n) {
        if (n == rows) return;
        std::swap(view, other);
        std::swap(rows, other_rows);
        if (n == rows) return;
        view = n == storage.size(0) ? storage : storage.narrow(0, 0, n);
        rows = n;
      }
    };
    Buffer bufs[2];
    int turn = 0;
    const at::Tensor& take(int64_t rows, int64_t hidden, at::ScalarType dtype) {
      turn ^= 1;
      Buffer& b = bufs[turn];
      if (!b.storage.defined() || b.storage.size(0) < rows) {
        b = Buffer{};
        b.storage = at::empty({rows, hidden}, at::TensorOptions().dtype(dtype));
      }
      b.show(rows);
      return b.view;
    }
    // The buffer taken last, viewed as ``rows`` rows (a receive posted larger than its message).
    void narrow(int64_t rows) { bufs[turn].show(rows); }
    const at::Tensor& current() const { return bufs[turn].view; }
  };

  int tag() const { return static_cast<int>(layers_[layer_pos_] * kMaxStages + stage_); }

  // The receive of the current (layer, stage): none for a stage without rows; the step's first is
  // the one posted ahead, if any.
  void post_current() {
    int64_t rows = rows_[stage_];
    if (rows == 0) return;
    if (ahead_ && layer_pos_ == 0 && stage_ == 0) {
      work_ = std::move(ahead_);
      rings_[0].narrow(rows);
      return;
    }
    work_ = post(pg_, false, rings_[stage_].take(rows, hidden_, dtype_), peer_, tag());
  }

  // On from the item just served (its state left idle): the next one's receive, or at the
  // step's end the next step's first.
  void post_next() {
    if (!advance()) {
      post_ahead();
      return;
    }
    post_current();
    state_ = State::kPosted;
  }

  // The next step's first receive, as the step's last result goes out: the peer sends the next
  // step's plan and first rows back to back, and a receive posted only once the plan is decoded
  // costs those rows a notification round trip (Gloo holds back a send whose receive is not
  // posted). Its size is not known yet: max_rows, which every plan is held to. Gloo takes a
  // shorter message into it, as into any receive (it reports no length), and aborts the process
  // on a longer one, as on any receive -- and it is posted before the plan is checked against
  // max_num_tokens, so a peer that sends more rows than that ends the process rather than being
  // refused by name. It lands in the first stage's ring, whose buffers (one of them, or both,
  // as the number of MoE layers is even or odd) so grow to max_rows at the first step rather
  // than at the first step that large (a long prompt's prefill chunk). Kept, if the last step's
  // first stage had no rows, for the step that has some.
  void post_ahead() {
    if (ahead_ || max_rows_ <= 0) return;
    layer_pos_ = 0;
    stage_ = 0;
    ahead_ = post(pg_, false, rings_[0].take(max_rows_, hidden_, dtype_), peer_, tag());
  }

  // To the next (layer, stage) of the step; false at its end.
  bool advance() {
    if (++stage_ < static_cast<int64_t>(rows_.size())) return true;
    stage_ = 0;
    return ++layer_pos_ < layers_.size();
  }

  std::vector<int64_t> layers_;
  int64_t max_rows_;
  at::Tensor empty_;  // the item of a stage without rows
  static constexpr std::pair<int64_t, int64_t> kNowhere{-1, -1};
  std::pair<int64_t, int64_t> empty_at_ = kNowhere;  // the last empty item handed out
  std::vector<int64_t> rows_;
  std::vector<Ring> rings_;
  size_t layer_pos_ = 0;
  int64_t stage_ = 0;
  State state_ = State::kIdle;
  c10::intrusive_ptr<c10d::Work> work_;
  c10::intrusive_ptr<c10d::Work> ahead_;  // the next step's first receive, posted ahead
};

// A primitive's Python entry: a method descriptor of its link's class whose C function takes the
// arguments as a vector (METH_FASTCALL), with no pybind dispatch on a layer's path (its argument
// vectors, overload search and casters, run cold after every wait: steps alternating between
// the two entries within one run of benchmarks/transport.py's loops were 1.8-3.1% shorter this
// way at 1 token, four runs; no change at 16). ``Impl`` gets the link, its Python object and
// ``MaxArgs`` arguments, None for those not given; a call with keywords or another count goes
// to the connector's own method as made, which answers it or names what is wrong.
template <typename L, py::object (*Impl)(L&, py::handle, const py::handle*), int MinArgs,
          int MaxArgs, size_t Method>
PyObject* entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  try {
    auto& link = py::handle(self).cast<L&>();
    if (kwnames == nullptr && nargs >= MinArgs && nargs <= MaxArgs) {
      py::handle a[MaxArgs + 1];
      for (Py_ssize_t i = 0; i < MaxArgs; ++i) a[i] = i < nargs ? args[i] : Py_None;
      return Impl(link, self, a).release().ptr();
    }
    return PyObject_Vectorcall(link.python_method(Method).ptr(), args, nargs, kwnames);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const LinkError& e) {  // each primitive words its own; for one that did not
    set_link_error(e);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, message(e).c_str());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "an unknown C++ exception in the compiled link");
  }
  return nullptr;
}

template <typename F>
PyCFunction fastcall(F f) { return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)); }

constexpr int kFastCall = METH_FASTCALL | METH_KEYWORDS;

// The primitives, in one_link.PRIMITIVES order (their index is the connector's method's).
PyMethodDef attention_primitives[] = {
    {"send_attn_output",
     fastcall(entry<AttentionLink, AttentionLink::send_attn_output, 2, 4, 0>), kFastCall,
     "send_attn_output(hidden_states, call, topk_ids=None, topk_weights=None)"},
    {"recv_ffn_output", fastcall(entry<AttentionLink, AttentionLink::recv_ffn_output, 1, 1, 1>),
     kFastCall, "recv_ffn_output(pending)"},
    {"begin_step", fastcall(entry<AttentionLink, AttentionLink::begin_step, 1, 1, 2>), kFastCall,
     "begin_step(meta)"},
    {nullptr, nullptr, 0, nullptr}};
PyMethodDef ffn_primitives[] = {
    {"recv_layer", fastcall(entry<FFNLink, FFNLink::recv_layer, 2, 3, 0>), kFastCall,
     "recv_layer(stage_idx, layer_idx, max_num_tokens=None)"},
    {"send_ffn_output", fastcall(entry<FFNLink, FFNLink::send_ffn_output, 2, 2, 1>), kFastCall,
     "send_ffn_output(output, item)"},
    {"recv_step", fastcall(entry<FFNLink, FFNLink::recv_step, 0, 0, 2>), kFastCall,
     "recv_step()"},
    {nullptr, nullptr, 0, nullptr}};

void add_methods(py::handle cls, PyMethodDef* defs) {
  for (; defs->ml_name != nullptr; ++defs) {
    py::object d = py::reinterpret_steal<py::object>(
        PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), defs));
    if (!d || PyObject_SetAttrString(cls.ptr(), defs->ml_name, d.ptr()) < 0)
      throw py::error_already_set();
  }
}

}  // namespace

PYBIND11_MODULE(_one_link, m) {
  m.doc() = "The P2P connector's one-link round trip (afd_common.transport.one_link).";
  // The torch this was compiled against: one_link refuses the module under another.
  m.attr("max_stages") = kMaxStages;  // the tag layout's: one_link refuses the module on a mismatch
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                            std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
  if (link_error_type == nullptr) {
    link_error_type = PyErr_NewExceptionWithDoc(
        "afd_common.transport._one_link.LinkError",
        "A failure on the wire: args (kind, the backend's message).", PyExc_RuntimeError, nullptr);
    if (link_error_type == nullptr) throw py::error_already_set();
  }
  m.attr("LinkError") = py::handle(link_error_type);
  if (current_s_name == nullptr) {
    current_s_name = PyUnicode_InternFromString("current_s");
    names = {PyUnicode_InternFromString("_step"), PyUnicode_InternFromString("_expect"),
             PyUnicode_InternFromString("step"), PyUnicode_InternFromString("kind"),
             PyUnicode_InternFromString("stage_tokens"), PyUnicode_InternFromString("_posted"),
             PyUnicode_InternFromString("_plan"), PyUnicode_InternFromString("_sources"),
             PyUnicode_InternFromString("_kind"), PyUnicode_InternFromString("_ready"),
             PyUnicode_InternFromString("_compiled_step"), PyUnicode_InternFromString("_net"),
             PyUnicode_InternFromString("_post_first"), PyUnicode_InternFromString("per_source")};
    for (PyObject* name : {current_s_name, names.half_step, names.half_expect, names.step,
                           names.kind, names.stage_tokens, names.half_posted, names.half_plan,
                           names.half_sources, names.half_kind, names.half_ready,
                           names.half_compiled_step, names.half_net, names.half_post_first,
                           names.per_source})
      if (name == nullptr) throw py::error_already_set();
  }
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const LinkError& e) {
      set_link_error(e);
    }
  });

  m.def(
      "read_step_frame",
      [](py::bytes data, std::string magic, int version, int frame_kind, int64_t frame_bytes,
         int64_t max_tokens) -> py::object {
        StepFrame f;
        f.set(magic, version, frame_kind, frame_bytes, max_tokens);
        std::string b = data;
        b.resize(static_cast<size_t>(StepFrame::kBytes), '\0');
        int64_t step, kind, tokens[kMaxStages], n;
        if (!f.decode(reinterpret_cast<const uint8_t*>(b.data()), step, kind, tokens, n))
          return py::none();
        return py::make_tuple(step, kind, std::vector<int64_t>(tokens, tokens + n));
      },
      "The FFN link's STEP frame decoder on its own (``data`` padded with zeros to a frame): "
      "(step, step kind, stage tokens), or None for a frame it refuses.");
  py::class_<Link>(m, "Link")
      .def("flush", &Link::flush)
      .def("bind_connector", &Link::bind_connector);

  py::class_<AttentionLink, Link> attention_cls(m, "AttentionLink");
  attention_cls
      .def(py::init<c10::intrusive_ptr<c10d::Backend>, int, at::ScalarType, int64_t,
                    const std::vector<int64_t>&, int64_t>(),
           py::arg("group"), py::arg("dst"), py::arg("dtype"), py::arg("hidden_size"),
           py::arg("moe_layers"), py::arg("num_layers"))
      .def("begin", &AttentionLink::begin)
      .def("send", &AttentionLink::send)
      .def("recv", &AttentionLink::recv)
      .def("in_flight", &AttentionLink::in_flight)
      .def("num_in_flight", &AttentionLink::num_in_flight)
      .def("holds", &AttentionLink::holds)
      .def("end_step", &AttentionLink::end_step)
      .def("drop", &AttentionLink::drop)
      .def("bind", &AttentionLink::bind);
  add_methods(attention_cls, attention_primitives);

  py::class_<FFNLink, Link> ffn_cls(m, "FFNLink");
  ffn_cls
      .def(py::init<c10::intrusive_ptr<c10d::Backend>, int, at::ScalarType, int64_t,
                    std::vector<int64_t>, int64_t>(),
           py::arg("group"), py::arg("src"), py::arg("dtype"), py::arg("hidden_size"),
           py::arg("moe_layers"), py::arg("max_rows"))
      .def("begin", &FFNLink::begin)
      .def("recv", &FFNLink::recv)
      .def("send", &FFNLink::send)
      .def("expected", &FFNLink::expected)
      .def("drop", &FFNLink::drop)
      .def("bind", &FFNLink::bind)
      .def("post_plans", &FFNLink::post_plans)
      .def("num_plans_posted", &FFNLink::num_plans_posted);
  add_methods(ffn_cls, ffn_primitives);
}
