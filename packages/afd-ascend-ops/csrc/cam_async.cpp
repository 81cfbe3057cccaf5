// Portable kernels of the four afd_ascend.afd_async_* ops (CAMAsync) over c10d point-to-point.
//
// World (the group named by group_name) is attention-first: attention ranks [0, A), MoE ranks
// [A, A + M) (A = attn_rank_num, M = moe_rank_num; A + M must equal world_size and the group
// size). R = route_expert_num_per_moe: global expert e lives on MoE rank A + e / R as local
// expert e % R; expert ids must lie in [0, M * R). A DP group is tp_size consecutive attention
// ranks (A % tp_size == 0): group g = ranks [g * tp, (g + 1) * tp), member m = rank - g * tp.
// attn_rank_id / moe_rank_id are the caller's GLOBAL ranks and must equal its rank in the group.
// comm_args (the NPU workspace) is accepted and ignored. comm_id (0 <= comm_id < 2^20) separates
// independent streams (e.g. micro-batches): it is folded into every tag, and all state below is
// kept per (group_name, comm_id).
//
// Each (token t, slot k) pair of expert_ids is one row: a copy of x[t] sent to its expert's MoE
// rank. The rows for one MoE rank are ordered by local expert, then t, then k; combine_recv
// recomputes this order from the same expert_ids.
//
// afd_async_dispatch_send (attention; never blocks): to EVERY MoE rank an int64 header
//   [layer_index, B, stop (0/1), sender rank, rows for this MoE rank, R per-local-expert counts]
//   and, when rows > 0, one payload: the rows in x's dtype, or with dynamic_quant = 1 one byte
//   buffer [f32 scales (rows) | int8 rows (rows x H)] where s = amax(|row|) / 127 (1 for an
//   all-zero row) and q = round(x / s) clamped to [-127, 127]. Returns int64 [M]: rows sent to
//   each MoE rank. STOP: layer_index < 0 with B = 0 sends a header with stop = 1 to every MoE
//   rank, no payload, and then waits (bounded by the group's timeout) until everything this
//   process sent on the group was taken, so a closing caller may tear the group down at once.
//   Everything is validated before anything is sent.
//
// afd_async_dispatch_recv (MoE; x is a receive template [cap, H]: dtype = model dtype, cap =
//   capacity rows): returns ONE work item [expand_x [cap, H] (x's dtype, int8 with
//   dynamic_quant), dynamic_scales f32 [cap] (per-row scales with dynamic_quant, else ones; ones
//   past n), expert_token_counts int64 [R], batch_info int64 [5 + tp + R * tp]].
//   One header receive per attention rank stays posted in static state; the call polls them
//   round-robin over DP groups, starting after the last group served, until some group has the
//   headers of all tp members, then receives those members' payloads and builds the group's
//   items. A consumed header's receive is posted again only when nothing is owed to that rank:
//   at once when it sent no rows here, else by the combine_send that returns its last row -- a
//   receive posted earlier would hold back those sends where point-to-point operations match in
//   posting order (HCCL, NCCL), while the rank waits for them before it sends again. An idle group sends nothing and never holds up the
//   others. Layout: member-major (member 0's rows grouped by local expert, then member 1's, ...).
//   batch_info = [0] rows n, [1] source = the DP group's first rank (-1: stop item), [2] layer,
//   [3] first and [4] last local expert covered, [5, 5 + tp) per-member row offsets into
//   expand_x, [5 + tp, 5 + tp + R * tp) per-member per-expert counts (member-major; zero outside
//   [first, last]). expert_token_counts[e] = rows of local expert e in the item. Rows past n are
//   not written (read only the first n). The members' layer indices must agree.
//   Capacity: if the group's rows exceed cap they are split at local-expert boundaries (greedy,
//   in expert order) into items covering consecutive ranges [first, last], each <= cap rows; the
//   rest is queued and returned by the next calls before anything new is polled (those calls
//   must pass the same cap, dtype and dynamic_quant). A single local expert with more than cap
//   rows is an error raised after the group's payloads were consumed, so the stream stays usable.
//   A group with no rows for this MoE rank gives one item with n = 0, first = 0, last = R - 1,
//   so the attention side still gets its (empty) combine.
//   Stop: when all tp members of a group sent STOP the call returns a stop item: n = 0,
//   batch_info[1] = -1, [2] = -1, [3] = the group's first rank, [4] = -1. STOP ends a group's
//   stream: its header receives are not re-posted. When every group has stopped, the state of
//   (group_name, comm_id) is dropped (nothing stays posted) and the next call starts afresh; a
//   group that sends again after its STOP is served once all groups have stopped.
//   Waiting: no timeout while no group is ready (an idle server may stay idle); a receive that
//   fails (a lost attention rank closes its connection) raises at once, naming the rank. On CPU
//   (Gloo, whose Work::isCompleted() only turns true inside wait()) each posted header receive is
//   waited for by a detached thread that signals the call; elsewhere (HCCL) isCompleted() is
//   polled (yield, then 50 us sleeps). Payloads are waited for with the group's timeout.
//
// afd_async_combine_send (MoE; never blocks): expand_x [>= n, H] holds the expert outputs in the
//   model dtype (already scaled by routed_scaling_factor, not by the top-k weights), in the item's
//   layout. To each member with rows in the item: an int64 header [layer, first, last, rows] and
//   then its rows, in the order received. Members without rows get nothing; a stop item or
//   n = 0 sends nothing. Returns int64 [tp]: rows returned to each member.
//
// afd_async_combine_recv (attention): recomputes how many rows it sent to each MoE rank and in
//   which order, posts a header receive for every MoE rank it sent rows to, and then takes each
//   rank's chunks (header, rows) until all of that rank's rows arrived; chunks come in expert
//   order and must cover exactly this rank's rows of [first, last], with one layer throughout (the
//   layer the matching dispatch_send sent, when this process made it; dispatch_send keeps a FIFO
//   of its layers and row counts per stream, and combine_recv also checks that expert_ids give
//   the row counts that were sent). Returns [B, H] in expand_x's dtype:
//   out[t] = sum over k, in order, of expert_scales[t, k] * y(t, k), accumulated in float32.
//   The MoE side must send in the dtype expand_x has here.
//
// Errors are one TORCH_CHECK naming the op, the argument and the value. Headers are int64
// tensors; nothing is pickled. Sends go through afd::isend only.
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kMaxCommId = int64_t{1} << 20;
constexpr int64_t kTagBase = 0x10000;
enum Kind : int64_t { kDispatchHeader = 0, kDispatchPayload = 1, kCombineHeader = 2,
                      kCombinePayload = 3 };
constexpr int64_t kDispatchFixed = 5;  // dispatch header: 5 fields + R counts
constexpr int64_t kCombineHeaderLen = 4;
constexpr int64_t kInfoFixed = 5;
constexpr size_t kMaxSentRecords = 4096;

int tag(int64_t comm_id, Kind k) { return static_cast<int>(kTagBase + comm_id * 16 + k); }

struct World {
  afd::Group pg;
  std::string name;
  int64_t comm_id, A, M, R, tp, rank;
  std::string key() const { return name + "#" + std::to_string(comm_id); }
};

// Checks shared by all four ops, then the group. tp = 0 where the op takes no tp_size.
World world(const char* op, c10::string_view group_name, int64_t comm_id, int64_t M, int64_t A,
            int64_t R, int64_t world_size, int64_t tp, int64_t hidden_size, int64_t top_k) {
  TORCH_CHECK(M > 0, "afd_ascend.", op, ": moe_rank_num must be > 0, got ", M);
  TORCH_CHECK(A > 0, "afd_ascend.", op, ": attn_rank_num must be > 0, got ", A);
  TORCH_CHECK(R > 0, "afd_ascend.", op, ": route_expert_num_per_moe must be > 0, got ", R);
  TORCH_CHECK(hidden_size > 0, "afd_ascend.", op, ": hidden_size must be > 0, got ", hidden_size);
  TORCH_CHECK(top_k > 0, "afd_ascend.", op, ": top_k must be > 0, got ", top_k);
  TORCH_CHECK(world_size == A + M, "afd_ascend.", op, ": world_size ", world_size,
              " != attn_rank_num + moe_rank_num = ", A, " + ", M);
  TORCH_CHECK(comm_id >= 0 && comm_id < kMaxCommId, "afd_ascend.", op, ": comm_id ", comm_id,
              " outside [0, ", kMaxCommId, ")");
  if (tp != 0) {
    TORCH_CHECK(tp > 0 && A % tp == 0, "afd_ascend.", op, ": tp_size ", tp,
                " must be > 0 and divide attn_rank_num ", A);
  }
  std::string name(group_name);
  auto pg = afd::resolve_group(name, op);
  TORCH_CHECK(pg->getSize() == world_size, "afd_ascend.", op, ": group '", name, "' has ",
              pg->getSize(), " ranks, world_size = ", world_size);
  afd::reap_sends(name);
  return {pg, name, comm_id, A, M, R, tp, pg->getRank()};
}

void check_attention_rank(const char* op, const World& w, int64_t attn_rank_id) {
  TORCH_CHECK(attn_rank_id >= 0 && attn_rank_id < w.A, "afd_ascend.", op, ": attn_rank_id ",
              attn_rank_id, " outside the attention ranks [0, ", w.A, ")");
  TORCH_CHECK(attn_rank_id == w.rank, "afd_ascend.", op, ": attn_rank_id ", attn_rank_id,
              " given, but this process is rank ", w.rank, " of group '", w.name, "'");
}

void check_moe_rank(const char* op, const World& w, int64_t moe_rank_id) {
  TORCH_CHECK(moe_rank_id >= w.A && moe_rank_id < w.A + w.M, "afd_ascend.", op, ": moe_rank_id ",
              moe_rank_id, " outside the MoE ranks [", w.A, ", ", w.A + w.M,
              ") (it is the caller's global rank in the group, MoE ranks after the attention "
              "ranks)");
  TORCH_CHECK(moe_rank_id == w.rank, "afd_ascend.", op, ": moe_rank_id ", moe_rank_id,
              " given, but this process is rank ", w.rank, " of group '", w.name,
              "' (moe_rank_id is the global rank, not the index among MoE ranks)");
}

void check_rows(const char* op, const char* arg, const at::Tensor& t, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "afd_ascend.", op, ": ",
              arg, " has shape ", t.sizes(), ", expected [", rows, ", ", cols, "]");
}

std::vector<int64_t> to_vec(const at::Tensor& t) {
  auto c = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

at::Tensor long_tensor(const std::vector<int64_t>& v, const at::TensorOptions& like) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(like.device());
}

// Where the (t, k) pairs of expert_ids go. order: flat pair indices t * K + k sorted stably by
// global expert (so by MoE rank, local expert, t, k); counts[e]: pairs of global expert e;
// start[e]: offset of expert e's pairs in order (start[M * R] = B * K).
struct Routing {
  std::vector<int64_t> order, counts, start;
  int64_t rows_of_rank(int64_t j, int64_t R) const { return start[(j + 1) * R] - start[j * R]; }
};

Routing route(const char* op, const at::Tensor& ids, int64_t B, int64_t K, int64_t M, int64_t R) {
  auto dt = ids.scalar_type();
  TORCH_CHECK(dt == at::kInt || dt == at::kLong, "afd_ascend.", op, ": expert_ids has dtype ", dt,
              "; supported: int32, int64");
  check_rows(op, "expert_ids", ids, B, K);
  auto flat = ids.reshape({-1}).to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = flat.data_ptr<int64_t>();
  int64_t n = flat.numel(), E = M * R;
  Routing r;
  r.counts.assign(E, 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t e = p[i];
    TORCH_CHECK(e >= 0 && e < E, "afd_ascend.", op, ": expert_ids[", i / K, ", ", i % K, "] = ", e,
                " is outside [0, ", E, ") (moe_rank_num ", M, " x route_expert_num_per_moe ", R,
                ")");
    ++r.counts[e];
  }
  r.start.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) r.start[e + 1] = r.start[e] + r.counts[e];
  std::vector<int64_t> pos(r.start.begin(), r.start.end() - 1);
  r.order.resize(n);
  for (int64_t i = 0; i < n; ++i) r.order[pos[p[i]]++] = i;
  return r;
}

// [f32 scales (n) | int8 rows (n x H)] as bytes.
at::Tensor quantize(const at::Tensor& rows) {
  auto xf = rows.to(at::kFloat);
  auto amax = xf.abs().amax({1});
  auto s = at::where(amax > 0, amax / 127.0, at::ones_like(amax));
  auto q = at::round(xf / s.unsqueeze(1)).clamp(-127, 127).to(at::kChar);
  return at::cat({afd::as_bytes(s), afd::as_bytes(q)});
}

// ---- attention-side state: what dispatch_send sent, for combine_recv to check against ----

struct Sent {
  int64_t layer;
  std::vector<int64_t> rows;  // per MoE rank
};

struct SentLog {
  const void* pg = nullptr;  // identity only: a re-registered group starts a fresh log
  std::deque<Sent> fifo;
};

std::mutex g_state_mu;
std::unordered_map<std::string, SentLog> g_sent;

// ---- MoE-side state: posted header receives and queued items per (group, comm_id) ----

struct Item {
  std::vector<at::Tensor> out;
  int64_t cap;
  at::ScalarType dtype;
  int64_t quant;
};

// One posted dispatch-header receive. Gloo's Work::isCompleted() stays false until wait() is
// called, so on CPU a detached waiter thread blocks in wait() (with an idle bound of years, not
// the group timeout: a Gloo wait that times out poisons the whole context) and records the
// outcome; a peer that dies wakes it with an error at once. Other backends (HCCL) report
// completion through isCompleted() and are polled.
struct HeaderRecv {
  at::Tensor buf;
  c10::intrusive_ptr<c10d::Work> work;
  bool threaded = false;
  std::atomic<int> state{0};  // threaded: 0 in flight, 1 arrived, 2 failed
  std::string error;          // set before state = 2
  bool ready() const { return threaded ? state.load() != 0 : work->isCompleted(); }
  bool failed() const { return threaded && state.load() == 2; }
};

struct Signal {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t gen = 0;
};

constexpr auto kIdleWait = std::chrono::hours(24 * 3650);

struct RecvStream {
  std::mutex mu;
  const void* pg = nullptr;  // identity only: a re-registered group starts a fresh stream
  int64_t A, M, R, tp;
  std::vector<std::shared_ptr<HeaderRecv>> hdr;  // per attention rank; null: not posted
  std::vector<int64_t> owed;  // per attention rank: rows still to return before re-posting
  std::vector<char> stopped;                     // per DP group
  int64_t last_group = -1;
  std::deque<Item> queue;
  std::shared_ptr<Signal> sig = std::make_shared<Signal>();
};

std::unordered_map<std::string, std::shared_ptr<RecvStream>> g_streams;

void post_header(RecvStream& s, const World& w, int64_t src, const at::TensorOptions& opts) {
  auto h = std::make_shared<HeaderRecv>();
  h->buf = at::empty({kDispatchFixed + w.R}, opts.dtype(at::kLong));
  h->work = afd::irecv(w.pg, h->buf, static_cast<int>(src), tag(w.comm_id, kDispatchHeader));
  h->threaded = opts.device().is_cpu();
  if (h->threaded) {
    std::thread([h, sig = s.sig] {
      try {
        h->work->wait(kIdleWait);
        h->state = 1;
      } catch (const std::exception& e) {
        std::string msg = e.what();
        h->error = msg.substr(0, msg.find('\n'));
        h->state = 2;
      }
      {
        std::lock_guard<std::mutex> lock(sig->mu);
        ++sig->gen;
      }
      sig->cv.notify_all();
    }).detach();
  }
  s.hdr[src] = std::move(h);
}

// Re-posts the header receives of `ranks` (whose rows were owed) when a dispatch_recv call
// fails after consuming their headers; emptied on success.
struct RepostOnError {
  RecvStream& s;
  const World& w;
  at::TensorOptions opts;
  std::vector<int64_t> ranks;
  ~RepostOnError() {
    for (auto a : ranks) {
      if (s.owed[a] <= 0 || s.hdr[a]) continue;
      s.owed[a] = 0;
      try {
        post_header(s, w, a, opts);
      } catch (...) {  // the receive of a lost peer: the next call reports it
      }
    }
  }
};

std::shared_ptr<RecvStream> stream_of(const char* op, const World& w) {
  std::shared_ptr<RecvStream> s;
  {
    std::lock_guard<std::mutex> lock(g_state_mu);
    auto& slot = g_streams[w.key()];
    if (slot && slot->pg != w.pg.get()) slot.reset();  // the group was re-registered
    if (!slot) {
      slot = std::make_shared<RecvStream>();
      slot->pg = w.pg.get();
      slot->A = w.A, slot->M = w.M, slot->R = w.R, slot->tp = w.tp;
    }
    s = slot;
  }
  TORCH_CHECK(s->A == w.A && s->M == w.M && s->R == w.R && s->tp == w.tp, "afd_ascend.", op,
              ": stream (group '", w.name, "', comm_id ", w.comm_id,
              ") was started with attn_rank_num ", s->A, ", moe_rank_num ", s->M,
              ", route_expert_num_per_moe ", s->R, ", tp_size ", s->tp, "; got ", w.A, ", ", w.M,
              ", ", w.R, ", ", w.tp);
  return s;
}

}  // namespace

void afd::forget_async_state(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_state_mu);
  auto mine = [&](const std::string& key) { return key.rfind(name + "#", 0) == 0; };
  for (auto it = g_sent.begin(); it != g_sent.end();) it = mine(it->first) ? g_sent.erase(it) : ++it;
  for (auto it = g_streams.begin(); it != g_streams.end();) {
    it = mine(it->first) ? g_streams.erase(it) : ++it;
  }
}

namespace {

void drop_stream(const World& w, const std::shared_ptr<RecvStream>& s) {
  std::lock_guard<std::mutex> lock(g_state_mu);
  auto it = g_streams.find(w.key());
  if (it != g_streams.end() && it->second == s) g_streams.erase(it);
}

// ---------------------------------------------------------------------------------------------

at::Tensor dispatch_send(const at::Tensor& x, const at::Tensor& expert_ids,
                         const at::Tensor& comm_args, int64_t comm_id, int64_t max_seq_len,
                         int64_t batch_size, int64_t hidden_size, int64_t top_k,
                         int64_t moe_rank_num, int64_t attn_rank_num,
                         int64_t route_expert_num_per_moe, int64_t attn_rank_id,
                         int64_t world_size, int64_t layer_index, int64_t tp_size,
                         int64_t dynamic_quant, c10::string_view group_name) {
  const char* op = "afd_async_dispatch_send";
  afd::check_float_rows(x, op, "x");
  int64_t H = hidden_size, K = top_k, M = moe_rank_num, R = route_expert_num_per_moe;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == H, "afd_ascend.", op, ": x has shape ", x.sizes(),
              ", expected [batch_size, ", H, "]");
  int64_t B = x.size(0);
  TORCH_CHECK(B == batch_size, "afd_ascend.", op, ": x has ", B, " rows, batch_size = ",
              batch_size);
  TORCH_CHECK(B <= max_seq_len, "afd_ascend.", op, ": batch_size ", B, " > max_seq_len ",
              max_seq_len);
  TORCH_CHECK(dynamic_quant == 0 || dynamic_quant == 1, "afd_ascend.", op,
              ": dynamic_quant must be 0 or 1, got ", dynamic_quant);
  bool stop = layer_index < 0;
  TORCH_CHECK(!stop || B == 0, "afd_ascend.", op, ": layer_index ", layer_index,
              " < 0 means STOP, which carries no tokens, but batch_size = ", B);
  auto w = world(op, group_name, comm_id, M, attn_rank_num, R, world_size, tp_size, H, K);
  check_attention_rank(op, w, attn_rank_id);
  auto r = route(op, expert_ids, B, K, M, R);  // validates every id before anything is sent

  auto opts = x.options();
  std::vector<int64_t> rows(M);
  for (int64_t j = 0; j < M; ++j) rows[j] = r.rows_of_rank(j, R);
  at::Tensor xc, order;
  if (B > 0) {
    xc = x.contiguous();
    order = long_tensor(r.order, opts);
  }
  for (int64_t j = 0; j < M; ++j) {
    std::vector<int64_t> h{layer_index, B, stop ? 1 : 0, w.rank, rows[j]};
    for (int64_t e = 0; e < R; ++e) h.push_back(r.counts[j * R + e]);
    int dst = static_cast<int>(w.A + j);
    afd::isend(w.pg, w.name, long_tensor(h, opts), dst, tag(comm_id, kDispatchHeader));
    if (rows[j] > 0) {
      auto tok = order.narrow(0, r.start[j * R], rows[j]).div(K, "floor");
      auto sel = xc.index_select(0, tok);
      afd::isend(w.pg, w.name, dynamic_quant ? quantize(sel) : sel, dst,
                 tag(comm_id, kDispatchPayload));
    }
  }
  // A STOP is the last thing a closing attention rank sends: wait (bounded by the group's
  // timeout) until every send of this group was taken, so the caller may close the group.
  if (stop) afd::release_sends(w.name, -1);
  {
    std::lock_guard<std::mutex> lock(g_state_mu);
    auto& log = g_sent[w.key()];
    if (log.pg != w.pg.get() || stop) log.fifo.clear();
    log.pg = w.pg.get();
    if (!stop) {
      log.fifo.push_back({layer_index, rows});
      if (log.fifo.size() > kMaxSentRecords) log.fifo.pop_front();
    }
  }
  return long_tensor(rows, opts);
}

// One member's consumed header and payload.
struct Member {
  int64_t rank, layer, B, stop, rows;
  std::vector<int64_t> counts;  // R
  at::Tensor data;              // [rows, H] in the model dtype, or int8 with quant
  at::Tensor scales;            // [rows] f32 with quant
};

std::vector<at::Tensor> empty_item(int64_t cap, int64_t H, int64_t R, int64_t tp,
                                   at::ScalarType row_dtype, const at::TensorOptions& opts,
                                   std::vector<int64_t>& info) {
  info.assign(kInfoFixed + tp + R * tp, 0);
  // Capacity-sized so shapes stay static (graph capture); only the first n rows are written:
  // zero-filling the rest would touch capacity x H bytes per item.
  return {at::empty({cap, H}, opts.dtype(row_dtype)), at::ones({cap}, opts.dtype(at::kFloat)),
          at::zeros({R}, opts.dtype(at::kLong)), at::Tensor()};
}

std::vector<at::Tensor> dispatch_recv(const at::Tensor& x, const at::Tensor& comm_args,
                                      int64_t comm_id, int64_t max_seq_len, int64_t hidden_size,
                                      int64_t top_k, int64_t moe_rank_num, int64_t attn_rank_num,
                                      int64_t route_expert_num_per_moe, int64_t moe_rank_id,
                                      int64_t world_size, int64_t tp_size, int64_t dynamic_quant,
                                      c10::string_view group_name) {
  const char* op = "afd_async_dispatch_recv";
  afd::check_float_rows(x, op, "x");
  int64_t H = hidden_size, R = route_expert_num_per_moe;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == H, "afd_ascend.", op, ": x has shape ", x.sizes(),
              ", expected [capacity, ", H, "]");
  TORCH_CHECK(dynamic_quant == 0 || dynamic_quant == 1, "afd_ascend.", op,
              ": dynamic_quant must be 0 or 1, got ", dynamic_quant);
  auto w = world(op, group_name, comm_id, moe_rank_num, attn_rank_num, R, world_size, tp_size, H,
                 top_k);
  check_moe_rank(op, w, moe_rank_id);
  int64_t cap = x.size(0), tp = w.tp, G = w.A / tp;
  auto opts = x.options();
  auto row_dtype = dynamic_quant ? at::kChar : x.scalar_type();

  auto s = stream_of(op, w);
  std::lock_guard<std::mutex> lock(s->mu);
  if (!s->queue.empty()) {
    Item it = std::move(s->queue.front());
    s->queue.pop_front();
    TORCH_CHECK(it.cap == cap && it.dtype == x.scalar_type() && it.quant == dynamic_quant,
                "afd_ascend.", op, ": a queued item was split for capacity ", it.cap, ", dtype ",
                it.dtype, ", dynamic_quant ", it.quant, "; this call passes capacity ", cap,
                ", dtype ", x.scalar_type(), ", dynamic_quant ", dynamic_quant);
    return it.out;
  }
  if (s->hdr.empty()) {
    s->hdr.resize(w.A);
    s->owed.assign(w.A, 0);
    s->stopped.assign(G, 0);
    for (int64_t a = 0; a < w.A; ++a) post_header(*s, w, a, opts);
  }

  // Wait until one DP group has the headers of all its members; round-robin from the group after
  // the one served last. No timeout: an idle group may stay idle; a lost peer fails its receive.
  int64_t g = -1;
  for (int64_t spin = 0; g < 0; ++spin) {
    uint64_t gen;
    {
      std::lock_guard<std::mutex> sl(s->sig->mu);
      gen = s->sig->gen;
    }
    for (int64_t i = 1; i <= G && g < 0; ++i) {
      int64_t c = ((s->last_group + i) % G + G) % G;
      if (s->stopped[c]) continue;
      bool ready = true;
      for (int64_t m = 0; m < tp; ++m) {
        auto& h = s->hdr[c * tp + m];
        if (!h && s->owed[c * tp + m] > 0) {  // its results are not all returned yet
          ready = false;
          continue;
        }
        TORCH_CHECK(h, "afd_ascend.", op, ": the stream of group '", w.name, "', comm_id ",
                    comm_id, " is broken by an earlier error (attention rank ", c * tp + m,
                    " has no posted header receive)");
        TORCH_CHECK(!h->failed(), "afd_ascend.", op, ": waiting for the dispatch header of "
                    "attention rank ", c * tp + m, " failed: ", h->error);
        ready = ready && h->ready();
      }
      if (ready) g = c;
    }
    if (g >= 0) break;
    if (opts.device().is_cpu()) {
      std::unique_lock<std::mutex> sl(s->sig->mu);
      s->sig->cv.wait(sl, [&] { return s->sig->gen != gen; });
    } else if (spin < 200) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  s->last_group = g;

  // Consume the members' headers.
  std::vector<Member> mem(tp);
  int64_t n_stop = 0;
  for (int64_t m = 0; m < tp; ++m) {
    int64_t src = g * tp + m;
    auto hr = std::move(s->hdr[src]);
    if (!hr->threaded) {
      afd::finish(hr->work, op, static_cast<int>(src),
                  "the dispatch header of attention rank " + std::to_string(src));
    }
    auto h = to_vec(hr->buf);
    auto& me = mem[m];
    me.rank = src, me.layer = h[0], me.B = h[1], me.stop = h[2], me.rows = h[4];
    me.counts.assign(h.begin() + kDispatchFixed, h.end());
    TORCH_CHECK(h[3] == src, "afd_ascend.", op, ": a dispatch header from attention rank ", src,
                " names sender ", h[3]);
    TORCH_CHECK(me.stop == 0 || me.stop == 1, "afd_ascend.", op, ": attention rank ", src,
                " sent stop flag ", me.stop);
    n_stop += me.stop;
  }
  if (n_stop == tp) {
    s->stopped[g] = 1;
    std::vector<int64_t> info;
    auto out = empty_item(cap, H, R, tp, row_dtype, opts, info);
    info[1] = -1, info[2] = -1, info[3] = g * tp, info[4] = -1;
    out[3] = long_tensor(info, opts);
    if (std::all_of(s->stopped.begin(), s->stopped.end(), [](char c) { return c != 0; })) {
      s->hdr.clear();
      drop_stream(w, s);
    }
    return out;
  }
  // Keep the stream posted (see above for when). If this call fails from here on, no rows will
  // be returned for this dispatch: re-post at once so the stream stays usable.
  RepostOnError repost{*s, w, opts};
  for (int64_t m = 0; m < tp; ++m) {
    if (mem[m].stop) continue;
    if (mem[m].rows > 0) {
      s->owed[g * tp + m] = mem[m].rows;
      repost.ranks.push_back(g * tp + m);
    } else {
      post_header(*s, w, g * tp + m, opts);
    }
  }
  int64_t live = 0;  // a member that did not send STOP
  while (mem[live].stop) ++live;
  for (auto& me : mem) {
    TORCH_CHECK(me.B >= 0 && me.B <= max_seq_len, "afd_ascend.", op, ": attention rank ",
                me.rank, " announced batch size ", me.B, ", outside [0, max_seq_len = ",
                max_seq_len, "]");
    int64_t sum = 0;
    for (auto c : me.counts) {
      TORCH_CHECK(c >= 0, "afd_ascend.", op, ": attention rank ", me.rank,
                  " announced a negative expert count ", c);
      sum += c;
    }
    TORCH_CHECK(sum == me.rows && me.rows <= me.B * top_k, "afd_ascend.", op,
                ": attention rank ", me.rank, " announced ", me.rows,
                " rows, per-expert counts summing to ", sum, ", batch size ", me.B, " x top_k ",
                top_k);
  }
  int64_t layer = mem[live].layer;

  // Receive the payloads (all posted before any wait), so that a bad layer below leaves the
  // stream in step.
  std::vector<at::Tensor> bufs(tp);
  std::vector<c10::intrusive_ptr<c10d::Work>> works(tp);
  for (int64_t m = 0; m < tp; ++m) {
    int64_t n = mem[m].rows;
    if (n == 0) continue;
    bufs[m] = dynamic_quant ? at::empty({n * (4 + H)}, opts.dtype(at::kByte))
                            : at::empty({n, H}, opts.dtype(x.scalar_type()));
    works[m] = afd::irecv(w.pg, bufs[m], static_cast<int>(mem[m].rank),
                          tag(comm_id, kDispatchPayload));
  }
  for (int64_t m = 0; m < tp; ++m) {
    auto& me = mem[m];
    if (me.rows == 0) continue;
    afd::finish(works[m], op, static_cast<int>(me.rank),
                std::to_string(me.rows) + " rows of layer " + std::to_string(me.layer) +
                    " from attention rank " + std::to_string(me.rank));
    if (dynamic_quant) {
      me.scales = bufs[m].narrow(0, 0, me.rows * 4).view(at::kFloat);
      me.data = bufs[m].narrow(0, me.rows * 4, me.rows * H).view(at::kChar).view({me.rows, H});
    } else {
      me.data = bufs[m];
    }
  }
  for (auto& me : mem) {
    TORCH_CHECK(!me.stop, "afd_ascend.", op, ": DP group ", g, " (attention ranks ", g * tp,
                "..", g * tp + tp - 1, "): attention rank ", me.rank,
                " sent STOP while attention rank ", mem[live].rank, " sent layer ", layer);
    TORCH_CHECK(me.layer == layer, "afd_ascend.", op, ": DP group ", g, " (attention ranks ",
                g * tp, "..", g * tp + tp - 1, "): attention rank ", me.rank, " sent layer ",
                me.layer, " but attention rank ", mem[live].rank, " sent layer ", layer);
  }

  // Split at local-expert boundaries so that each item fits the capacity.
  std::vector<int64_t> total(R, 0);
  int64_t all = 0;
  for (auto& me : mem)
    for (int64_t e = 0; e < R; ++e) total[e] += me.counts[e];
  for (int64_t e = 0; e < R; ++e) {
    TORCH_CHECK(total[e] <= cap, "afd_ascend.", op, ": local expert ", e, " of MoE rank ",
                w.rank, " got ", total[e], " rows from DP group ", g, " at layer ", layer,
                ", more than the capacity cap = ", cap,
                " rows of x; pass a larger receive template (that layer was dropped)");
    all += total[e];
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  if (all == 0) {
    ranges.emplace_back(0, R - 1);
  } else {
    int64_t first = 0, acc = 0;
    for (int64_t e = 0; e < R; ++e) {
      if (acc + total[e] > cap) {
        ranges.emplace_back(first, e - 1);
        first = e, acc = 0;
      }
      acc += total[e];
    }
    ranges.emplace_back(first, R - 1);
  }

  std::vector<std::vector<at::Tensor>> items;
  for (auto [first, last] : ranges) {
    std::vector<int64_t> info;
    auto out = empty_item(cap, H, R, tp, row_dtype, opts, info);
    std::vector<int64_t> etc(R, 0);
    int64_t off = 0;
    for (int64_t m = 0; m < tp; ++m) {
      auto& me = mem[m];
      info[kInfoFixed + m] = off;
      int64_t pre = 0, cnt = 0;
      for (int64_t e = 0; e < first; ++e) pre += me.counts[e];
      for (int64_t e = first; e <= last; ++e) {
        cnt += me.counts[e];
        etc[e] += me.counts[e];
        info[kInfoFixed + tp + m * R + e] = me.counts[e];
      }
      if (cnt > 0) {
        out[0].narrow(0, off, cnt).copy_(me.data.narrow(0, pre, cnt));
        if (dynamic_quant) out[1].narrow(0, off, cnt).copy_(me.scales.narrow(0, pre, cnt));
      }
      off += cnt;
    }
    info[0] = off, info[1] = g * tp, info[2] = layer, info[3] = first, info[4] = last;
    out[2] = long_tensor(etc, opts);
    out[3] = long_tensor(info, opts);
    items.push_back(std::move(out));
  }
  for (size_t i = 1; i < items.size(); ++i)
    s->queue.push_back({std::move(items[i]), cap, x.scalar_type(), dynamic_quant});
  repost.ranks.clear();  // delivered: combine_send re-posts once the rows are returned
  return items[0];
}

at::Tensor combine_send(const at::Tensor& expand_x, const at::Tensor& comm_args,
                        const at::Tensor& batch_info, int64_t comm_id, int64_t max_seq_len,
                        int64_t hidden_size, int64_t top_k, int64_t moe_rank_num,
                        int64_t attn_rank_num, int64_t route_expert_num_per_moe,
                        int64_t moe_rank_id, int64_t world_size, int64_t tp_size,
                        c10::string_view group_name) {
  const char* op = "afd_async_combine_send";
  afd::check_float_rows(expand_x, op, "expand_x");
  int64_t H = hidden_size, R = route_expert_num_per_moe;
  TORCH_CHECK(expand_x.dim() == 2 && expand_x.size(1) == H, "afd_ascend.", op,
              ": expand_x has shape ", expand_x.sizes(), ", expected [rows, ", H, "]");
  auto w = world(op, group_name, comm_id, moe_rank_num, attn_rank_num, R, world_size, tp_size, H,
                 top_k);
  check_moe_rank(op, w, moe_rank_id);
  int64_t tp = w.tp;
  auto opts = expand_x.options();
  TORCH_CHECK(batch_info.numel() == kInfoFixed + tp + R * tp, "afd_ascend.", op,
              ": batch_info has ", batch_info.numel(), " entries, expected 5 + tp_size + R * "
              "tp_size = ", kInfoFixed + tp + R * tp);
  auto info = to_vec(batch_info.reshape({-1}));
  int64_t n = info[0], src = info[1], layer = info[2], first = info[3], last = info[4];
  std::vector<int64_t> rows(tp, 0);
  if (src == -1 || n == 0) return long_tensor(rows, opts);
  TORCH_CHECK(src >= 0 && src < w.A && src % tp == 0, "afd_ascend.", op, ": batch_info[1] = ",
              src, " is not the first rank of a DP group (attention ranks [0, ", w.A,
              "), tp_size ", tp, ")");
  TORCH_CHECK(n > 0 && n <= expand_x.size(0), "afd_ascend.", op, ": batch_info[0] = ", n,
              " rows, but expand_x has ", expand_x.size(0));
  TORCH_CHECK(layer >= 0, "afd_ascend.", op, ": batch_info[2] = layer ", layer);
  TORCH_CHECK(first >= 0 && first <= last && last < R, "afd_ascend.", op,
              ": batch_info[3:5] = experts [", first, ", ", last, "], outside [0, ", R, ")");
  int64_t sum = 0;
  for (int64_t m = 0; m < tp; ++m) {
    for (int64_t e = 0; e < R; ++e) {
      int64_t c = info[kInfoFixed + tp + m * R + e];
      TORCH_CHECK(c >= 0 && (c == 0 || (e >= first && e <= last)), "afd_ascend.", op,
                  ": batch_info gives member ", m, " ", c, " rows of local expert ", e,
                  " (item covers experts [", first, ", ", last, "])");
      rows[m] += c;
    }
    int64_t off = info[kInfoFixed + m];
    TORCH_CHECK(off >= 0 && off + rows[m] <= n && rows[m] <= max_seq_len * top_k, "afd_ascend.",
                op, ": batch_info gives member ", m, " rows [", off, ", ", off + rows[m],
                "), outside the item's ", n, " rows (or over max_seq_len x top_k)");
    sum += rows[m];
  }
  TORCH_CHECK(sum == n, "afd_ascend.", op, ": batch_info's per-member counts sum to ", sum,
              ", batch_info[0] = ", n);
  auto xc = expand_x.contiguous();
  for (int64_t m = 0; m < tp; ++m) {
    if (rows[m] == 0) continue;
    int dst = static_cast<int>(src + m);
    afd::isend(w.pg, w.name, long_tensor({layer, first, last, rows[m]}, opts), dst,
               tag(comm_id, kCombineHeader));
    afd::isend(w.pg, w.name, xc.narrow(0, info[kInfoFixed + m], rows[m]), dst,
               tag(comm_id, kCombinePayload));
  }
  // Everything owed to a member is on its way: its next dispatch header may be received now.
  auto s = stream_of(op, w);
  std::lock_guard<std::mutex> lock(s->mu);
  for (int64_t m = 0; m < tp; ++m) {
    int64_t a = src + m;
    if (rows[m] == 0 || a >= static_cast<int64_t>(s->owed.size()) || s->owed[a] <= 0) continue;
    s->owed[a] -= rows[m];
    if (s->owed[a] <= 0 && !s->hdr[a]) {
      s->owed[a] = 0;
      post_header(*s, w, a, opts);
    }
  }
  return long_tensor(rows, opts);
}

at::Tensor combine_recv(const at::Tensor& expand_x, const at::Tensor& expert_ids,
                        const at::Tensor& expert_scales, const at::Tensor& comm_args,
                        int64_t comm_id, int64_t batch_size, int64_t hidden_size, int64_t top_k,
                        int64_t moe_rank_num, int64_t attn_rank_num,
                        int64_t route_expert_num_per_moe, int64_t attn_rank_id,
                        int64_t world_size, c10::string_view group_name) {
  const char* op = "afd_async_combine_recv";
  afd::check_float_rows(expand_x, op, "expand_x");
  afd::check_float_rows(expert_scales, op, "expert_scales");
  int64_t H = hidden_size, K = top_k, M = moe_rank_num, R = route_expert_num_per_moe;
  int64_t B = batch_size;
  TORCH_CHECK(B >= 0, "afd_ascend.", op, ": batch_size must be >= 0, got ", B);
  check_rows(op, "expert_scales", expert_scales, B, K);
  auto w = world(op, group_name, comm_id, M, attn_rank_num, R, world_size, 0, H, K);
  check_attention_rank(op, w, attn_rank_id);
  auto r = route(op, expert_ids, B, K, M, R);
  auto opts = expand_x.options();
  std::vector<int64_t> rows(M);
  for (int64_t j = 0; j < M; ++j) rows[j] = r.rows_of_rank(j, R);

  int64_t layer = -1;
  {
    std::lock_guard<std::mutex> lock(g_state_mu);
    auto it = g_sent.find(w.key());
    if (it != g_sent.end() && it->second.pg == w.pg.get() && !it->second.fifo.empty()) {
      Sent sent = std::move(it->second.fifo.front());
      it->second.fifo.pop_front();
      TORCH_CHECK(sent.rows == rows, "afd_ascend.", op, ": expert_ids route ",
                  c10::IntArrayRef(rows), " rows to the MoE ranks, but the oldest "
                  "dispatch_send of comm_id ", comm_id, " not yet combined (layer ", sent.layer,
                  ") sent ", c10::IntArrayRef(sent.rows),
                  " (each dispatch_send needs its combine_recv, in order, until a STOP)");
      layer = sent.layer;
    }
  }
  auto out_dtype = expand_x.scalar_type();
  if (B == 0) return at::empty({0, H}, opts);

  auto Y = at::empty({B * K, H}, opts);
  auto order = long_tensor(r.order, opts);
  std::vector<at::Tensor> hdr(M);
  std::vector<c10::intrusive_ptr<c10d::Work>> hw(M);
  auto post = [&](int64_t j) {
    hdr[j] = at::empty({kCombineHeaderLen}, opts.dtype(at::kLong));
    hw[j] = afd::irecv(w.pg, hdr[j], static_cast<int>(w.A + j), tag(comm_id, kCombineHeader));
  };
  for (int64_t j = 0; j < M; ++j)
    if (rows[j] > 0) post(j);
  for (int64_t j = 0; j < M; ++j) {
    int src = static_cast<int>(w.A + j);
    int64_t got = 0, next_e = 0;
    const int64_t* cnt = r.counts.data() + j * R;
    while (got < rows[j]) {
      afd::finish(hw[j], op, src, "a combine header from MoE rank " + std::to_string(src));
      auto h = to_vec(hdr[j]);
      int64_t hl = h[0], f = h[1], l = h[2], n = h[3];
      if (layer < 0) layer = hl;
      TORCH_CHECK(hl == layer, "afd_ascend.", op, ": MoE rank ", src, " answered layer ", hl,
                  ", expected layer ", layer);
      TORCH_CHECK(f >= next_e && f <= l && l < R, "afd_ascend.", op, ": MoE rank ", src,
                  " answered experts [", f, ", ", l, "] after experts up to ", next_e - 1,
                  " (R = ", R, ")");
      int64_t skipped = 0, mine = 0;
      for (int64_t e = next_e; e < f; ++e) skipped += cnt[e];
      for (int64_t e = f; e <= l; ++e) mine += cnt[e];
      TORCH_CHECK(skipped == 0 && n == mine && n > 0, "afd_ascend.", op, ": MoE rank ", src,
                  " answered ", n, " rows for experts [", f, ", ", l, "] of layer ", layer,
                  "; this rank sent it ", mine, " rows for them and ", skipped,
                  " rows for the experts skipped before them");
      auto buf = at::empty({n, H}, opts);
      auto pw = afd::irecv(w.pg, buf, src, tag(comm_id, kCombinePayload));
      if (got + n < rows[j]) post(j);
      afd::finish(pw, op, src, std::to_string(n) + " result rows of layer " +
                                   std::to_string(layer) + " from MoE rank " +
                                   std::to_string(src));
      Y.index_copy_(0, order.narrow(0, r.start[j * R] + got, n), buf);
      got += n;
      next_e = l + 1;
    }
  }
  auto Yv = Y.view({B, K, H});
  auto acc = at::zeros({B, H}, opts.dtype(at::kFloat));
  for (int64_t k = 0; k < K; ++k) {
    acc += Yv.select(1, k).to(at::kFloat) * expert_scales.select(1, k).to(at::kFloat).unsqueeze(1);
  }
  return acc.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(afd_ascend, CPU, m) {
  m.impl("afd_async_dispatch_send", dispatch_send);
  m.impl("afd_async_dispatch_recv", dispatch_recv);
  m.impl("afd_async_combine_send", combine_send);
  m.impl("afd_async_combine_recv", combine_recv);
}

// On an NPU (torch-npu's PrivateUse1) the same kernels ride HCCL through c10d.
TORCH_LIBRARY_IMPL(afd_ascend, PrivateUse1, m) {
  m.impl("afd_async_dispatch_send", dispatch_send);
  m.impl("afd_async_dispatch_recv", dispatch_recv);
  m.impl("afd_async_combine_send", combine_send);
  m.impl("afd_async_combine_recv", combine_recv);
}
