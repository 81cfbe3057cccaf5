#include "common.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <deque>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace afd {
namespace {

struct PendingSend {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor keep;
};

std::mutex g_mu;
std::unordered_map<std::string, std::deque<PendingSend>> g_sends;

}  // namespace

Group resolve_group(const std::string& name, const char* op) {
  TORCH_CHECK(!name.empty(), "afd_ascend.", op,
              ": empty group name; pass the c10d group_name of the AFD process group");
  try {
    return c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    TORCH_CHECK(false, "afd_ascend.", op, ": no process group named '", name,
                "' is registered in this process (register it with "
                "torch._C._distributed_c10d._register_process_group)");
  }
}

void reap_sends(const std::string& name, bool wait) {
  std::deque<PendingSend> done;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sends.find(name);
    if (it == g_sends.end()) return;
    auto& q = it->second;
    if (wait) {
      done.swap(q);
    } else {
      while (!q.empty() && q.front().work->isCompleted()) {
        done.push_back(std::move(q.front()));
        q.pop_front();
      }
    }
  }
  for (auto& s : done) s.work->wait();  // rethrows a failed send
}

void isend(const Group& pg, const std::string& name, at::Tensor t, int dst, int tag) {
  std::vector<at::Tensor> ts{t.contiguous()};
  auto work = pg->send(ts, dst, tag);
  PendingSend oldest;
  bool drain = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto& q = g_sends[name];
    q.push_back({work, ts[0]});
    if (static_cast<int>(q.size()) > kMaxPendingSends) {
      oldest = std::move(q.front());
      q.pop_front();
      drain = true;
    }
  }
  if (drain) oldest.work->wait();
}

c10::intrusive_ptr<c10d::Work> irecv(const Group& pg, at::Tensor& t, int src, int tag) {
  TORCH_CHECK(t.is_contiguous(), "internal: receive buffer must be contiguous");
  std::vector<at::Tensor> ts{t};
  return pg->recv(ts, src, tag);
}

void finish(const c10::intrusive_ptr<c10d::Work>& work, const char* op, int src,
            const std::string& what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    std::string msg = e.what();
    auto nl = msg.find('\n');
    TORCH_CHECK(false, "afd_ascend.", op, ": waiting for ", what, " from rank ", src,
                " failed: ", msg.substr(0, nl));
  }
}

void recv(const Group& pg, at::Tensor& t, int src, int tag, const char* op,
          const std::string& what) {
  finish(irecv(pg, t, src, tag), op, src, what);
}

at::Tensor as_bytes(const at::Tensor& t) {
  return t.contiguous().view({-1}).view(at::kByte);
}

void check_float_rows(const at::Tensor& t, const char* op, const char* arg) {
  auto d = t.scalar_type();
  TORCH_CHECK(d == at::kBFloat16 || d == at::kHalf || d == at::kFloat, "afd_ascend.", op, ": ",
              arg, " has dtype ", d, "; supported: bfloat16, float16, float32");
}

}  // namespace afd
