// --zero 1|2|3: one rank of a data-parallel job with the training state sharded over the ranks
// (docs/12-sharding.md). The step is every data-parallel rank's (rank_stepper.h); what differs
// is what holds the state:
//   --zero 1  DDP reduces the gradients, ZeroRedundancyOptimizer stage 1 (gradients_reduced)
//             steps this rank's shard and all-gathers the parameters: PyTorch's usage of
//             ZeroRedundancyOptimizer beside DistributedDataParallel.
//   --zero 2  the bare module and ZeroRedundancyOptimizer stage 2 (it reduce-scatters each bucket
//             of gradients during backward; it replaces DDP).
//   --zero 3  FullyShardedDataParallel, the parameters sharded at rest too, with the plain
//             optimizer over its flat parameters.
// Checkpoints are the plain layout, gathered one shard at a time (capture_state), and load into
// any world size and stage (load_state). After the first step rank 0 prints what one rank holds
// next to what DDP would (Note [the memory line]).
#include <cstdio>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/rank_stepper.h"
#include "core/error.h"
#include "nn/serialize.h"
#include "parallel/sharded/fsdp.h"
#include "parallel/sharded/fsdp_state_dict.h"
#include "parallel/sharded/zero_optimizer.h"

namespace tandem::examples {

namespace {

namespace dist = parallel::distributed;
namespace sharded = parallel::sharded;

// FSDP's strategy for --zero 3: FULL_SHARD, ZeRO-3 proper -- a unit's parameters are gathered
// for its forward, released right after it, and gathered again for its backward (fsdp.h).
// SHARD_GRAD_OP would keep them whole from the forward to the backward.
constexpr sharded::ShardingStrategy kZero3Strategy = sharded::ShardingStrategy::FULL_SHARD;

// Note [the memory line]: one line, bytes of one rank after its first step, counted from the
// tensors it holds (ZeroRedundancyOptimizer::memory(), FullyShardedDataParallel::memory() and the
// optimizer's state_dict()): "params" the whole parameters (0 under FSDP at rest), "shard" the
// flat shard parameters the optimizer steps, "grads" the parameters' and shards' gradients,
// "optimizer state" the state of the shards. Beside it what DDP would hold on the same model:
// 4Ψ parameters, 4Ψ gradients, and a plain optimizer's state (per element what the shards have,
// and their step counts once per parameter).
struct StateBytes {
  int64_t held = 0, ddp = 0;
};

// state: an optimizer's over one flat parameter per group (state.<g>.<name>, shards[g]
// elements); numel and num_params: the whole model's.
StateBytes state_bytes(const nn::StateDict& state, const std::vector<int64_t>& shards,
                       int64_t numel, int64_t num_params) {
  StateBytes b;
  int64_t per_element = 0, counts = 0;  // group 0's, the same kinds in every group
  for (const auto& [key, t] : state) {
    b.held += static_cast<int64_t>(t.nbytes());
    const size_t dot1 = key.find('.'), dot2 = key.find('.', dot1 + 1);
    const size_t g = std::stoul(key.substr(dot1 + 1, dot2 - dot1 - 1));
    if (g != 0) continue;
    const bool like = key.substr(dot2 + 1) != "step" && t.dim() == 1 && t.numel() == shards.at(0);
    if (like)
      per_element += static_cast<int64_t>(t.element_size());
    else
      counts += static_cast<int64_t>(t.nbytes());
  }
  b.ddp = per_element * numel + counts * num_params;
  return b;
}

std::string memory_line(int stage, int rank, int world, int64_t params, int64_t shard,
                        int64_t grads, const StateBytes& state, int64_t numel,
                        int64_t element_size) {
  const long long p = params, s = shard, g = grads, o = state.held, full = numel * element_size,
                  ddp_o = state.ddp;
  char buf[512];
  std::snprintf(
      buf, sizeof buf,
      "memory of rank %d of %d (ZeRO-%d%s), bytes: params %lld + shard %lld, grads %lld, optimizer "
      "state %lld, total %lld; DDP: params %lld, grads %lld, optimizer state %lld, total %lld",
      rank, world, stage,
      stage == 3 ? (std::string(" FSDP ") + sharded::sharding_strategy_name(kZero3Strategy)).c_str()
                 : "",
      p, s, g, o, p + s + g + o, full, full, ddp_o, 2 * full + ddp_o);
  return buf;
}

// The optimizer's messages name its tensors as its state_dict does: say where they come from
// (as nn::load_training_state does), keeping the error's type.
template <typename F>
void load_optimizer_state(const std::string& source, F&& load) {
  try {
    load();
  } catch (const Error& e) {
    e.rethrow_with_prefix(source + ": the optimizer.* tensors: ");
  }
}

class ZeroStepper final : public RankStepper {
 public:
  explicit ZeroStepper(const TrainConfig& cfg)
      : RankStepper(cfg),
        stage_(cfg.zero),
        bucket_cap_mb_(cfg.bucket_cap_mb),
        optimizer_class_(
            [cfg](std::vector<Tensor> ps) { return make_optimizer(cfg, std::move(ps)); }) {
    TANDEM_CHECK(stage_ >= 1 && stage_ <= 3, Value, "ZeroStepper: stage ", stage_, " (1, 2 or 3)");
    if (stage_ == 1) {
      ddp_ = std::make_unique<dist::DistributedDataParallel>(build_model(cfg), cfg.group,
                                                             ddp_options(cfg));
      ddp_->train();
      zero_ = make_zero();
      return;
    }
    model_ = build_model(cfg);
    model_->to(group_->device());
    model_->train();
    if (stage_ == 2) {
      zero_ = make_zero();
      return;
    }
    fsdp_ = std::make_unique<sharded::FullyShardedDataParallel>(
        model_, group_, sharded::FullyShardedDataParallelOptions{kZero3Strategy});
    opt_ = make_optimizer(cfg, fsdp_->parameters());
    // Evaluation through FSDP: each unit is gathered for its forward and released after it (no
    // gradients); the model is the evaluation module's child, so eval() and train() reach it.
    eval_ = std::make_shared<FunctionModule>(
        "FullyShardedDataParallel", [this](const Tensor& x) { return fsdp_->forward(x); }, model_);
  }

  void set_lr(double lr) override {
    if (zero_)
      zero_->set_lr(lr);
    else
      opt_->set_lr(lr);
  }
  nn::Module& model() override { return module(); }
  // The optimizer that steps this rank's shards; checkpoints go through capture_state().
  nn::optim::Optimizer& optimizer() override { return zero_ ? zero_->optim() : *opt_; }

  nn::Module& eval_model() override {
    if (!fsdp_) return RankStepper::eval_model();
    broadcast_buffers();
    return *eval_;
  }

  // Stages 1 and 2: the parameters are whole on every rank, the optimizer state is gathered to
  // rank 0 (it then holds the whole state once, plus its shard, until the next checkpoint, as
  // PyTorch's consolidate_state_dict). FSDP: the parameters gathered as for a forward, the
  // state to rank 0 one unit's shard at a time.
  void capture_state(nn::TrainingCheckpoint& ckpt) override {
    if (fsdp_) {
      ckpt.model = sharded::full_state_dict(*fsdp_, 0);
      ckpt.optimizer = sharded::full_optim_state_dict(*fsdp_, *opt_, 0);
      return;
    }
    zero_->consolidate_state_dict(0);
    if (group_->rank() != 0) return;
    ckpt.model = module().state_dict();
    ckpt.optimizer = zero_->state_dict();
  }

  // Every rank reads the whole file and keeps its shard, whatever world size and stage wrote it.
  void load_state(const nn::TrainingCheckpoint& ckpt, const std::string& source) override {
    if (fsdp_) {
      sharded::load_full_state_dict(*fsdp_, ckpt.model, source, "model.");
      load_optimizer_state(source, [&] {
        opt_->load_state_dict(sharded::shard_full_optim_state_dict(ckpt.optimizer, *fsdp_));
      });
      return;
    }
    nn::load_checked(module(), ckpt.model, source, "model.");
    // The shard parameters are a copy of the old parameters: a new ZeRO optimizer takes its
    // shards from the loaded ones (the old one first removes its stage-2 hooks).
    zero_.reset();
    zero_ = make_zero();
    load_optimizer_state(source, [&] { zero_->load_state_dict(ckpt.optimizer); });
  }

  std::string first_non_finite_weight() override {
    if (!fsdp_) return first_non_finite(module());
    const auto full = fsdp_->summon_full_params();  // every rank, at the same point
    return first_non_finite(module());
  }

 protected:
  nn::Module& module() override { return ddp_ ? ddp_->module() : *model_; }
  void zero_grad() override {
    if (zero_)
      zero_->zero_grad();
    else
      opt_->zero_grad();
  }
  Tensor forward(const Tensor& x) override {
    if (ddp_) return (*ddp_)(x);
    if (fsdp_) return fsdp_->forward(x);
    return (*model_)(x);
  }
  void optimizer_step() override {
    if (zero_)
      zero_->step();
    else
      opt_->step();
  }

  void after_step() override {
    if (memory_reported_) return;
    memory_reported_ = true;
    if (group_->rank() == 0) std::printf("%s\n", memory().c_str());
    std::fflush(stdout);
  }

 private:
  std::unique_ptr<sharded::ZeroRedundancyOptimizer> make_zero() {
    sharded::ZeroRedundancyOptimizerOptions o;
    o.stage = stage_;
    o.gradients_reduced = stage_ == 1;  // DDP has averaged them
    if (stage_ == 2) o.bucket_cap_mb = bucket_cap_mb_;
    return std::make_unique<sharded::ZeroRedundancyOptimizer>(module().parameters(),
                                                              optimizer_class_, group_, o);
  }

  // Note [the memory line].
  std::string memory() const {
    const int64_t num_params =
        static_cast<int64_t>(model_ ? model_->parameters().size() : ddp_->parameters().size());
    std::vector<int64_t> shards;
    if (zero_) {
      const sharded::ShardedMemory m = zero_->memory();
      for (size_t b = 0; b < zero_->num_buckets(); ++b)
        shards.push_back(zero_->bucket_shard_numel(b));
      const StateBytes s = state_bytes(zero_->optim().state_dict(), shards, m.numel, num_params);
      return memory_line(stage_, m.rank, m.world_size, m.parameters, m.shard_parameters,
                         m.gradients, s, m.numel, m.ddp_parameters / std::max<int64_t>(1, m.numel));
    }
    const sharded::FsdpMemory m = fsdp_->memory();
    for (size_t u = 0; u < fsdp_->num_units(); ++u) shards.push_back(fsdp_->unit_shard_numel(u));
    const StateBytes s = state_bytes(opt_->state_dict(), shards, m.numel, num_params);
    return memory_line(stage_, m.rank, m.world_size, m.parameters, m.flat_parameters, m.gradients,
                       s, m.numel, m.element_size);
  }

  int stage_;
  double bucket_cap_mb_;
  sharded::OptimizerFactory optimizer_class_;
  std::unique_ptr<dist::DistributedDataParallel> ddp_;      // stage 1
  std::shared_ptr<nn::Module> model_;                       // stages 2 and 3
  std::unique_ptr<sharded::ZeroRedundancyOptimizer> zero_;  // stages 1 and 2
  std::unique_ptr<sharded::FullyShardedDataParallel>
      fsdp_;  // stage 3, with opt_ over its flat parameters
  std::unique_ptr<nn::optim::Optimizer> opt_;
  std::shared_ptr<FunctionModule> eval_;
  bool memory_reported_ = false;
};

}  // namespace

std::unique_ptr<Stepper> make_zero_stepper(const TrainConfig& cfg) {
  return std::make_unique<ZeroStepper>(cfg);
}

}  // namespace tandem::examples
