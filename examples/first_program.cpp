// Your first tandem program (docs/00-first-program.md): a 2-layer MLP learns which quadrant
// pairs a 2-D point lies in, with Adam, a DataLoader over a TensorDataset, accuracy measured
// under NoGradGuard, and a save and load. Run by itself it trains in one process; started by
// tandem-run it trains the same model under DistributedDataParallel, one process per rank,
// each reading its share of every batch through a DistributedSampler:
//
//   first_program [out_dir]                                   one process
//   tandem-run --nproc-per-node 2 first_program [out_dir]     two processes over Gloo
//
// The global batch is 64 rows either way (split 32 + 32 over two ranks, Note [global batches
// across ranks] in data/dataloader.h), so both runs take the same steps and print the same
// numbers, up to the order in which float sums are added.
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include <tandem/tandem.h>

using namespace tandem;
namespace dist = tandem::parallel::distributed;

int main(int argc, char** argv) {
  const std::string out_dir = argc > 1 ? argv[1] : ".";
  manual_seed(0);  // torch::manual_seed(0): the same data and initial weights on every run

  // One process, or one of several started by tandem-run (RANK, WORLD_SIZE, ... are set).
  const bool distributed = dist::launched_by_launcher();
  dist::DistributedContext ctx;
  if (distributed) ctx = dist::init_process_group("gloo", kCPU);
  const int rank = distributed ? ctx.env.rank : 0;
  const int world_size = distributed ? ctx.env.world_size : 1;
  const bool main_rank = rank == 0;

  // ---- data: 1024 points, class 1 when both coordinates have the same sign -----------------
  const Tensor x = randn({1024, 2});                                                   // [N, 2]
  const Tensor y = (x.select(1, 0) * x.select(1, 1) > 0).to(kInt64);                   // [N]
  const Tensor x_train = x.slice(0, 0, 896), y_train = y.slice(0, 0, 896);
  const Tensor x_test = x.slice(0, 896, 1024), y_test = y.slice(0, 896, 1024);
  if (main_rank) {
    std::cout << "first points:\n" << x.slice(0, 0, 3) << "\n";
    std::cout << "their labels: " << y.slice(0, 0, 3) << "\n";
    std::cout << "class 1 in the training set: " << y_train.sum().item<int64_t>() << " of "
              << y_train.size(0) << "\n";
  }

  // ---- model, optimizer, loader -----------------------------------------------------------
  nn::Sequential model(nn::Linear(2, 32), nn::ReLU(), nn::Linear(32, 2));
  if (main_rank) std::cout << model << "\n";
  // Under tandem-run: rank 0's weights are broadcast, gradients averaged while backward runs.
  std::optional<dist::DistributedDataParallel> ddp;
  if (distributed) ddp.emplace(model, ctx.group);
  std::shared_ptr<data::DistributedSampler> sampler;
  if (distributed) {
    sampler = std::make_shared<data::DistributedSampler>(x_train.size(0), world_size, rank);
  }
  data::DataLoader loader(data::TensorDataset(x_train, y_train),
                          {.batch_size = 64, .shuffle = true, .sampler = sampler});
  nn::optim::Adam optimizer(model->parameters(), nn::optim::AdamOptions(1e-2));

  // Accuracy of `net` on the test set: the share of rows whose largest logit is the label.
  const auto accuracy = [&](nn::Sequential& net) {
    NoGradGuard no_grad;  // evaluation records no graph
    net->eval();
    const Tensor predicted = net(x_test).argmax(1);  // [128] int64
    const double acc = (predicted == y_test).to(kFloat32).mean().item<double>();
    net->train();
    return acc;
  };

  // ---- training ---------------------------------------------------------------------------
  for (int64_t epoch = 1; epoch <= 5; ++epoch) {
    if (sampler) sampler->set_epoch(epoch - 1);  // a new shuffle, the same on every rank
    double loss_sum = 0, rows = 0;  // this rank's summed batch loss * rows, and its rows
    for (const data::Batch& b : loader) {
      const Tensor logits = ddp ? (*ddp)(b.x) : model(b.x);  // [B, 2]
      const Tensor loss = cross_entropy(logits, b.y);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      loss_sum += loss.item<double>() * static_cast<double>(b.x.size(0));
      rows += static_cast<double>(b.x.size(0));
    }
    Tensor totals = tensor({loss_sum, rows}, kFloat64);             // [2]
    if (distributed) ctx.group->allreduce(totals)->wait();          // summed over the ranks
    const double mean_loss = (totals.select(0, 0) / totals.select(0, 1)).item<double>();
    if (main_rank) std::printf("epoch %lld  loss %.4f  test accuracy %.4f\n",
                               static_cast<long long>(epoch), mean_loss, accuracy(model));
  }

  // ---- save, load into a fresh model, check it predicts the same ----------------------------
  if (main_rank) {
    const std::string path = out_dir + "/first_program.safetensors";
    nn::save(model, path);
    nn::Sequential restored(nn::Linear(2, 32), nn::ReLU(), nn::Linear(32, 2));
    nn::load(restored, path);
    std::printf("restored from %s: test accuracy %.4f\n", "first_program.safetensors",
                accuracy(restored));
    NoGradGuard no_grad;
    const Tensor probe = tensor({{1.0f, 1.0f}, {-1.0f, 1.0f}});
    std::cout << "P(class) at (1, 1) and (-1, 1):\n" << softmax(restored(probe), 1) << "\n";
  }
  if (distributed) ctx.group->barrier();  // no rank leaves while rank 0 still works
  return 0;
}
