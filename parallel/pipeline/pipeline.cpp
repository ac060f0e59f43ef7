#include "parallel/pipeline/pipeline.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "core/allocator.h"
#include "core/error.h"
#include "parallel/device_api.h"
#include "parallel/pipeline/microbatch.h"

namespace tandem::parallel::pipeline {

namespace {

// What a stage keeps of micro-batch m between its forward and its backward (Note [explicit
// stage boundary]): the input leaf, whose .grad goes back to stage s-1, and the output (on the
// last stage, the scaled loss), whose graph holds the micro-batch's activations.
struct Held {
  Tensor input, output;
};

void rethrow_at(const std::string& prefix) {
  try {
    throw;
  } catch (const Error& e) {
    e.rethrow_with_prefix(prefix);
  } catch (const std::exception& e) {
    throw Error(prefix + e.what());
  } catch (...) {
    throw Error(prefix + "unknown exception");
  }
}

}  // namespace

int run_stage(const StageStep& st, Boundary& boundary) {
  const int s = st.stage;
  const bool first = s == 0, last = s == st.num_stages - 1;
  std::map<int, Held> held;
  size_t most = 0;
  for (const Action& a : *st.actions) {
    const int m = a.micro_batch;
    try {
      if (a.kind == Action::Forward) {
        Tensor in =
            first ? (*st.inputs)[m].to(st.device) : boundary.recv_activation(s, m, st.device);
        auto span = Trace::scoped(st.trace, st.device, a.str(), "pipeline");
        if (!first && is_floating(in.dtype())) {
          in = in.detach();  // a leaf of this stage's graph (Note [explicit stage boundary])
          in.set_requires_grad(true);
        }
        Tensor out = st.module->forward(in);
        if (last) {
          Tensor loss = (*st.loss_fn)(out, (*st.targets)[m].to(st.device));
          TANDEM_CHECK(loss.defined() && loss.numel() == 1, Shape,
                       "the loss function must return a one-element loss, got ",
                       loss.defined() ? shape_str(loss.shape()) : "an undefined tensor");
          (*st.losses)[m] = loss.detach();
          out = loss * (*st.weights)[m];  // Note [loss scaling for micro-batches]
        } else {
          boundary.send_activation(s, m, out.detach());
        }
        held[m] = {in, out};
        most = std::max(most, held.size());
      } else {
        auto it = held.find(m);
        TANDEM_CHECK(it != held.end(), Value,
                     "backward of a micro-batch whose forward did not run here");
        Held h = std::move(it->second);
        held.erase(it);
        Tensor grad = last ? Tensor() : boundary.recv_grad(s, m, st.device);
        auto span = Trace::scoped(st.trace, st.device, a.str(), "pipeline");
        if (h.output.requires_grad()) h.output.backward(grad);
        if (!first) {
          Tensor g = h.input.grad();
          boundary.send_grad(s, m,
                             g.defined() ? g : zeros(h.input.shape(), h.input.dtype(), st.device));
        }
      }  // h (the micro-batch's graph and activations) is freed here
    } catch (...) {
      rethrow_at(detail::str("pipeline stage ", s, " (", st.device.str(), ") at ", a.str(), ": "));
    }
  }
  return static_cast<int>(most);
}

Pipeline::Pipeline(std::vector<Stage> stages, Schedule schedule, LossFn loss_fn,
                   PipelineOptions options)
    : stages_(std::move(stages)),
      schedule_(std::move(schedule)),
      loss_fn_(std::move(loss_fn)),
      options_(options) {
  TANDEM_CHECK(!stages_.empty(), Value, "Pipeline: no stages");
  TANDEM_CHECK(schedule_.num_stages == static_cast<int>(stages_.size()), Value,
               "Pipeline: schedule ", schedule_.name, " is for ", schedule_.num_stages,
               " stages but there are ", stages_.size());
  check_schedule(schedule_);
  TANDEM_CHECK(static_cast<bool>(loss_fn_), Value, "Pipeline: no loss function");
  for (size_t s = 0; s < stages_.size(); ++s) {
    const Stage& st = stages_[s];
    TANDEM_CHECK(st.module != nullptr, Value, "Pipeline: stage ", s, " has no module");
    TANDEM_CHECK(st.module->device() == st.device, Device, "Pipeline: stage ", s, " is on ",
                 st.module->device().str(), " but was placed on ", st.device.str());
    devices_.push_back(st.device);
  }
  check_device_list(devices_, "Pipeline");
  workers_ = std::make_unique<DeviceWorkers>(devices_);
  boundary_ = std::make_unique<LocalBoundary>(schedule_.num_stages, options_.timeout);
  stats_.resize(stages_.size());
}

Tensor Pipeline::step(const Tensor& x, const Tensor& target, std::vector<Tensor>* losses_out) {
  TANDEM_CHECK(grad_enabled(), Value,
               "Pipeline::step trains and needs grad mode; use forward() under NoGradGuard");
  TANDEM_CHECK(x.defined() && target.defined() && x.dim() >= 1 && target.dim() >= 1, Shape,
               "Pipeline::step: need an input and a target with a batch dim");
  TANDEM_CHECK(x.size(0) == target.size(0), Shape, "Pipeline::step: input ", shape_str(x.shape()),
               " and target ", shape_str(target.shape()), " differ in rows");
  const int M = schedule_.num_micro_batches, P = schedule_.num_stages;
  const auto xs = split_micro_batches(x, M), ys = split_micro_batches(target, M);
  std::vector<int64_t> sizes;
  for (const Tensor& c : xs) sizes.push_back(c.size(0));
  const auto weights = micro_batch_weights(sizes);
  std::vector<Tensor> losses(static_cast<size_t>(M));

  boundary_->reset();
  for (Device d : devices_) {
    if (d.is_cuda()) reset_max_allocated_bytes(d);
  }
  std::mutex failure_mu;
  std::exception_ptr failure;  // the first stage to fail; the others were aborted by it
  std::vector<int> in_flight(static_cast<size_t>(P), 0);
  workers_->run([&](size_t s) {
    StageStep st;
    st.stage = static_cast<int>(s);
    st.num_stages = P;
    st.module = stages_[s].module.get();
    st.device = devices_[s];
    st.actions = &schedule_.actions[s];
    st.inputs = &xs;
    st.targets = &ys;
    st.weights = &weights;
    st.loss_fn = &loss_fn_;
    st.losses = &losses;
    st.trace = trace_;
    try {
      in_flight[s] = run_stage(st, *boundary_);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(failure_mu);
        if (!failure) failure = std::current_exception();
      }
      boundary_->abort(detail::str("stage ", s, " (", devices_[s].str(), ") failed"));
    }
  });
  if (failure) std::rethrow_exception(failure);

  for (int s = 0; s < P; ++s) {
    stats_[s].max_in_flight = in_flight[s];
    stats_[s].peak_bytes = devices_[s].is_cuda() ? max_allocated_bytes(devices_[s]) : 0;
  }
  DeviceGuard guard(devices_.back());
  NoGradGuard no_grad;
  Tensor total = losses[0] * weights[0];
  for (int m = 1; m < M; ++m) total = total + losses[m] * weights[m];
  if (losses_out != nullptr) *losses_out = losses;
  return total;
}

Tensor Pipeline::forward(const Tensor& x) {
  Tensor h = x;
  for (const Stage& st : stages_) {
    DeviceGuard guard(st.device);
    h = st.module->forward(h.to(st.device));
  }
  return h;
}

std::vector<Tensor> Pipeline::parameters() const {
  std::vector<Tensor> out;
  for (const Stage& st : stages_) {
    for (const Tensor& p : st.module->parameters()) out.push_back(p);
  }
  return out;
}

}  // namespace tandem::parallel::pipeline
