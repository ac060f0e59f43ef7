#pragma once
// Weight gradients on a second stream: see the Note below.
#include <initializer_list>
#include <vector>

#include "core/device.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace tandem::autograd {

// Note [weight gradients on a second stream]
// A layer's backward computes two kinds of gradient from the same dy: the input gradient dx,
// which the next node of the backward needs, and the weight gradient dW, which nothing needs
// until the optimizer. On one stream they run one after the other, so every dW sits on the
// backward's critical path. A small model leaves most of the GPU idle during each of these
// kernels (LeNet's layers launch a few dozen blocks on a GPU with 132 multiprocessors), so the
// dW kernels cost their whole duration for nothing.
//
// So a backward function that writes its weight gradients straight into the leaves' .grad
// (Note [gradients written in place]) may compute them on a second stream of the device -- the
// side stream, two per thread and device (Note [the side stream's priority]) -- while the main
// stream goes on with dx:
//
//     main:  ... dy ready ──fork──► dx ──► next layer's dx ──► ...            ──join──► optimizer
//     side:              └───────► dW, db ──► the next layer's dW, db ──► ... ──┘
//
// - fork: an event recorded on the current stream after dy and the layer's inputs were made;
//   the side stream waits for it, the dW kernels are enqueued there. No host synchronization.
// - keep: the side kernels read tensors (dy, the saved input) that the main stream would free
//   when the node releases them -- in stream order on *its* stream, while the side stream may
//   still read them. The scope keeps them alive until the join.
// - join: the current stream waits for the side stream's last event before anything on it
//   reads a gradient the side stream wrote: before a leaf's hooks run (a DistributedDataParallel
//   bucket), before the engine adds a second gradient into a lent one, before tensor hooks on a
//   leaf, and at the end of every backward pass (also when a node throws) -- so after
//   backward() returns, everything is ordered on the current stream as before. The kept
//   tensors are dropped after the join, when freeing them on the main stream is safe, or at a
//   release point (Note [releasing what the side stream kept]); until then they stay allocated
//   (with neither, every layer's dy and input of ResNet-18's backward lived to its end: 832 MB
//   at the peak instead of 728).
// - A CUDA graph captures the fork and the join as edges between two branches of the graph
//   (the side stream joins the capture through the fork's event), and the side stream's
//   allocations count as the capture's (capture_memory_join in core/allocator.h).
//
// Only gradients that go nowhere but into .grad are forked: a function forks when every weight
// and bias gradient it computes was lent (grad_destination), and only when it also computes
// dx (otherwise there is nothing to run beside them). The values are the same bits: the same
// kernels run, only on another stream. The side stream runs its kernels one after another, so
// two layers' weight gradients never overlap each other, only the main stream's work.
//
// Note [the side stream's priority]: there are two side streams per thread and device, one at
// the main stream's priority and one below it (Background, Note [stream priorities] in
// core/stream.h), and a fork picks by the size of the weight gradient. At equal priority the two
// streams share the GPU as their blocks come: a large weight gradient beside the main stream
// takes the multiprocessors as the input gradient before it drains, and the memory-bound
// batch-norm passes after that input gradient wait behind its blocks (ResNet-18's gradient
// partial sums ran 34-38 us beside a 36 us weight gradient instead of ~10 alone, H100). Below
// the main stream, the main stream's blocks start first and the weight gradient fills the rest.
// But a small weight gradient below the main stream is starved until the step's end, where
// nothing overlaps it: LeNet's step took 3.8% longer with its side stream below (0.0360 s per
// epoch against 0.0347, H100), where ResNet-18's ran 2.0% faster (79.9k images/s against
// 78.4k, same call). So a weight gradient of at least weight_grad_background_macs()
// multiply-adds (default 2^30: ResNet-18's 3x3 convolutions do 15-19 G each, its 1-channel
// stem 0.12 G, LeNet's layers at most 0.06 G) forks to the stream below; a smaller one to the
// stream at equal priority. TANDEM_WGRAD_STREAM_BACKGROUND=1 sends every fork below, =0 none.
//
// On by default on CUDA devices; TANDEM_WGRAD_STREAM=0 or set_weight_grad_stream(false) turns
// it off (every kernel on the current stream, as before). CPU devices never fork.
bool weight_grad_stream();
// The rule above for one backward function: it computes dx (nx), and each weight or bias
// gradient it computes (nw, nb) has its .grad lent (dw_to, db_to defined: grad_destination).
inline bool fork_weight_grads(bool nx, bool nw, const Tensor& dw_to, bool nb, const Tensor& db_to) {
  return nx && (nw || nb) && nw == dw_to.defined() && nb == db_to.defined();
}
void set_weight_grad_stream(bool on);

// How many times this process forked (for tests and benchmarks: that the path was taken).
int64_t weight_grad_stream_forks();

// The least multiply-adds of a weight gradient that forks to the side stream below the main
// one (Note [the side stream's priority]); 0: every fork, INT64_MAX: none.
int64_t weight_grad_background_macs();
void set_weight_grad_background_macs(int64_t macs);
// Run by a backward function around the kernels of its weight gradients: while it lives the
// current stream of `device` is a side stream (when a fork is allowed: a backward pass runs
// on this thread, `device` is a CUDA device, the switch is on) -- the one below the main stream
// when the weight gradients do at least weight_grad_background_macs() multiply-adds -- and
// `keep` stays alive until the join. Otherwise it does nothing and the kernels run on the
// current stream.
class WeightGradStream {
 public:
  WeightGradStream(Device device, std::initializer_list<Tensor> keep, int64_t macs = 0);
  ~WeightGradStream();
  WeightGradStream(const WeightGradStream&) = delete;
  WeightGradStream& operator=(const WeightGradStream&) = delete;
  bool forked() const { return forked_; }

 private:
  Device device_{};
  bool background_ = false;
  Stream prev_{};
  bool forked_ = false;
};

// The current streams wait for everything this thread's backward pass put on side streams,
// and the tensors kept for it are dropped. A no-op when nothing is pending.
void join_weight_grad_streams();

// Note [releasing what the side stream kept]: where the engine only needs to bound what is
// kept -- a second gradient of a non-leaf tensor arrives, each block's input in a ResNet, and
// nothing on the main stream reads what the side stream wrote -- it calls this. It waits one
// release point behind: the main stream waits for the side stream's work up to the previous
// call (an event recorded there), the tensors kept before that call are dropped, and an event
// is recorded on the side stream for the next call -- so the side stream keeps about a block of
// slack and what is kept stays about two blocks' worth. A full join here instead
// (weight_grad_lagged_release() off, TANDEM_WGRAD_LAGGED_RELEASE=0) made the main stream wait
// for the block it had just forked: ResNet-18 (bf16, channels-last, graphed, H100) 74.6-74.8k
// images/s at 728 MB against 75.6-75.7k at 730 MB waiting one block behind, in one call.
void release_weight_grad_inputs();
// A convolution's weight gradient forked after its input gradient is enqueued rather than
// before: the side stream then waits for the input gradient, and the two never overlap; what
// follows the input gradient on the main stream becomes ready with the weight gradient and,
// on the side stream below it, starts first. Measured on ResNet-18 (bf16, channels-last,
// graphed, H100, one call, each against the same default runs at 78.4-78.6k images/s): at equal
// priority 0.8% faster than forking first, but below the main stream slower than forking first
// below it (79.4k against 79.9k) -- so with the large weight gradients below (Note [the side
// stream's priority]) it stays off. TANDEM_WGRAD_AFTER_DGRAD=1 turns it on.
bool weight_grad_after_input_grad();
void set_weight_grad_after_input_grad(bool on);
bool weight_grad_lagged_release();
void set_weight_grad_lagged_release(bool on);

// The engine's part: one per run_backward, installed for this thread (the outer one is
// restored: a hook may run a nested backward). Its destructor joins, also when a node threw.
class WeightGradStreamScope {
 public:
  WeightGradStreamScope();
  ~WeightGradStreamScope();
  WeightGradStreamScope(const WeightGradStreamScope&) = delete;
  WeightGradStreamScope& operator=(const WeightGradStreamScope&) = delete;
  void join();
  void release_marked();  // Note [releasing what the side stream kept]
  bool pending() const { return !devices_.empty(); }

 private:
  friend class WeightGradStream;
  struct Pending {
    Device device;
    bool background;  // which of the device's two side streams
    std::vector<Tensor> keep;    // kept since the last release point
    std::vector<Tensor> marked;  // kept before it: dropped at the next one
  };
  std::vector<Pending> devices_;
  WeightGradStreamScope* prev_;
};

}  // namespace tandem::autograd
