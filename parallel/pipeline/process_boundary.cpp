#include "parallel/pipeline/process_boundary.h"

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "core/error.h"
#include "parallel/device_api.h"
#include "parallel/pipeline/microbatch.h"

namespace tandem::parallel::pipeline {

namespace {

const char* what_name(int what) {
  return what == 0 ? "activation" : "gradient";
}

constexpr int64_t kNumDTypes = 5;  // DType's values, for checking a received header

std::string header_str(const std::vector<int64_t>& h) {
  std::string dims;
  const int64_t nd = h[3];
  if (nd < 0 || nd > ProcessBoundary::kMaxDims) return "a malformed header";
  for (int64_t i = 0; i < nd; ++i) dims += (i ? ", " : "") + std::to_string(h[4 + i]);
  const std::string dtype =
      h[2] >= 0 && h[2] < kNumDTypes ? dtype_name(static_cast<DType>(h[2])) : "dtype ?";
  return detail::str(h[0] == 0   ? "the activation"
                     : h[0] == 1 ? "the gradient"
                                 : "something",
                     " of micro-batch ", h[1], " (", dtype, " [", dims, "])");
}

}  // namespace

ProcessBoundary::ProcessBoundary(std::shared_ptr<distributed::ProcessGroup> group)
    : group_(std::move(group)) {
  TANDEM_CHECK(group_ != nullptr, Value, "ProcessBoundary: no process group");
}

// Note [sent tensors are released]
// A sent payload must stay alive until its send has completed, but not much longer: under 1F1B
// stage s's output for micro-batch m is the activation it sent, and once m's backward has run,
// the pending send is the only thing that still holds it. Kept until the end of the step, the
// sent activations (stages s < P - 1) and gradients (s > 0) of all M micro-batches pile up, and
// 1F1B's memory grows with M like GPipe's: measured with micro-batches of 16 rows of 256
// floats, stage 0's peak was 0.30, 0.49 and 0.69 MB above the gradients for M = 1, 4, 16;
// with the release below it is 0.30, 0.46, 0.46 (two micro-batches in flight).
// Gloo cannot ask a send whether it is done without waiting, but the schedule can say it: a
// message from neighbour n that n sent at its action a proves that n has received every
// message of ours that it takes at an action before a (its actions run in order). An
// activation of ours is taken at n's F(m), a gradient at n's B(m). So each receive from n waits
// for those sends -- already complete, the wait only collects them -- and lets their tensors
// go: the activation sent for micro-batch m goes when m's gradient comes back, the gradient
// sent for m when the next activation from the stage before arrives.
int ProcessBoundary::position(int stage, What what, int micro_batch) const {
  if (schedule_ == nullptr || stage < 0 || stage >= static_cast<int>(schedule_->actions.size()))
    return -1;
  const auto& actions = schedule_->actions[static_cast<size_t>(stage)];
  const Action::Kind kind = what == kActivation ? Action::Forward : Action::Backward;
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].micro_batch == micro_batch && actions[i].kind == kind) return static_cast<int>(i);
  return -1;
}

void ProcessBoundary::release_received(int peer, int at) {
  if (at < 0) return;
  size_t kept = 0;
  for (Pending& p : pending_) {
    if (p.to == peer && p.received_at >= 0 && p.received_at < at) {
      p.work->wait();  // complete: collects it (and rethrows a failure)
    } else {
      pending_[kept++] = std::move(p);
    }
  }
  pending_.resize(kept);
}

void ProcessBoundary::send(What what, int to, int micro_batch, const Tensor& t) {
  const int stage = group_->rank();
  TANDEM_CHECK(to >= 0 && to < group_->size(), Value, "pipeline: stage ", stage, " has no stage ",
               to, " to send the ", what_name(what), " of micro-batch ", micro_batch, " to (",
               group_->size(), " processes)");
  TANDEM_CHECK(t.defined(), Value, "pipeline: the ", what_name(what), " of micro-batch ",
               micro_batch, " from stage ", stage, " is undefined");
  TANDEM_CHECK(t.dim() <= kMaxDims, Shape, "pipeline: stage ", stage, " cannot send a ",
               what_name(what), " of ", t.dim(), " dims (at most ", kMaxDims, ")");
  std::vector<int64_t> h(kHeaderSize, 0);
  h[0] = what;
  h[1] = micro_batch;
  h[2] = static_cast<int64_t>(t.dtype());
  h[3] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) h[4 + i] = t.size(i);
  const Device dev = group_->device();
  Tensor header = from_vector<int64_t>(h, {kHeaderSize}).to(dev);
  Tensor payload = t.to(dev).contiguous();
  if (what == kActivation) {
    if (sent_shape_.size() <= static_cast<size_t>(micro_batch))
      sent_shape_.resize(static_cast<size_t>(micro_batch) + 1);
    sent_shape_[static_cast<size_t>(micro_batch)] = t.shape();
  }
  // Not waited for here (Note [process boundary messages]): a later receive or finish() does.
  const int at = position(to, what, micro_batch);
  pending_.push_back({group_->send(header, to), header, to, at});
  pending_.push_back({group_->send(payload, to), payload, to, at});
}

Tensor ProcessBoundary::recv(What what, int stage, int from, int micro_batch, Device device) {
  TANDEM_CHECK(!aborted_, Error, "pipeline: stage ", stage, " stopped waiting for the ",
               what_name(what), " of micro-batch ", micro_batch, ": ", abort_reason_);
  TANDEM_CHECK(from >= 0 && from < group_->size(), Value, "pipeline: stage ", stage,
               " has no stage ", from, " to receive the ", what_name(what), " of micro-batch ",
               micro_batch, " from");
  const Device dev = group_->device();
  Tensor header = zeros({kHeaderSize}, kInt64, dev);
  group_->recv(header, from)->wait();
  const std::vector<int64_t> h = header.to(kCPU).to_vector<int64_t>();
  const std::string expected =
      detail::str("the ", what_name(what), " of micro-batch ", micro_batch);
  TANDEM_CHECK(h[0] == what && h[1] == micro_batch && h[2] >= 0 && h[2] < kNumDTypes && h[3] >= 0 &&
                   h[3] <= kMaxDims,
               Value, "pipeline: stage ", stage, " expected ", expected, " from stage ", from,
               " but received ", header_str(h), " (do the ranks run the same schedule?)");
  std::vector<int64_t> shape(h.begin() + 4, h.begin() + 4 + h[3]);
  if (what == kGrad) {
    const auto m = static_cast<size_t>(micro_batch);
    TANDEM_CHECK(m < sent_shape_.size() && !sent_shape_[m].empty(), Value, "pipeline: stage ",
                 stage, " received ", header_str(h), " from stage ", from,
                 " but sent no activation of that micro-batch");
    TANDEM_CHECK(shape == sent_shape_[m], Shape, "pipeline: stage ", stage, " received ",
                 header_str(h), " from stage ", from, " for an activation of shape ",
                 shape_str(sent_shape_[m]));
  }
  Tensor payload = empty(shape, static_cast<DType>(h[2]), dev);
  group_->recv(payload, from)->wait();
  release_received(from, position(from, what, micro_batch));
  return payload.to(device);
}

void ProcessBoundary::send_activation(int stage, int micro_batch, const Tensor& output) {
  send(kActivation, stage + 1, micro_batch, output);
}

Tensor ProcessBoundary::recv_activation(int stage, int micro_batch, Device device) {
  return recv(kActivation, stage, stage - 1, micro_batch, device);
}

void ProcessBoundary::send_grad(int stage, int micro_batch, const Tensor& input_grad) {
  send(kGrad, stage - 1, micro_batch, input_grad);
}

Tensor ProcessBoundary::recv_grad(int stage, int micro_batch, Device device) {
  return recv(kGrad, stage, stage + 1, micro_batch, device);
}

void ProcessBoundary::abort(const std::string& why) {
  if (!aborted_) abort_reason_ = why;
  aborted_ = true;
}

void ProcessBoundary::finish() {
  std::vector<Pending> pending = std::move(pending_);
  pending_.clear();
  sent_shape_.clear();
  for (Pending& p : pending) p.work->wait();
}

Stage stage_of_balance(const nn::SequentialImpl& model, const std::vector<int64_t>& balance, int stage,
                       Device device) {
  const auto P = balance.size();
  TANDEM_CHECK(P >= 1 && P <= model.size(), Value, "stage_of_balance: ", P,
               " stages for a Sequential of ", model.size(), " layers; every stage needs a layer");
  TANDEM_CHECK(stage >= 0 && static_cast<size_t>(stage) < P, Value, "stage_of_balance: no stage ",
               stage, " in balance ", balance_str(balance));
  int64_t total = 0;
  size_t begin = 0;
  for (size_t s = 0; s < P; ++s) {
    TANDEM_CHECK(balance[s] >= 1, Value, "stage_of_balance: balance ", balance_str(balance),
                 " gives stage ", s, " ", balance[s], " layers; every stage needs at least one");
    if (s < static_cast<size_t>(stage)) begin += static_cast<size_t>(balance[s]);
    total += balance[s];
  }
  TANDEM_CHECK(total == static_cast<int64_t>(model.size()), Value, "stage_of_balance: balance ",
               balance_str(balance), " adds up to ", total, " layers but the Sequential has ",
               model.size());
  const size_t end = begin + static_cast<size_t>(balance[static_cast<size_t>(stage)]);
  auto piece = std::make_shared<nn::SequentialImpl>();
  for (size_t i = begin; i < end; ++i) piece->push_back(model[i]);
  piece->train(model.is_training());
  piece->to(device);
  return {piece, device, begin, end};
}

// ---- ProcessPipeline --------------------------------------------------------------------

ProcessPipeline::ProcessPipeline(Stage stage, Schedule schedule, LossFn loss_fn,
                                 std::shared_ptr<distributed::ProcessGroup> group)
    : stage_(std::move(stage)),
      schedule_(std::move(schedule)),
      loss_fn_(std::move(loss_fn)),
      group_(group),
      stage_index_(group ? group->rank() : 0),
      boundary_(group) {
  boundary_.set_schedule(&schedule_);
  TANDEM_CHECK(schedule_.num_stages == group_->size(), Value, "ProcessPipeline: schedule ",
               schedule_.name, " is for ", schedule_.num_stages, " stages but the group has ",
               group_->size(), " processes (one per stage)");
  check_schedule(schedule_);
  TANDEM_CHECK(static_cast<bool>(loss_fn_), Value, "ProcessPipeline: no loss function");
  TANDEM_CHECK(stage_.module != nullptr, Value, "ProcessPipeline: stage ", stage_index_,
               " has no module");
  TANDEM_CHECK(stage_.module->device() == stage_.device, Device, "ProcessPipeline: stage ",
               stage_index_, " is on ", stage_.module->device().str(), " but was placed on ",
               stage_.device.str());
}

Tensor ProcessPipeline::broadcast_from_last(const Tensor& t) {
  const int root = group_->size() - 1;
  const Device dev = group_->device();
  std::vector<int64_t> h(ProcessBoundary::kHeaderSize, 0);
  if (stage_index_ == root) {
    TANDEM_CHECK(t.dim() <= ProcessBoundary::kMaxDims, Shape, "pipeline: the last stage's ",
                 shape_str(t.shape()), " has too many dims to broadcast");
    h[2] = static_cast<int64_t>(t.dtype());
    h[3] = t.dim();
    for (int64_t i = 0; i < t.dim(); ++i) h[4 + i] = t.size(i);
  }
  Tensor header = from_vector<int64_t>(h, {ProcessBoundary::kHeaderSize}).to(dev);
  group_->broadcast(header, root)->wait();
  h = header.to(kCPU).to_vector<int64_t>();
  std::vector<int64_t> shape(h.begin() + 4, h.begin() + 4 + h[3]);
  Tensor out = stage_index_ == root ? t.to(dev).contiguous().clone()
                                    : empty(shape, static_cast<DType>(h[2]), dev);
  group_->broadcast(out, root)->wait();
  return out;
}

Tensor ProcessPipeline::step(const Tensor& x, const Tensor& target,
                             std::vector<Tensor>* losses_out) {
  TANDEM_CHECK(grad_enabled(), Value,
               "ProcessPipeline::step trains and needs grad mode; use forward() under "
               "NoGradGuard");
  TANDEM_CHECK(x.defined() && target.defined() && x.dim() >= 1 && target.dim() >= 1, Shape,
               "ProcessPipeline::step: need an input and a target with a batch dim");
  TANDEM_CHECK(x.size(0) == target.size(0), Shape, "ProcessPipeline::step: input ",
               shape_str(x.shape()), " and target ", shape_str(target.shape()), " differ in rows");
  const int M = schedule_.num_micro_batches, P = schedule_.num_stages, s = stage_index_;
  const auto xs = split_micro_batches(x, M), ys = split_micro_batches(target, M);
  std::vector<int64_t> sizes;
  for (const Tensor& c : xs) sizes.push_back(c.size(0));
  const auto weights = micro_batch_weights(sizes);
  std::vector<Tensor> losses(static_cast<size_t>(M));

  StageStep st;
  st.stage = s;
  st.num_stages = P;
  st.module = stage_.module.get();
  st.device = stage_.device;
  st.actions = &schedule_.actions[static_cast<size_t>(s)];
  st.inputs = &xs;
  st.targets = &ys;
  st.weights = &weights;
  st.loss_fn = &loss_fn_;
  st.losses = &losses;
  st.trace = trace_;
  try {
    max_in_flight_ = run_stage(st, boundary_);
    boundary_.finish();
  } catch (...) {
    boundary_.abort(detail::str("stage ", s, " failed"));
    throw;
  }

  // The last stage's [total, loss_0, ..., loss_{M-1}] to every rank.
  Tensor mine;
  if (s == P - 1) {
    NoGradGuard no_grad;
    DeviceGuard guard(stage_.device);
    Tensor total = losses[0] * weights[0];
    for (int m = 1; m < M; ++m) total = total + losses[m] * weights[m];
    std::vector<Tensor> parts{total.reshape({1})};
    for (const Tensor& l : losses) parts.push_back(l.reshape({1}));
    mine = cat(parts, 0);
  }
  Tensor all = broadcast_from_last(mine);
  if (losses_out != nullptr) {
    losses_out->clear();
    for (int m = 0; m < M; ++m) losses_out->push_back(all.slice(0, m + 1, m + 2).reshape(Shape{}));
  }
  return all.slice(0, 0, 1).reshape(Shape{});
}

Tensor ProcessPipeline::forward(const Tensor& x) {
  const int s = stage_index_, P = group_->size();
  Tensor out;
  try {
    DeviceGuard guard(stage_.device);
    Tensor in = s == 0 ? x.to(stage_.device) : boundary_.recv_activation(s, 0, stage_.device);
    out = stage_.module->forward(in);
    if (s < P - 1) boundary_.send_activation(s, 0, out.detach());
    boundary_.finish();
  } catch (...) {
    boundary_.abort(detail::str("stage ", s, " failed"));
    throw;
  }
  return broadcast_from_last(s == P - 1 ? out.detach() : Tensor());
}

}  // namespace tandem::parallel::pipeline
