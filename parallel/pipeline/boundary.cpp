#include "parallel/pipeline/boundary.h"

#include "core/error.h"

namespace tandem::parallel::pipeline {

LocalBoundary::LocalBoundary(int num_stages, std::chrono::milliseconds timeout)
    : num_stages_(num_stages), timeout_(timeout) {
  TANDEM_CHECK(num_stages >= 1, Value, "LocalBoundary: num_stages must be >= 1, got ", num_stages);
  for (auto& b : box_) b.resize(static_cast<size_t>(num_stages));
}

void LocalBoundary::send(Direction dir, int to_stage, int micro_batch, const Tensor& t,
                         const char* what) {
  TANDEM_CHECK(to_stage >= 0 && to_stage < num_stages_, Value, "pipeline: no stage ", to_stage,
               " to send the ", what, " of micro-batch ", micro_batch, " to (", num_stages_,
               " stages)");
  TANDEM_CHECK(t.defined(), Value, "pipeline: the ", what, " of micro-batch ", micro_batch,
               " for stage ", to_stage, " is undefined");
  auto ready = std::make_shared<Event>();
  ready->record(current_stream(t.device()));
  std::lock_guard<std::mutex> lock(mu_);
  auto& box = box_[dir][to_stage];
  TANDEM_CHECK(box.count(micro_batch) == 0, Value, "pipeline: stage ", to_stage,
               " already has the ", what, " of micro-batch ", micro_batch);
  box.emplace(micro_batch, Message{t, std::move(ready)});
  cv_.notify_all();
}

Tensor LocalBoundary::recv(Direction dir, int stage, int from_stage, int micro_batch, Device device,
                           const char* what) {
  TANDEM_CHECK(from_stage >= 0 && from_stage < num_stages_, Value, "pipeline: stage ", stage,
               " has no stage ", from_stage, " to receive the ", what, " of micro-batch ",
               micro_batch, " from");
  Message msg;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto& box = box_[dir][stage];
    const bool arrived =
        cv_.wait_for(lock, timeout_, [&] { return aborted_ || box.count(micro_batch) > 0; });
    TANDEM_CHECK(!aborted_, Error, "pipeline: stage ", stage, " stopped waiting for the ", what,
                 " of micro-batch ", micro_batch, ": ", abort_reason_);
    TANDEM_CHECK(arrived, Timeout, "pipeline: stage ", stage, " waited ", timeout_.count(),
                 " ms for the ", what, " of micro-batch ", micro_batch, " from stage ", from_stage);
    auto it = box.find(micro_batch);
    msg = std::move(it->second);
    box.erase(it);
  }
  msg.ready->wait(current_stream(device));
  return msg.tensor.to(device);
}

void LocalBoundary::send_activation(int stage, int micro_batch, const Tensor& output) {
  send(kActivation, stage + 1, micro_batch, output, "activation");
}

Tensor LocalBoundary::recv_activation(int stage, int micro_batch, Device device) {
  return recv(kActivation, stage, stage - 1, micro_batch, device, "activation");
}

void LocalBoundary::send_grad(int stage, int micro_batch, const Tensor& input_grad) {
  send(kGrad, stage - 1, micro_batch, input_grad, "gradient");
}

Tensor LocalBoundary::recv_grad(int stage, int micro_batch, Device device) {
  return recv(kGrad, stage, stage + 1, micro_batch, device, "gradient");
}

void LocalBoundary::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) abort_reason_ = why;
  aborted_ = true;
  cv_.notify_all();
}

void LocalBoundary::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& dir : box_) {
    for (auto& box : dir) box.clear();
  }
  aborted_ = false;
  abort_reason_.clear();
}

size_t LocalBoundary::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& dir : box_) {
    for (const auto& box : dir) n += box.size();
  }
  return n;
}

}  // namespace tandem::parallel::pipeline
