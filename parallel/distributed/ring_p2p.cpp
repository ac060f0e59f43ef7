// The ring allreduce over processes, one send and one recv per rank and step. Read it next to
// RingCommunicator::Ring in parallel/comm_ring.cpp: the chunking and the two phases are the
// same (and so is the cost, Note [ring allreduce cost]); only the transport differs. There one
// thread drives every device; here each process runs the loop for its own rank, and the ring
// exists because every rank sends to rank + 1 and receives from rank - 1 in the same step.
#include "parallel/distributed/ring_p2p.h"

#include <vector>

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::parallel::distributed {

void allreduce_ring_p2p(ProcessGroup& pg, const Tensor& t) {
  TANDEM_CHECK(pg.backend() == "gloo", Dist, "allreduce_ring_p2p on rank ", pg.rank(),
               ": needs a gloo group, got '", pg.backend(),
               "' (on NCCL each send/recv pair must be one group call, not offered yet)");
  TANDEM_CHECK(t.defined() && t.is_contiguous(), Value, "allreduce_ring_p2p on rank ", pg.rank(),
               ": the tensor must be defined and contiguous");
  const int n = pg.size(), r = pg.rank();
  const int64_t numel = t.numel();
  if (n == 1 || numel == 0) return;
  const int right = (r + 1) % n, left = (r + n - 1) % n;

  // Chunk c is elements [bounds[c], bounds[c + 1]); the first numel % n chunks get one more
  // element, exactly as in comm_ring.cpp, so every rank cuts the buffer the same way.
  Tensor flat = t.view({numel});
  std::vector<int64_t> bounds{0};
  for (int c = 0; c < n; ++c) bounds.push_back(bounds.back() + numel / n + (c < numel % n));
  auto chunk = [&](int c) { return flat.slice(0, bounds[c], bounds[c + 1]); };
  auto mod = [n](int c) { return ((c % n) + n) % n; };

  // One step: send chunk `out` to the right, receive from the left into `dst`. Both are posted
  // before either is waited on: every rank sends in the same step, so a rank that first waited
  // for its send to be taken could wait for a neighbour doing the same. The k-th send from a to
  // b pairs with the k-th recv of b from a, so no tags are needed. An empty chunk (numel < n) is
  // skipped on both sides alike, since both know its length.
  auto step = [&](int out, const Tensor& dst) {
    WorkPtr sent, got;
    if (bounds[out + 1] > bounds[out]) sent = pg.send(chunk(out), right);
    if (dst.numel() > 0) got = pg.recv(dst, left);
    if (sent) sent->wait();
    if (got) got->wait();
  };

  // Reduce-scatter: in step s rank r passes on its partial sum of chunk r - s and adds the left
  // neighbour's partial sum of chunk r - s - 1 into its own. After n - 1 steps rank r holds the
  // complete sum of chunk r + 1.
  Tensor incoming = empty({bounds[1] - bounds[0]}, t.dtype(), t.device());  // [largest chunk]
  for (int s = 0; s + 1 < n; ++s) {
    const int in = mod(r - s - 1);
    Tensor buf = incoming.slice(0, 0, bounds[in + 1] - bounds[in]);
    step(mod(r - s), buf);
    if (buf.numel() > 0) kernels::axpby_(1.0, buf, 1.0, chunk(in));  // chunk += buf
  }

  // All-gather: the finished chunks travel once more around the ring, now overwriting. In step
  // s rank r passes on chunk r + 1 - s (finished here or received in the step before) and
  // receives chunk r - s straight into place.
  for (int s = 0; s + 1 < n; ++s) step(mod(r + 1 - s), chunk(mod(r - s)));
}

}  // namespace tandem::parallel::distributed
