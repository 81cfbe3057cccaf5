#include "common.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

namespace afd {
namespace {

// --- In-order test mode (AFD_TEST_INORDER=1): NCCL/HCCL matching emulated on Gloo. ----------
// Each (group, peer) gets one lane: a thread that runs this rank's sends and receives to that
// peer one at a time in posting order, each finished before the next starts, so a posted receive
// holds back everything posted after it to the same peer, whatever the tags (as on HCCL/NCCL).

bool inorder_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("AFD_TEST_INORDER");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  return on;
}

class LaneWork : public c10d::Work {
 public:
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (timeout == kNoTimeout) {
      cv_.wait(lock, [&] { return done_; });
    } else if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
      TORCH_CHECK(false, "Timed out under in-order matching (AFD_TEST_INORDER): an operation "
                         "posted earlier to the same peer has not completed");
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  void complete(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      error_ = error;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

struct Lane {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> ops;
};

std::mutex g_lanes_mu;
std::map<std::pair<const void*, int>, Lane*> g_lanes;  // lanes live as long as the process

c10::intrusive_ptr<c10d::Work> post_in_order(const Group& pg, std::vector<at::Tensor> ts, int peer,
                                             int tag, bool send) {
  auto work = c10::make_intrusive<LaneWork>();
  Lane* lane;
  {
    std::lock_guard<std::mutex> lock(g_lanes_mu);
    auto& slot = g_lanes[{pg.get(), peer}];
    if (slot == nullptr) {
      slot = new Lane();
      Lane* l = slot;
      std::thread([l] {
        for (;;) {
          std::function<void()> op;
          {
            std::unique_lock<std::mutex> lock(l->mu);
            l->cv.wait(lock, [&] { return !l->ops.empty(); });
            op = std::move(l->ops.front());
            l->ops.pop_front();
          }
          op();
        }
      }).detach();
    }
    lane = slot;
  }
  {
    std::lock_guard<std::mutex> lock(lane->mu);
    lane->ops.push_back([pg, ts, peer, tag, send, work]() mutable {
      try {
        auto w = send ? pg->send(ts, peer, tag) : pg->recv(ts, peer, tag);
        w->wait();
        work->complete(nullptr);
      } catch (...) {
        work->complete(std::current_exception());
      }
    });
  }
  lane->cv.notify_one();
  return work;
}

struct PendingSend {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor keep;
  int dst;
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

void reap_sends(const std::string& name) {
  std::deque<PendingSend> done;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sends.find(name);
    if (it == g_sends.end()) return;
    auto& q = it->second;
    while (!q.empty() && q.front().work->isCompleted()) {
      done.push_back(std::move(q.front()));
      q.pop_front();
    }
  }
  for (auto& s : done) s.work->wait();  // rethrows a failed send
}

void release_sends(const std::string& name, int64_t peer) {
  std::deque<PendingSend> done;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sends.find(name);
    if (it == g_sends.end()) return;
    std::deque<PendingSend> others;
    for (auto& s : it->second) (peer < 0 || s.dst == peer ? done : others).push_back(std::move(s));
    it->second.swap(others);
  }
  for (auto& s : done) s.work->wait();  // at once when the peer has it; rethrows a failed send
}

void isend(const Group& pg, const std::string& name, at::Tensor t, int dst, int tag) {
  std::vector<at::Tensor> ts{t.contiguous()};
  auto work = inorder_enabled() ? post_in_order(pg, ts, dst, tag, true) : pg->send(ts, dst, tag);
  PendingSend oldest;
  bool drain = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto& q = g_sends[name];
    q.push_back({work, ts[0], dst});
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
  return inorder_enabled() ? post_in_order(pg, ts, src, tag, false) : pg->recv(ts, src, tag);
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

void forget_group(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_sends.erase(name);
  }
  forget_async_state(name);
}

namespace {
void release_sends_op(c10::string_view name, int64_t peer) {
  release_sends(std::string(name), peer);
}
void forget_group_op(c10::string_view name) { forget_group(std::string(name)); }
}  // namespace

at::Tensor as_bytes(const at::Tensor& t) {
  return t.contiguous().view({-1}).view(at::kByte);
}

void check_float_rows(const at::Tensor& t, const char* op, const char* arg) {
  auto d = t.scalar_type();
  TORCH_CHECK(d == at::kBFloat16 || d == at::kHalf || d == at::kFloat, "afd_ascend.", op, ": ",
              arg, " has dtype ", d, "; supported: bfloat16, float16, float32");
}

}  // namespace afd

// Not an Ascend op: the portable kernels' own bookkeeping, so a namespace of its own that the
// vendor's afd_ascend library never has (the connectors call it only where it exists).
TORCH_LIBRARY(afd_portable, m) {
  m.def("release_sends(str group_name, int peer=-1) -> ()", &afd::release_sends_op);
  m.def("forget_group(str group_name) -> ()", &afd::forget_group_op);
}
