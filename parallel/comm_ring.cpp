// The ring allreduce, from scratch, in the same Tensor::copy_ + kernels vocabulary as the
// rest of tandem: the same code runs on virtual CPU devices and on GPUs.
//
// Note [ring allreduce cost]
// Cut a buffer of N bytes into n chunks, one per device. Reduce-scatter: in each of n-1
// steps, device i sends one chunk to device i+1, which adds it into its own copy of that
// chunk; afterwards device i holds the complete sum of chunk i+1. All-gather: n-1 more steps
// pass the finished chunks around the ring. Every device sends and receives 2(n-1) chunks,
// 2(n-1)/n * N bytes, which tends to 2N however many devices there are, and every link is
// busy in every step. The naive version pushes 2(n-1) * N bytes through device 0's link
// alone. This is why NCCL reports "bus bandwidth" = N / time * 2(n-1)/n: the rate each link
// actually sustained, comparable across device counts. Latency is 2(n-1) steps, so for
// tiny buffers the naive version (or a tree) can win.
//
// Note [ring streams]
// Tensor::copy_ between devices runs on the destination's current stream after the source's,
// and makes the source's stream wait for the copy. If every copy of a step ran on the
// compute streams, the copy into device i+1 would queue behind device i+1's own send and the
// whole step would run as one serial chain. So each device receives on its own stream:
//   1. each receiving stream waits for its device's compute stream (the receive buffer is
//      free, earlier adds are done);
//   2. every copy of the step is enqueued with the receiver's receive stream current: the n
//      copies then run at the same time, one per link;
//   3. each compute stream waits for its receive stream and, in reduce-scatter, adds.
// Events only, no host synchronization. On CPU devices streams and events are no-ops and the
// same code simply runs in order.
#include "kernels/ops.h"
#include "parallel/comm.h"

namespace tandem::parallel {

struct RingCommunicator::Ring {
  struct Transfer {
    size_t from, to, chunk;
  };

  RingCommunicator& comm;
  std::vector<Tensor> flat;     // per device: [numel], contiguous, aliasing the input if it can
  std::vector<int64_t> bounds;  // chunk c is elements [bounds[c], bounds[c + 1])
  std::vector<Tensor> recv;     // per device: [largest chunk], reduce-scatter's receive buffer

  Ring(RingCommunicator& c, const std::vector<Tensor>& ts) : comm(c) {
    const size_t n = ts.size();
    const int64_t numel = ts[0].numel();
    bounds.push_back(0);
    for (size_t i = 0; i < n; ++i) {  // uneven: the first numel % n chunks get one more
      bounds.push_back(bounds.back() + numel / int64_t(n) + (int64_t(i) < numel % int64_t(n)));
    }
    for (size_t i = 0; i < n; ++i) {
      DeviceGuard device(ts[i].device());
      flat.push_back(flat_view(ts[i]));
    }
  }

  Tensor chunk(size_t dev, size_t c) const { return flat[dev].slice(0, bounds[c], bounds[c + 1]); }
  int64_t chunk_len(size_t c) const { return bounds[c + 1] - bounds[c]; }

  // One step of concurrent copies (every `to` distinct); reduce: add into the receiver's chunk
  // instead of overwriting it. See Note [ring streams].
  void step(const std::vector<Transfer>& transfers, bool reduce) {
    const auto& devs = comm.devices();
    for (const Transfer& t : transfers) {
      comm.ready_[t.to].record(current_stream(devs[t.to]));
      comm.ready_[t.to].wait(comm.recv_streams_[t.to]);
    }
    for (const Transfer& t : transfers) {
      if (chunk_len(t.chunk) == 0) continue;
      DeviceGuard device(devs[t.to]);
      StreamGuard stream(comm.recv_streams_[t.to]);
      Tensor dst = reduce ? recv[t.to].slice(0, 0, chunk_len(t.chunk)) : chunk(t.to, t.chunk);
      dst.copy_(chunk(t.from, t.chunk));
    }
    for (const Transfer& t : transfers) {
      comm.received_[t.to].record(comm.recv_streams_[t.to]);
      comm.received_[t.to].wait(current_stream(devs[t.to]));
      if (reduce && chunk_len(t.chunk) > 0) {
        DeviceGuard device(devs[t.to]);
        kernels::binary_(BinaryOp::Add, chunk(t.to, t.chunk),
                         recv[t.to].slice(0, 0, chunk_len(t.chunk)));
      }
    }
  }

  // Afterwards device i holds the sum over all devices of chunk i+1.
  void reduce_scatter() {
    const size_t n = flat.size();
    for (size_t i = 0; i < n; ++i) {
      DeviceGuard device(comm.devices()[i]);
      recv.push_back(empty({chunk_len(0)}, flat[i].dtype(), comm.devices()[i]));
    }
    for (size_t s = 0; s + 1 < n; ++s) {
      std::vector<Transfer> sends;  // device i sends chunk i - s
      for (size_t i = 0; i < n; ++i) sends.push_back({i, (i + 1) % n, (i + n - s) % n});
      step(sends, /*reduce=*/true);
    }
  }

  // Precondition: device i holds the final chunk i+1. Afterwards every device holds all.
  void all_gather() {
    const size_t n = flat.size();
    for (size_t s = 0; s + 1 < n; ++s) {
      std::vector<Transfer> sends;  // device i passes on chunk i + 1 - s
      for (size_t i = 0; i < n; ++i) sends.push_back({i, (i + 1) % n, (i + 1 + n - s) % n});
      step(sends, /*reduce=*/false);
    }
  }
};

RingCommunicator::RingCommunicator(std::vector<Device> devices)
    : Communicator(std::move(devices)) {
  for (Device d : this->devices()) {
    recv_streams_.push_back(Stream::create(d));
    ready_.emplace_back();
    received_.emplace_back();
  }
}

void RingCommunicator::allreduce_sum(const std::vector<Tensor>& ts) {
  check_tensors("allreduce_sum", ts);
  if (ts.size() == 1 || ts[0].numel() == 0) return;
  Ring ring(*this, ts);
  ring.reduce_scatter();
  ring.all_gather();
  for (size_t i = 0; i < ts.size(); ++i) copy_back_if_needed(ts[i], ring.flat[i]);
}

// Scatter + all-gather (bandwidth-optimal, like the allreduce's second half): the root hands
// chunk i+1 to device i, then the all-gather completes every device. The root's n-1 sends are
// ordered one after another on its stream (see Note [ring streams]); this is the cheap half.
void RingCommunicator::broadcast(const std::vector<Tensor>& ts, size_t root) {
  check_tensors("broadcast", ts);
  check_root("broadcast", root);
  const size_t n = ts.size();
  if (n == 1 || ts[0].numel() == 0) return;
  Ring ring(*this, ts);
  std::vector<Ring::Transfer> sends;
  for (size_t i = 0; i < n; ++i) {
    if (i != root) sends.push_back({root, i, (i + 1) % n});
  }
  ring.step(sends, /*reduce=*/false);
  ring.all_gather();
  for (size_t i = 0; i < n; ++i) copy_back_if_needed(ts[i], ring.flat[i]);
}

}  // namespace tandem::parallel
