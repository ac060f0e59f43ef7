// The tensor-parallel modes of the test worker (worker_tensor_parallel.h): one shard per rank
// over the process group (Megatron's semantics: every rank computes the same loss), against the
// unsplit model trained in the same process.
#include "distributed/worker_tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <stdexcept>

#include "autograd/ops.h"
#include "core/generator.h"
#include "nn/models/lenet.h"
#include "nn/nn.h"
#include "parallel/distributed/process_group.h"
#include "parallel/tensor_parallel.h"

namespace tandem::test {

namespace {

namespace dist = parallel::distributed;

long flag(const std::vector<std::string>& args, const char* name, long def) {
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == name) return std::stol(args[i + 1]);
  return def;
}

bool has(const std::vector<std::string>& args, const char* name) {
  return std::find(args.begin(), args.end(), name) != args.end();
}

// max |a - b| over max(1, max |b|), in float64 on the host.
double relative(const Tensor& a, const Tensor& b) {
  const auto x = a.detach().to(kCPU).to(kFloat64).to_vector<double>();
  const auto y = b.detach().to(kCPU).to(kFloat64).to_vector<double>();
  if (x.size() != y.size()) throw std::runtime_error("compared tensors differ in size");
  double worst = 0, scale = 1;
  for (size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, std::fabs(x[i] - y[i]));
    scale = std::max(scale, std::fabs(y[i]));
  }
  return worst / scale;
}

std::unique_ptr<nn::optim::Optimizer> optimizer(bool adam, std::vector<Tensor> params) {
  if (adam) return std::make_unique<nn::optim::Adam>(std::move(params), 1e-3);
  return std::make_unique<nn::optim::SGD>(std::move(params), 0.1, 0.9);
}

// Layers [begin, end) of `model`, cloned, on `device`.
std::shared_ptr<nn::SequentialImpl> replicate(const nn::SequentialImpl& model, size_t begin, size_t end,
                                              Device device) {
  auto part = std::make_shared<nn::SequentialImpl>();
  for (size_t l = begin; l < end; ++l) part->push_back(model[l]->clone());
  part->to(device);
  return part;
}

// LeNet (ReLU): layers 0..6 features, 7 Linear(400, 120), 8 ReLU, 9 Linear(120, 84), 10..11 head.
constexpr size_t kFc1 = 7, kFc2 = 9;

// This rank's part of LeNet: the replicated features and head, its shards of fc1 and fc2.
struct RankLeNet {
  std::shared_ptr<nn::SequentialImpl> features, head;
  std::shared_ptr<nn::Module> act;
  parallel::ColumnParallelLinear fc1;
  parallel::RowParallelLinear fc2;

  RankLeNet(const nn::SequentialImpl& lenet, const std::shared_ptr<dist::ProcessGroup>& group)
      : features(replicate(lenet, 0, kFc1, group->device())),
        head(replicate(lenet, kFc2 + 1, lenet.size(), group->device())),
        act(lenet[kFc1 + 1]->clone()),
        fc1(lenet.at<nn::Linear>(kFc1), group),
        fc2(lenet.at<nn::Linear>(kFc2), group) {}

  Tensor forward(const Tensor& x) { return head->forward(fc2(act->forward(fc1(features->forward(x))))); }
  std::vector<Tensor> parameters() const {
    std::vector<Tensor> ps = features->parameters();
    for (const auto& part : {head->parameters(), fc1.parameters(), fc2.parameters()})
      ps.insert(ps.end(), part.begin(), part.end());
    return ps;
  }
};

void run_training(const std::shared_ptr<dist::ProcessGroup>& group, const std::vector<std::string>& args) {
  const int rank = group->rank(), n = group->size();
  const int steps = int(flag(args, "--steps", 3));
  const int64_t batch = flag(args, "--batch", 11);
  const int kill_rank = int(flag(args, "--kill-rank", -1)), kill_step = int(flag(args, "--kill-step", 1));
  const bool adam = has(args, "--adam");
  auto make_lenet = [] {
    Generator gen(21);
    return nn::models::lenet({nn::models::LeNetActivation::ReLU, 10}, gen);
  };
  // The same batches on every rank: images [steps * batch, 1, 28, 28], labels in [0, 10).
  Generator data(23);
  const Tensor images = randn({steps * batch, 1, 28, 28}, kFloat32, kCPU, &data);
  std::vector<int64_t> label_values;
  for (int64_t i = 0; i < steps * batch; ++i) label_values.push_back(int64_t(data.next_u64() % 10));
  const Tensor labels = from_vector<int64_t>(label_values, {steps * batch});
  auto x_of = [&](int k) { return images.slice(0, k * batch, (k + 1) * batch).contiguous().to(group->device()); };
  auto y_of = [&](int k) { return labels.slice(0, k * batch, (k + 1) * batch).contiguous().to(group->device()); };

  auto one = make_lenet();  // the reference: unsplit, in this process
  one->to(group->device());
  std::vector<double> one_losses;
  auto one_opt = optimizer(adam, one->parameters());
  for (int k = 0; k < steps; ++k) {
    one_opt->zero_grad();
    Tensor loss = cross_entropy(one->forward(x_of(k)), y_of(k));
    loss.backward();
    one_opt->step();
    one_losses.push_back(loss.item());
  }

  auto lenet = make_lenet();
  RankLeNet tp(*lenet, group);
  auto opt = optimizer(adam, tp.parameters());
  double loss_err = 0;
  for (int k = 0; k < steps; ++k) {
    if (rank == kill_rank && k == kill_step) std::raise(SIGKILL);
    opt->zero_grad();
    Tensor loss = cross_entropy(tp.forward(x_of(k)), y_of(k));
    loss.backward();  // this rank's own loss, seeded with 1 (Note [tensor-parallel ranks in one graph])
    opt->step();
    loss_err = std::max(loss_err, std::fabs(loss.item() - one_losses[size_t(k)]) / one_losses[size_t(k)]);
  }
  if (kill_rank >= 0) {  // the survivors go on until the failure reaches them
    for (int k = 0; k < 100000; ++k) cross_entropy(tp.forward(x_of(0)), y_of(0)).backward();
  }

  // The replicated layers against the unsplit model's, and a checksum of them for the test to
  // compare across ranks.
  double err = 0, checksum = 0;
  const auto reps = tp.features->parameters(), heads = tp.head->parameters();
  const auto one_reps = replicate(*one, 0, kFc1, kCPU)->parameters(),
             one_heads = replicate(*one, kFc2 + 1, one->size(), kCPU)->parameters();
  for (size_t i = 0; i < reps.size(); ++i) err = std::max(err, relative(reps[i], one_reps[i]));
  for (size_t i = 0; i < heads.size(); ++i) err = std::max(err, relative(heads[i], one_heads[i]));
  for (const auto& part : {reps, heads})
    for (const Tensor& p : part)
      for (double v : p.to(kCPU).to(kFloat64).to_vector<double>()) checksum += v;
  // Each shard against its slice of the unsplit layer.
  const nn::Linear& fc1 = one->at<nn::Linear>(kFc1);
  const nn::Linear& fc2 = one->at<nn::Linear>(kFc2);
  const auto rows = parallel::tensor_parallel_range(fc1.out_features(), n, rank);
  const auto cols = parallel::tensor_parallel_range(fc2.in_features(), n, rank);
  const auto& s1 = tp.fc1.shards().at(0);
  const auto& s2 = tp.fc2.shards().at(0);
  if (s1->out_features() != rows.second - rows.first || s2->in_features() != cols.second - cols.first)
    throw std::runtime_error("a shard's size is not its range's");
  err = std::max(err, relative(s1->weight(), fc1.weight().slice(0, rows.first, rows.second)));
  err = std::max(err, relative(s1->bias(), fc1.bias().slice(0, rows.first, rows.second)));
  err = std::max(err, relative(s2->weight(), fc2.weight().slice(1, cols.first, cols.second)));
  if (rank == 0) err = std::max(err, relative(s2->bias(), fc2.bias()));
  if ((rank == 0) != s2->bias().defined()) throw std::runtime_error("the row-parallel bias is shard 0's alone");
  double forward_err = 0;
  {
    NoGradGuard no_grad;
    forward_err = relative(tp.forward(x_of(0)), one->forward(x_of(0)));
  }
  std::printf("tp rank %d max_rel_err %.3g loss_err %.3g forward_err %.3g replicas %.17g\n", rank, err, loss_err,
              forward_err, checksum);
}

void run_errors(const std::shared_ptr<dist::ProcessGroup>& group) {
  auto caught = [](const char* what, auto&& f) {
    try {
      f();
      std::printf("%s: no error\n", what);
    } catch (const Error& e) {
      std::printf("caught %s: %s\n", what, e.what());
    }
  };
  Generator gen(4);
  const int n = group->size();
  nn::Linear narrow(8, n - 1, true, gen), thin(n - 1, 8, true, gen), fine(8, 2 * n, true, gen);
  caught("column", [&] { parallel::ColumnParallelLinear(narrow, group); });
  caught("row", [&] { parallel::RowParallelLinear(thin, group); });
  parallel::ColumnParallelLinear col(fine, group);
  caught("two inputs", [&] { col.forward(std::vector<Tensor>{ones({2, 8}), ones({2, 8})}); });
  caught("full_weight", [&] { col.full_weight(); });
  // What every rank did pass: still one collective sequence (the errors issued none).
  Tensor y = col(ones({2, 8}));
  if (y.shape() != Shape{2, 2}) throw std::runtime_error("a shard of 2 * n outputs has 2");
  group->barrier();
}

}  // namespace

void run_tensor_parallel(const std::string& mode, const std::shared_ptr<dist::ProcessGroup>& group,
                         const std::vector<std::string>& args) {
  if (mode == "tensor-parallel") return run_training(group, args);
  if (mode == "tensor-parallel-errors") return run_errors(group);
  throw std::runtime_error("unknown mode " + mode);
}

}  // namespace tandem::test
