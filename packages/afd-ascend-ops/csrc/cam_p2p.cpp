// Portable kernels of afd_ascend.a2e / e2a (CAMP2p) over c10d point-to-point.
//
// World (the group named by group_ep): FFN ranks [0, F), attention ranks [F, F + A); a caller with
// rank >= expert_rank_size (F) is attention. Attention local rank a = rank - F feeds FFN rank
// a % F, so FFN rank f serves a = f, f + F, f + 2F, ... in that order.
//
// a2e, attention side: sends a header (int64 rows) and, when rows > 0, one payload
//   [expert_ids | scales | x] as bytes when compute_gate, else x itself.
// a2e, FFN side (x/expert_ids/scales empty: only their dtypes are used; batch_size = the most
//   rows this rank accepts in total, checked against the headers before anything is allocated:
//   a peer's count is never trusted): returns expand_x [n, H] (the sources' rows
//   concatenated in order, zero padded up to batch_size), expert_ids / scales [n, topk] (topk 0
//   without compute_gate), atten_batch_size int64 [sources] and the active mask bool [n].
//   On the attention side the outputs are empty except atten_batch_size = [rows sent].
// e2a, FFN side: expand_x holds the results in a2e's order; atten_batch_size splits them back.
//   Returns an empty [0, H]. Attention side: expand_x gives the shape of the result (its data is
//   not read); returns the rows.
// No layer index travels: the caller keeps both sides in step (the CAMP2p control plane).
//
// Sharded experts (M2N), when expert_owner (int64 [num_experts]: the FFN rank of each expert) is
// given to both ops on both sides: every FFN rank serves every attention rank. a2e, attention side
// (compute_gate=1): for each FFN rank f in order, a header (int64 rows) and, when rows > 0, the
// payload of the rows with an expert on f; returns atten_batch_size = rows per FFN rank [F] and
// routed_rows bool [rows, F] (which ranks each row went to). a2e, FFN side: the sources are all
// attention ranks; batch_size bounds their total before anything is allocated. e2a, attention
// side (routed_rows from a2e): adds the partial results of each FFN rank, in rank order, into
// [rows, H] (zeros for a row no rank holds an expert of). e2a, FFN side: as without it.
//
// Order on each (attention, FFN) pair: header, payload, result -- the same on both sides, so it
// holds where point-to-point operations match in posting order (HCCL, NCCL).
#include <torch/library.h>

#include "common.h"

namespace {

constexpr int kTagA2EHeader = 0x4100;
constexpr int kTagA2EPayload = 0x4101;
constexpr int kTagE2A = 0x4102;

struct World {
  afd::Group pg;
  std::string name;
  int64_t F, A, rank;
  bool m2n;
  bool attention() const { return rank >= F; }
  // FFN rank f's attention sources, as global ranks, in order.
  std::vector<int64_t> sources(int64_t f) const {
    std::vector<int64_t> out;
    for (int64_t a = m2n ? 0 : f; a < A; a += m2n ? 1 : F) out.push_back(F + a);
    return out;
  }
};

World world(const char* op, c10::string_view group_ep, int64_t F, int64_t A, int64_t rank,
            int64_t hidden_size, bool m2n) {
  TORCH_CHECK(F > 0, "afd_ascend.", op, ": expert_rank_size must be > 0, got ", F);
  TORCH_CHECK(A > 0, "afd_ascend.", op, ": attention_rank_size must be > 0, got ", A);
  TORCH_CHECK(rank >= 0 && rank < F + A, "afd_ascend.", op, ": rank ", rank,
              " outside the world [0, ", F + A, ")");
  TORCH_CHECK(hidden_size > 0, "afd_ascend.", op, ": hidden_size must be > 0, got ", hidden_size);
  std::string name(group_ep);
  auto pg = afd::resolve_group(name, op);
  TORCH_CHECK(pg->getSize() == F + A, "afd_ascend.", op, ": group '", name, "' has ",
              pg->getSize(), " ranks, expert_rank_size + attention_rank_size = ", F + A);
  TORCH_CHECK(pg->getRank() == rank, "afd_ascend.", op, ": rank ", rank,
              " given, but this process is rank ", pg->getRank(), " of group '", name, "'");
  afd::reap_sends(name);
  return {pg, name, F, A, rank, m2n};
}

// routed_rows [rows, F]: row r has an expert on FFN rank f. Checks every id against the table.
at::Tensor route_rows(const at::Tensor& expert_ids, const at::Tensor& expert_owner, int64_t F) {
  auto owner = expert_owner.to(at::kCPU, at::kLong).contiguous();
  auto ids = expert_ids.to(at::kCPU, at::kLong);
  int64_t E = owner.numel();
  TORCH_CHECK(E > 0, "afd_ascend.a2e: expert_owner is empty");
  TORCH_CHECK(ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 &&
                                   ids.max().item<int64_t>() < E),
              "afd_ascend.a2e: an expert id is outside [0, ", E, ")");
  TORCH_CHECK(owner.min().item<int64_t>() >= 0 && owner.max().item<int64_t>() < F,
              "afd_ascend.a2e: expert_owner names a rank outside [0, ", F, ")");
  auto row_owner = owner.index_select(0, ids.flatten()).view(ids.sizes());
  auto routed = at::zeros({ids.size(0), F}, ids.options().dtype(at::kBool));
  for (int64_t f = 0; f < F; ++f) routed.select(1, f).copy_((row_owner == f).any(1));
  return routed;
}

void check_rows(const char* op, const char* arg, const at::Tensor& t, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "afd_ascend.", op, ": ",
              arg, " has shape ", t.sizes(), ", expected [", rows, ", ", cols, "]");
}

std::vector<at::Tensor> a2e(const at::Tensor& x, const std::optional<at::Tensor>& expert_ids,
                            const std::optional<at::Tensor>& scales, int64_t batch_size,
                            int64_t hidden_size, int64_t topk, int64_t expert_rank_size,
                            int64_t attention_rank_size, int64_t rank, c10::string_view group_ep,
                            int64_t aiv_num, int64_t compute_gate,
                            const std::optional<at::Tensor>& expert_owner) {
  const char* op = "a2e";
  auto w = world(op, group_ep, expert_rank_size, attention_rank_size, rank, hidden_size,
                 expert_owner.has_value());
  afd::check_float_rows(x, op, "x");
  bool gate = compute_gate != 0;
  TORCH_CHECK(!gate || topk > 0, "afd_ascend.a2e: compute_gate=1 needs topk > 0, got ", topk);
  TORCH_CHECK(!gate || (expert_ids && scales),
              "afd_ascend.a2e: compute_gate=1 needs expert_ids and scales");
  int64_t k = gate ? topk : 0;
  auto ids_dtype = expert_ids ? expert_ids->scalar_type() : at::kInt;
  auto sc_dtype = scales ? scales->scalar_type() : at::kFloat;
  auto opts = x.options();
  int64_t H = hidden_size;

  if (w.attention()) {
    int64_t rows = x.size(0);
    check_rows(op, "x", x, rows, H);
    if (gate) {
      check_rows(op, "expert_ids", *expert_ids, rows, k);
      check_rows(op, "scales", *scales, rows, k);
    }
    if (w.m2n) {
      TORCH_CHECK(gate, "afd_ascend.a2e: expert_owner (sharded experts) needs compute_gate=1: "
                  "rows are routed by their expert_ids");
      auto routed = route_rows(*expert_ids, *expert_owner, w.F);
      std::vector<int64_t> counts;
      for (int64_t f = 0; f < w.F; ++f) {
        auto sel = routed.select(1, f).nonzero().squeeze(1).to(x.device());
        int64_t n = sel.numel();
        counts.push_back(n);
        afd::isend(w.pg, w.name, at::tensor({n}, opts.dtype(at::kLong)), f, kTagA2EHeader);
        if (n > 0) {
          afd::isend(w.pg, w.name,
                     at::cat({afd::as_bytes(expert_ids->index_select(0, sel)),
                              afd::as_bytes(scales->index_select(0, sel)),
                              afd::as_bytes(x.index_select(0, sel))}),
                     f, kTagA2EPayload);
        }
      }
      return {at::empty({0, H}, opts), at::empty({0, k}, opts.dtype(ids_dtype)),
              at::empty({0, k}, opts.dtype(sc_dtype)), at::tensor(counts, opts.dtype(at::kLong)),
              routed.to(x.device())};
    }
    int64_t dst = (rank - w.F) % w.F;
    afd::isend(w.pg, w.name, at::tensor({rows}, opts.dtype(at::kLong)), dst, kTagA2EHeader);
    if (rows > 0) {
      at::Tensor payload = gate ? at::cat({afd::as_bytes(*expert_ids), afd::as_bytes(*scales),
                                           afd::as_bytes(x)})
                                : x.contiguous();
      afd::isend(w.pg, w.name, payload, dst, kTagA2EPayload);
    }
    return {at::empty({0, H}, opts), at::empty({0, k}, opts.dtype(ids_dtype)),
            at::empty({0, k}, opts.dtype(sc_dtype)), at::tensor({rows}, opts.dtype(at::kLong)),
            at::empty({0}, opts.dtype(at::kBool))};
  }

  TORCH_CHECK(batch_size >= 0, "afd_ascend.a2e: batch_size (the most rows the FFN rank accepts) "
              "must be >= 0, got ", batch_size);
  auto srcs = w.sources(rank);
  std::vector<at::Tensor> headers;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (auto src : srcs) {
    headers.push_back(at::empty({1}, opts.dtype(at::kLong)));
    works.push_back(afd::irecv(w.pg, headers.back(), src, kTagA2EHeader));
  }
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    afd::finish(works[i], op, srcs[i], "the row count of attention rank " +
                                           std::to_string(srcs[i] - w.F));
    int64_t c = headers[i].cpu().item<int64_t>();
    TORCH_CHECK(c >= 0, "afd_ascend.a2e: attention rank ", srcs[i] - w.F, " announced ", c, " rows");
    counts.push_back(c);
    total += c;
  }
  TORCH_CHECK(total <= batch_size, "afd_ascend.a2e: the attention ranks sent ", total,
              " rows in total, more than batch_size = ", batch_size);
  // Sharded: batch_size is a bound (the step's tokens), the rows are what the routing sent.
  int64_t n = w.m2n ? total : batch_size;
  auto expand_x = at::zeros({n, H}, opts);
  auto ids = at::zeros({n, k}, opts.dtype(ids_dtype));
  auto sc = at::zeros({n, k}, opts.dtype(sc_dtype));
  int64_t id_bytes = k * c10::elementSize(ids_dtype), sc_bytes = k * c10::elementSize(sc_dtype);
  int64_t x_bytes = H * c10::elementSize(x.scalar_type());
  std::vector<at::Tensor> bufs(srcs.size());
  works.assign(srcs.size(), {});
  int64_t off = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    int64_t c = counts[i];
    if (c > 0) {
      bufs[i] = gate ? at::empty({c * (id_bytes + sc_bytes + x_bytes)}, opts.dtype(at::kByte))
                     : expand_x.narrow(0, off, c);
      works[i] = afd::irecv(w.pg, bufs[i], srcs[i], kTagA2EPayload);
    }
    off += c;
  }
  off = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    int64_t c = counts[i];
    if (c > 0) {
      afd::finish(works[i], op, srcs[i], std::to_string(c) + " rows of attention rank " +
                                             std::to_string(srcs[i] - w.F));
      if (gate) {
        auto& b = bufs[i];
        ids.narrow(0, off, c).copy_(b.narrow(0, 0, c * id_bytes).view(ids_dtype).view({c, k}));
        sc.narrow(0, off, c).copy_(
            b.narrow(0, c * id_bytes, c * sc_bytes).view(sc_dtype).view({c, k}));
        expand_x.narrow(0, off, c).copy_(
            b.narrow(0, c * (id_bytes + sc_bytes), c * x_bytes).view(x.scalar_type()).view({c, H}));
      }
    }
    off += c;
  }
  auto active = at::zeros({n}, opts.dtype(at::kBool));
  active.narrow(0, 0, total).fill_(true);
  return {expand_x, ids, sc, at::tensor(counts, opts.dtype(at::kLong)), active};
}

at::Tensor e2a(const at::Tensor& expand_x, const at::Tensor& atten_batch_size, int64_t batch_size,
               int64_t hidden_size, int64_t topk, int64_t expert_rank_size,
               int64_t attention_rank_size, int64_t rank, c10::string_view group_ep,
               int64_t aiv_num, const std::optional<at::Tensor>& expert_owner,
               const std::optional<at::Tensor>& routed_rows) {
  const char* op = "e2a";
  auto w = world(op, group_ep, expert_rank_size, attention_rank_size, rank, hidden_size,
                 expert_owner.has_value());
  afd::check_float_rows(expand_x, op, "expand_x");
  int64_t H = hidden_size;
  TORCH_CHECK(expand_x.dim() == 2 && expand_x.size(1) == H, "afd_ascend.e2a: expand_x has shape ",
              expand_x.sizes(), ", expected [rows, ", H, "]");
  if (w.attention() && w.m2n) {
    TORCH_CHECK(routed_rows.has_value(), "afd_ascend.e2a: with expert_owner the attention side "
                "passes routed_rows (a2e's last output)");
    int64_t rows = expand_x.size(0);
    const auto& routed = *routed_rows;
    TORCH_CHECK(routed.dim() == 2 && routed.size(0) == rows && routed.size(1) == w.F,
                "afd_ascend.e2a: routed_rows has shape ", routed.sizes(), ", expected [", rows,
                ", ", w.F, "]");
    auto out = at::zeros({rows, H}, expand_x.options());
    std::vector<at::Tensor> sels(w.F), parts(w.F);
    std::vector<c10::intrusive_ptr<c10d::Work>> works(w.F);
    for (int64_t f = 0; f < w.F; ++f) {
      sels[f] = routed.select(1, f).nonzero().squeeze(1).to(expand_x.device());
      if (sels[f].numel() > 0) {
        parts[f] = at::empty({sels[f].numel(), H}, expand_x.options());
        works[f] = afd::irecv(w.pg, parts[f], f, kTagE2A);
      }
    }
    for (int64_t f = 0; f < w.F; ++f) {  // FFN-rank order: the same sum on every run
      if (sels[f].numel() == 0) continue;
      afd::finish(works[f], op, f, std::to_string(sels[f].numel()) + " partial result rows");
      out.index_add_(0, sels[f], parts[f]);
    }
    return out;
  }
  if (w.attention()) {
    auto out = at::empty({expand_x.size(0), H}, expand_x.options());
    if (out.size(0) > 0) {
      int64_t src = (rank - w.F) % w.F;
      afd::recv(w.pg, out, src, kTagE2A, op, std::to_string(out.size(0)) + " result rows");
    }
    return out;
  }
  auto srcs = w.sources(rank);
  auto counts = atten_batch_size.to(at::kCPU, at::kLong).contiguous();
  TORCH_CHECK(counts.numel() == static_cast<int64_t>(srcs.size()), "afd_ascend.e2a: atten_batch_size has ",
              counts.numel(), " entries; FFN rank ", rank, " serves ", srcs.size(),
              " attention ranks");
  auto x = expand_x.contiguous();
  int64_t off = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    int64_t c = counts[i].item<int64_t>();
    TORCH_CHECK(c >= 0 && off + c <= x.size(0), "afd_ascend.e2a: atten_batch_size ",
                counts.sizes(), " asks for more rows than expand_x has (", x.size(0), ")");
    if (c > 0) afd::isend(w.pg, w.name, x.narrow(0, off, c), srcs[i], kTagE2A);
    off += c;
  }
  return at::empty({0, H}, expand_x.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(afd_ascend, CPU, m) {
  m.impl("a2e", a2e);
  m.impl("e2a", e2a);
}

// On an NPU (torch-npu's PrivateUse1) the same kernels ride HCCL through c10d.
TORCH_LIBRARY_IMPL(afd_ascend, PrivateUse1, m) {
  m.impl("a2e", a2e);
  m.impl("e2a", e2a);
}
