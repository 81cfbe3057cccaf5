// Shared by the portable kernels: resolving the c10d group named by an op's string argument,
// non-blocking sends whose tensors stay alive until the transport is done with them, and
// receives whose failures name the op, the peer and what was awaited.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

namespace afd {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// The process group registered under `name` (Python: torch._C._distributed_c10d.
// _register_process_group). `op` names the caller in the error when none is.
Group resolve_group(const std::string& name, const char* op);

// Post a send and return at once. The tensor is kept until the send is released: by
// release_sends, which the connectors call where their protocol proves the peer has received it
// (a Gloo send completes only once the peer posted the matching receive, and reports it only
// when waited on, so completion cannot be polled); as a backstop the oldest is waited for once
// kMaxPendingSends are pending in a group.
void isend(const Group& pg, const std::string& name, at::Tensor t, int dst, int tag);

// Post a receive; wait for it with `finish`. The group's timeout bounds the wait.
c10::intrusive_ptr<c10d::Work> irecv(const Group& pg, at::Tensor& t, int src, int tag);
void finish(const c10::intrusive_ptr<c10d::Work>& work, const char* op, int src,
            const std::string& what);

// Blocking receive of exactly `t`'s bytes.
void recv(const Group& pg, at::Tensor& t, int src, int tag, const char* op,
          const std::string& what);

// Release the sends of `name` that report completion (the in-order lanes' do). Called at the
// start of every op.
void reap_sends(const std::string& name);

// Wait for and release the sends of `name` to `peer` (every peer if < 0). Called where the peer
// is known to have them, so the wait returns at once; bounded by the group timeout otherwise.
// Python: torch.ops.afd_portable.release_sends(group_name, peer).
void release_sends(const std::string& name, int64_t peer);

// Drop everything kept for group `name` once its world is closed: pending sends (their peers are
// gone or going, so they are not waited for) and the CAMAsync kernels' streams and send logs,
// whose posted receives would otherwise keep the closed world's Gloo context -- and with it the
// rendezvous store and its port -- alive. Python: torch.ops.afd_portable.forget_group(name).
void forget_group(const std::string& name);
void forget_async_state(const std::string& name);  // cam_async.cpp's part

// Bytes of a tensor viewed as uint8 [nbytes] (contiguous).
at::Tensor as_bytes(const at::Tensor& t);

// Dtype checks shared by the kernels: bf16, f16, f32 rows.
void check_float_rows(const at::Tensor& t, const char* op, const char* arg);

constexpr int kMaxPendingSends = 4096;

}  // namespace afd
