// The afd_ascend op schemas (exactly what NPU deployments call) and their Meta kernels.
// This is the only TORCH_LIBRARY(afd_ascend) anywhere: two libraries defining the namespace abort
// the process, so backends add kernels with TORCH_LIBRARY_IMPL only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

// CAMP2p: FFN ranks [0, F), attention ranks [F, F + A); attention local rank a feeds FFN rank a % F.
int64_t sources_of_ffn_rank(int64_t ffn_rank, int64_t num_attn, int64_t num_ffn) {
  return num_attn / num_ffn + (ffn_rank < num_attn % num_ffn ? 1 : 0);
}

std::vector<at::Tensor> a2e_meta(const at::Tensor& x, const std::optional<at::Tensor>& expert_ids,
                                 const std::optional<at::Tensor>& scales, int64_t batch_size,
                                 int64_t hidden_size, int64_t topk, int64_t expert_rank_size,
                                 int64_t attention_rank_size, int64_t rank,
                                 c10::string_view group_ep, int64_t aiv_num,
                                 int64_t compute_gate,
                                 const std::optional<at::Tensor>& expert_owner) {
  auto meta = x.options().device(at::kMeta);
  auto ids_dtype = expert_ids ? expert_ids->scalar_type() : at::kInt;
  auto sc_dtype = scales ? scales->scalar_type() : at::kFloat;
  bool attention = rank >= expert_rank_size;
  int64_t rows = attention ? 0 : batch_size;
  int64_t k = compute_gate ? topk : 0;
  bool m2n = expert_owner.has_value();
  int64_t n_src = attention ? (m2n ? expert_rank_size : 1)
                  : (m2n ? attention_rank_size
                         : sources_of_ffn_rank(rank, attention_rank_size, expert_rank_size));
  auto mask = attention && m2n ? at::empty({x.size(0), expert_rank_size}, meta.dtype(at::kBool))
                               : at::empty({rows}, meta.dtype(at::kBool));
  return {at::empty({rows, hidden_size}, meta), at::empty({rows, k}, meta.dtype(ids_dtype)),
          at::empty({rows, k}, meta.dtype(sc_dtype)), at::empty({n_src}, meta.dtype(at::kLong)),
          mask};
}

at::Tensor e2a_meta(const at::Tensor& expand_x, const at::Tensor& atten_batch_size,
                    int64_t batch_size, int64_t hidden_size, int64_t topk,
                    int64_t expert_rank_size, int64_t attention_rank_size, int64_t rank,
                    c10::string_view group_ep, int64_t aiv_num,
                    const std::optional<at::Tensor>& expert_owner,
                    const std::optional<at::Tensor>& routed_rows) {
  bool attention = rank >= expert_rank_size;
  return at::empty({attention ? expand_x.size(0) : 0, hidden_size},
                   expand_x.options().device(at::kMeta));
}

at::Tensor dispatch_send_meta(const at::Tensor& x, const at::Tensor& expert_ids,
                              const at::Tensor& comm_args, int64_t comm_id, int64_t max_seq_len,
                              int64_t batch_size, int64_t hidden_size, int64_t top_k,
                              int64_t moe_rank_num, int64_t attn_rank_num,
                              int64_t route_expert_num_per_moe, int64_t attn_rank_id,
                              int64_t world_size, int64_t layer_index, int64_t tp_size,
                              int64_t dynamic_quant, c10::string_view group_name) {
  return at::empty({moe_rank_num}, x.options().device(at::kMeta).dtype(at::kLong));
}

std::vector<at::Tensor> dispatch_recv_meta(
    const at::Tensor& x, const at::Tensor& comm_args, int64_t comm_id, int64_t max_seq_len,
    int64_t hidden_size, int64_t top_k, int64_t moe_rank_num, int64_t attn_rank_num,
    int64_t route_expert_num_per_moe, int64_t moe_rank_id, int64_t world_size, int64_t tp_size,
    int64_t dynamic_quant, c10::string_view group_name) {
  auto meta = x.options().device(at::kMeta);
  int64_t cap = x.size(0);
  return {at::empty({cap, hidden_size}, dynamic_quant ? meta.dtype(at::kChar) : meta),
          at::empty({cap}, meta.dtype(at::kFloat)),
          at::empty({route_expert_num_per_moe}, meta.dtype(at::kLong)),
          at::empty({5 + tp_size + route_expert_num_per_moe * tp_size}, meta.dtype(at::kLong))};
}

at::Tensor combine_send_meta(const at::Tensor& expand_x, const at::Tensor& comm_args,
                             const at::Tensor& batch_info, int64_t comm_id, int64_t max_seq_len,
                             int64_t hidden_size, int64_t top_k, int64_t moe_rank_num,
                             int64_t attn_rank_num, int64_t route_expert_num_per_moe,
                             int64_t moe_rank_id, int64_t world_size, int64_t tp_size,
                             c10::string_view group_name) {
  return at::empty({tp_size}, expand_x.options().device(at::kMeta).dtype(at::kLong));
}

at::Tensor combine_recv_meta(const at::Tensor& expand_x, const at::Tensor& expert_ids,
                             const at::Tensor& expert_scales, const at::Tensor& comm_args,
                             int64_t comm_id, int64_t batch_size, int64_t hidden_size,
                             int64_t top_k, int64_t moe_rank_num, int64_t attn_rank_num,
                             int64_t route_expert_num_per_moe, int64_t attn_rank_id,
                             int64_t world_size, c10::string_view group_name) {
  return at::empty({batch_size, hidden_size}, expand_x.options().device(at::kMeta));
}

}  // namespace

TORCH_LIBRARY(afd_ascend, m) {
  m.def(
      "a2e(Tensor x, Tensor? expert_ids=None, Tensor? scales=None, int batch_size=0, "
      "int hidden_size=0, int topk=0, int expert_rank_size=0, int attention_rank_size=0, "
      "int rank=0, str group_ep=\"\", int aiv_num=0, int compute_gate=0, "
      "Tensor? expert_owner=None) -> Tensor[]");
  m.def(
      "e2a(Tensor expand_x, Tensor atten_batch_size, int batch_size=0, int hidden_size=0, "
      "int topk=0, int expert_rank_size=0, int attention_rank_size=0, int rank=0, "
      "str group_ep=\"\", int aiv_num=0, Tensor? expert_owner=None, "
      "Tensor? routed_rows=None) -> Tensor");
  m.def(
      "afd_async_dispatch_send(Tensor x, Tensor expert_ids, Tensor comm_args, int comm_id, "
      "int max_seq_len, int batch_size, int hidden_size, int top_k, int moe_rank_num, "
      "int attn_rank_num, int route_expert_num_per_moe, int attn_rank_id, int world_size, "
      "int layer_index, int tp_size, int dynamic_quant, str group_name) -> Tensor");
  m.def(
      "afd_async_dispatch_recv(Tensor x, Tensor comm_args, int comm_id, int max_seq_len, "
      "int hidden_size, int top_k, int moe_rank_num, int attn_rank_num, "
      "int route_expert_num_per_moe, int moe_rank_id, int world_size, int tp_size, "
      "int dynamic_quant, str group_name) -> Tensor[]");
  m.def(
      "afd_async_combine_send(Tensor expand_x, Tensor comm_args, Tensor batch_info, int comm_id, "
      "int max_seq_len, int hidden_size, int top_k, int moe_rank_num, int attn_rank_num, "
      "int route_expert_num_per_moe, int moe_rank_id, int world_size, int tp_size, "
      "str group_name) -> Tensor");
  m.def(
      "afd_async_combine_recv(Tensor expand_x, Tensor expert_ids, Tensor expert_scales, "
      "Tensor comm_args, int comm_id, int batch_size, int hidden_size, int top_k, "
      "int moe_rank_num, int attn_rank_num, int route_expert_num_per_moe, int attn_rank_id, "
      "int world_size, str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(afd_ascend, Meta, m) {
  m.impl("a2e", a2e_meta);
  m.impl("e2a", e2a_meta);
  m.impl("afd_async_dispatch_send", dispatch_send_meta);
  m.impl("afd_async_dispatch_recv", dispatch_recv_meta);
  m.impl("afd_async_combine_send", combine_send_meta);
  m.impl("afd_async_combine_recv", combine_recv_meta);
}
