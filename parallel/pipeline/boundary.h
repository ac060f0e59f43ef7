#pragma once
// Stage boundaries: how a micro-batch's activation travels from stage s to stage s+1 and its
// gradient back from s+1 to s. The executor (pipeline.h) talks to its neighbours only through
// this interface, so the schedule and the stage loop stay the same whether the neighbour is a
// thread of this process (LocalBoundary, below) or another process (send/recv on a process
// group, a later implementation of the same four calls).
//
// Note [explicit stage boundary]
// Autograd does not cross a boundary. Stage s's forward takes its input as a fresh leaf that
// requires grad and keeps (input, output) per micro-batch; its backward runs
// output.backward(grad from stage s+1) and sends input.grad to stage s-1. That is what one
// process per stage must do (a graph cannot span processes), so the in-process version does
// it the same way rather than through a differentiable to(device), and each stage's backward
// is a separate graph that its own thread runs.
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"

namespace tandem::parallel::pipeline {

class Boundary {
 public:
  virtual ~Boundary() = default;
  // Stage `stage` hands micro-batch m's output to stage + 1 (no autograd history goes along).
  virtual void send_activation(int stage, int micro_batch, const Tensor& output) = 0;
  // Stage `stage` takes micro-batch m's input from stage - 1, on `device`.
  virtual Tensor recv_activation(int stage, int micro_batch, Device device) = 0;
  // Stage `stage` hands the gradient of micro-batch m's input back to stage - 1.
  virtual void send_grad(int stage, int micro_batch, const Tensor& input_grad) = 0;
  // Stage `stage` takes the gradient of micro-batch m's output from stage + 1, on `device`.
  virtual Tensor recv_grad(int stage, int micro_batch, Device device) = 0;
  // Makes every receive waiting now or later throw (a stage failed; its neighbours must not
  // wait for what it will never send).
  virtual void abort(const std::string& why) = 0;
};

// Neighbouring stages in one process, each on its own thread: a mailbox per stage and
// direction. A send records an event on the sender's current stream after the tensor was
// produced; the receive makes its own stream wait for that event and copies the tensor to its
// device (Note [cross-device ordering] in kernels/tensor_methods.cpp), so GPUs never wait on
// the host. A receive waits at most `timeout`, then throws TimeoutError naming the stage, the
// micro-batch and what it waited for.
class LocalBoundary : public Boundary {
 public:
  LocalBoundary(int num_stages, std::chrono::milliseconds timeout);

  void send_activation(int stage, int micro_batch, const Tensor& output) override;
  Tensor recv_activation(int stage, int micro_batch, Device device) override;
  void send_grad(int stage, int micro_batch, const Tensor& input_grad) override;
  Tensor recv_grad(int stage, int micro_batch, Device device) override;
  void abort(const std::string& why) override;
  // Empties every mailbox and clears an abort, for the next step.
  void reset();
  // Messages sent but not received (0 after a complete step).
  size_t pending() const;

 private:
  struct Message {
    Tensor tensor;
    std::shared_ptr<Event> ready;  // recorded on the sender's stream after the tensor
  };
  enum Direction { kActivation = 0, kGrad = 1 };
  void send(Direction dir, int to_stage, int micro_batch, const Tensor& t, const char* what);
  Tensor recv(Direction dir, int stage, int from_stage, int micro_batch, Device device,
              const char* what);

  int num_stages_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::map<int, Message>> box_[2];  // [direction][receiving stage][micro-batch]
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace tandem::parallel::pipeline
