// The tensor-parallel stepper (--parallel tensor): the first Linear -> activation -> Linear of
// the model split Megatron's way (parallel/tensor_parallel.h), the first Linear by output
// features (ColumnParallelLinear), the second by input features (RowParallelLinear), the
// activation applied per shard; the layers before and after are replicated on every shard.
// The shards are the devices of this process (--devices), or one per process of a job (under a
// launcher: shard = rank). Every shard computes the same loss from the same batch and seeds it
// with 1 (Note [tensor-parallel ranks in one graph]): in one process one backward of the sum,
// in a job each rank its own backward. So the replicas receive the whole gradient and stay
// equal under the same optimizer step, and the numbers are the one-device run's up to rounding.
// In a job every rank reads the whole batch and holds the same epoch numbers; "summing across
// processes" is a broadcast from rank 0 (which also decides a stop vote).
#include <memory>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "common/stepper.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "nn/container.h"
#include "nn/linear.h"
#include "parallel/comm.h"
#include "parallel/distributed/process_group.h"
#include "parallel/tensor_parallel.h"

namespace tandem::examples {

namespace {

class TensorParallelStepper final : public Stepper {
 public:
  explicit TensorParallelStepper(const TrainConfig& cfg) : group_(cfg.group) {
    if (group_) {
      tp_ = parallel::tensor_parallel_comm(group_);
    } else {
      comm_ = parallel::make_communicator(cfg.comm, cfg.devices);
      tp_ = parallel::tensor_parallel_comm(*comm_);
    }
    devices_ = tp_->devices();
    auto model = std::dynamic_pointer_cast<nn::SequentialImpl>(cfg.make_model());
    TANDEM_CHECK(model != nullptr, Value, "--parallel tensor: ", cfg.model_name,
                 " is not a Sequential");
    const int64_t at = tensor_parallel_split_point(*model, tp_->world_size());
    TANDEM_CHECK(at >= 0, Value, "--parallel tensor: ", cfg.model_name,
                 " has no Linear -> activation -> Linear that splits over ", tp_->world_size(), " ",
                 tp_->unit(), "s");
    const auto i = static_cast<size_t>(at);
    for (Device d : devices_) {
      auto before = std::make_shared<nn::SequentialImpl>(), after = std::make_shared<nn::SequentialImpl>();
      for (size_t l = 0; l < i; ++l) before->push_back((*model)[l]->clone());
      for (size_t l = i + 3; l < model->size(); ++l) after->push_back((*model)[l]->clone());
      auto act = (*model)[i + 1]->clone();
      for (nn::Module* m : {static_cast<nn::Module*>(before.get()),
                            static_cast<nn::Module*>(after.get()), act.get()}) {
        m->to(d);
        m->train();
      }
      before_.push_back(before);
      after_.push_back(after);
      act_.push_back(act);
    }
    fc1_ = std::make_unique<parallel::ColumnParallelLinear>(model->at<nn::Linear>(i), tp_);
    fc2_ = std::make_unique<parallel::RowParallelLinear>(model->at<nn::Linear>(i + 2), tp_);
    std::vector<Tensor> params;
    for (size_t r = 0; r < devices_.size(); ++r) {
      for (const Tensor& p : before_[r]->parameters()) params.push_back(p);
      for (const Tensor& p : after_[r]->parameters()) params.push_back(p);
    }
    for (const Tensor& p : fc1_->parameters()) params.push_back(p);
    for (const Tensor& p : fc2_->parameters()) params.push_back(p);
    opt_ = make_optimizer(cfg, params);
    eval_ =
        std::make_shared<FunctionModule>("TensorParallel", [this](const Tensor& x) { return forward(x)[0]; });
    eval_->to(devices_.front());
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t, const Tensor& loss_sum,
            const Tensor& correct) override {
    set_training(true);
    const data::Batch b = data.get(index);
    opt_->zero_grad();
    const std::vector<Tensor> outs = forward(b.x);
    Tensor total;
    Tensor loss0;
    for (size_t r = 0; r < devices_.size(); ++r) {
      Tensor loss = cross_entropy(outs[r], b.y.to(devices_[r]));
      if (r == 0) loss0 = loss;
      total = r == 0 ? loss : total + to_device(loss, devices_.front());
    }
    total.backward();
    opt_->step();
    kernels::axpby_(static_cast<double>(b.x.size(0)), loss0.detach(), 1.0, loss_sum);
    kernels::count_correct(outs[0].detach(), b.y, correct);
  }
  // Every rank holds the same numbers; rank 0's are the job's.
  void sum_across_processes(const Tensor& t) override {
    if (group_) group_->broadcast(t, 0)->wait();
  }
  void set_lr(double lr) override { opt_->set_lr(lr); }
  nn::Module& eval_model() override {
    set_training(false);  // step() sets training mode again
    return *eval_;
  }
  // The replica on the first shard held here (without the split layers): what check_weights
  // reads.
  nn::Module& model() override { return *before_.front(); }
  nn::optim::Optimizer& optimizer() override { return *opt_; }

  // The first i such that layers i, i + 1, i + 2 are Linear, a parameter-free activation and
  // Linear, with fc1's outputs = fc2's inputs >= n (one feature per shard at least); -1 if none.
  static int64_t tensor_parallel_split_point(const nn::SequentialImpl& model, int64_t n) {
    for (size_t i = 0; i + 2 < model.size(); ++i) {
      auto* a = dynamic_cast<nn::Linear*>(model[i].get());
      auto* b = dynamic_cast<nn::Linear*>(model[i + 2].get());
      const std::string act = model[i + 1]->name();
      if (a && b && (act == "ReLU" || act == "Sigmoid") && a->out_features() == b->in_features() &&
          a->out_features() >= n)
        return static_cast<int64_t>(i);
    }
    return -1;
  }

 private:
  std::vector<Tensor> forward(const Tensor& x) {
    std::vector<Tensor> hs;
    for (size_t r = 0; r < devices_.size(); ++r)
      hs.push_back(before_[r]->forward(x.to(devices_[r])));
    std::vector<Tensor> a = (*fc1_)(hs);
    for (size_t r = 0; r < a.size(); ++r) a[r] = act_[r]->forward(a[r]);
    std::vector<Tensor> b = (*fc2_)(a);
    for (size_t r = 0; r < b.size(); ++r) b[r] = after_[r]->forward(b[r]);
    return b;
  }
  void set_training(bool on) {
    for (size_t r = 0; r < devices_.size(); ++r) {
      before_[r]->train(on);
      after_[r]->train(on);
    }
  }

  std::shared_ptr<parallel::distributed::ProcessGroup> group_;  // a job: one shard per rank
  std::unique_ptr<parallel::Communicator> comm_;                  // one process: every shard
  std::shared_ptr<parallel::TensorParallelComm> tp_;
  std::vector<Device> devices_;  // the shards held here
  std::vector<std::shared_ptr<nn::SequentialImpl>> before_, after_;
  std::vector<std::shared_ptr<nn::Module>> act_;
  std::unique_ptr<parallel::ColumnParallelLinear> fc1_;
  std::unique_ptr<parallel::RowParallelLinear> fc2_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
  std::shared_ptr<FunctionModule> eval_;
};

}  // namespace

int64_t tensor_parallel_split_point(const nn::SequentialImpl& model, int64_t num_devices) {
  return TensorParallelStepper::tensor_parallel_split_point(model, num_devices);
}

std::unique_ptr<Stepper> make_tensor_parallel_stepper(const TrainConfig& cfg) {
  return std::make_unique<TensorParallelStepper>(cfg);
}

}  // namespace tandem::examples
