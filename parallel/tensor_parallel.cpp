#include "parallel/tensor_parallel.h"

#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/error.h"
#include "parallel/distributed/process_group.h"

namespace tandem::parallel {

namespace {

void check_per_shard(const char* who, const TensorParallelComm& comm, const std::vector<Tensor>& xs) {
  const auto& devices = comm.devices();
  TANDEM_CHECK(xs.size() == devices.size(), Value, who, ": ", xs.size(), " tensors for ",
               devices.size(), " ", comm.unit(), devices.size() == 1 ? "" : "s");
  for (size_t i = 0; i < xs.size(); ++i) {
    TANDEM_CHECK(xs[i].defined(), Value, who, ": tensor ", i, " is undefined");
    TANDEM_CHECK(xs[i].device() == devices[i], Device, who, ": tensor ", i, " is on ",
                 xs[i].device().str(), ", not on ", devices[i].str());
  }
}

bool recording(const std::vector<Tensor>& xs) {
  if (!grad_enabled()) return false;
  for (const Tensor& x : xs) {
    if (x.requires_grad()) return true;
  }
  return false;
}

// A Linear on `device` holding full's weight[rows, cols] (and bias[rows] when with_bias),
// copied without autograd.
std::shared_ptr<nn::Linear> make_shard(const nn::Linear& full, std::pair<int64_t, int64_t> rows,
                                       std::pair<int64_t, int64_t> cols, bool with_bias,
                                       Device device) {
  Generator unused(0);  // the values are overwritten below
  auto shard = std::make_shared<nn::Linear>(cols.second - cols.first, rows.second - rows.first,
                                            with_bias, unused);
  shard->to(device);
  NoGradGuard no_grad;
  shard->weight().copy_(
      full.weight().slice(0, rows.first, rows.second).slice(1, cols.first, cols.second));
  if (with_bias) shard->bias().copy_(full.bias().slice(0, rows.first, rows.second));
  return shard;
}

}  // namespace

std::vector<Tensor> copy_to_tensor_parallel_region(const std::shared_ptr<TensorParallelComm>& comm,
                                                   const std::vector<Tensor>& xs) {
  check_per_shard("copy_to_tensor_parallel_region", *comm, xs);
  std::vector<Tensor> ys;
  for (const Tensor& x : xs) ys.push_back(x.detach());  // identity: the same storage
  if (recording(xs)) {
    std::vector<Shape> shapes;
    for (const Tensor& x : xs) shapes.push_back(x.shape());
    const DType dtype = xs[0].dtype();
    autograd::record(
        "CopyToTensorParallelRegion", xs, ys, [comm, shapes, dtype](autograd::TensorList&& g) {
          for (size_t i = 0; i < g.size(); ++i) {
            // Our own buffers to sum into: the engine's may alias a gradient still in use.
            g[i] = g[i].defined() ? g[i].clone() : zeros(shapes[i], dtype, comm->devices()[i]);
          }
          comm->allreduce_sum(g);
          return std::move(g);
        });
  }
  return ys;
}

std::vector<Tensor> reduce_from_tensor_parallel_region(
    const std::shared_ptr<TensorParallelComm>& comm, const std::vector<Tensor>& partials) {
  check_per_shard("reduce_from_tensor_parallel_region", *comm, partials);
  std::vector<Tensor> sums;
  for (const Tensor& p : partials) sums.push_back(p.detach().clone());
  comm->allreduce_sum(sums);
  if (recording(partials)) {
    autograd::record("ReduceFromTensorParallelRegion", partials, sums,
                     [](autograd::TensorList&& g) { return std::move(g); });
  }
  return sums;
}

std::vector<Tensor> copy_to_tensor_parallel_region(Communicator& comm,
                                                   const std::vector<Tensor>& xs) {
  return copy_to_tensor_parallel_region(tensor_parallel_comm(comm), xs);
}

std::vector<Tensor> reduce_from_tensor_parallel_region(Communicator& comm,
                                                       const std::vector<Tensor>& partials) {
  return reduce_from_tensor_parallel_region(tensor_parallel_comm(comm), partials);
}

Tensor copy_to_tensor_parallel_region(const std::shared_ptr<distributed::ProcessGroup>& group,
                                      const Tensor& x) {
  return copy_to_tensor_parallel_region(tensor_parallel_comm(group), {x})[0];
}

Tensor reduce_from_tensor_parallel_region(const std::shared_ptr<distributed::ProcessGroup>& group,
                                          const Tensor& partial) {
  return reduce_from_tensor_parallel_region(tensor_parallel_comm(group), {partial})[0];
}

// ---- the shards of one Linear ----------------------------------------------------------------

TensorParallelLinear::TensorParallelLinear(const char* name, const nn::Linear& full,
                                           std::shared_ptr<TensorParallelComm> comm, int split_dim)
    : name_(name), comm_(std::move(comm)), split_dim_(split_dim) {
  TANDEM_CHECK(comm_ != nullptr, Value, name_, ": no tensor-parallel communication");
  const int n = comm_->world_size();
  const int64_t features = split_dim == 0 ? full.out_features() : full.in_features();
  TANDEM_CHECK(features >= n, Value, name_, ": ", features,
               split_dim == 0 ? " output" : " input", " features over ", n, " ", comm_->unit(),
               "s; every ", comm_->unit(), " needs one");
  const std::pair<int64_t, int64_t> all_rows{0, full.out_features()}, all_cols{0, full.in_features()};
  for (size_t i = 0; i < comm_->ranks().size(); ++i) {
    const int r = comm_->ranks()[i];
    const auto part = tensor_parallel_range(features, n, r);
    // A column split cuts the bias with the rows; a row split keeps it once, in shard 0.
    const bool with_bias = full.bias().defined() && (split_dim == 0 || r == 0);
    shards_.push_back(make_shard(full, split_dim == 0 ? part : all_rows,
                                 split_dim == 0 ? all_cols : part, with_bias, comm_->devices()[i]));
  }
}

Tensor TensorParallelLinear::forward(const Tensor& x) {
  TANDEM_CHECK(shards_.size() == 1, Value, name_, ": forward of one tensor, but this process holds ",
               shards_.size(), " shards (pass one tensor per shard)");
  return forward(std::vector<Tensor>{x})[0];
}

std::vector<Tensor> TensorParallelLinear::parameters() const {
  std::vector<Tensor> out;
  for (const auto& s : shards_) {
    for (const Tensor& p : s->parameters()) out.push_back(p);
  }
  return out;
}

void TensorParallelLinear::check_all_held(const char* what) const {
  TANDEM_CHECK(comm_->holds_all(), Value, name_, "::", what, ": this process holds ",
               comm_->ranks().size(), " of the ", comm_->world_size(), " shards");
}

Tensor TensorParallelLinear::full_weight() const {
  check_all_held("full_weight");
  std::vector<Tensor> parts;
  for (const auto& s : shards_) parts.push_back(s->weight().detach().to(kCPU));
  return cat(parts, split_dim_);
}

ColumnParallelLinear::ColumnParallelLinear(const nn::Linear& full,
                                           std::shared_ptr<TensorParallelComm> comm)
    : TensorParallelLinear("ColumnParallelLinear", full, std::move(comm), 0) {}

std::vector<Tensor> ColumnParallelLinear::forward(const std::vector<Tensor>& xs) {
  const auto ins = copy_to_tensor_parallel_region(comm_, xs);
  std::vector<Tensor> ys;
  for (size_t i = 0; i < shards_.size(); ++i) {
    DeviceGuard guard(comm_->devices()[i]);
    ys.push_back(shards_[i]->forward(ins[i]));
  }
  return ys;
}

Tensor ColumnParallelLinear::full_bias() const {
  check_all_held("full_bias");
  if (!shards_[0]->bias().defined()) return Tensor();
  std::vector<Tensor> parts;
  for (const auto& s : shards_) parts.push_back(s->bias().detach().to(kCPU));
  return cat(parts, 0);
}

RowParallelLinear::RowParallelLinear(const nn::Linear& full, std::shared_ptr<TensorParallelComm> comm)
    : TensorParallelLinear("RowParallelLinear", full, std::move(comm), 1) {}

std::vector<Tensor> RowParallelLinear::forward(const std::vector<Tensor>& xs) {
  check_per_shard("RowParallelLinear", *comm_, xs);
  std::vector<Tensor> partials;
  for (size_t i = 0; i < shards_.size(); ++i) {
    DeviceGuard guard(comm_->devices()[i]);
    partials.push_back(shards_[i]->forward(xs[i]));
  }
  return reduce_from_tensor_parallel_region(comm_, partials);
}

Tensor RowParallelLinear::full_bias() const {
  TANDEM_CHECK(!comm_->ranks().empty() && comm_->ranks()[0] == 0, Value,
               "RowParallelLinear::full_bias: the bias is in shard 0, not held here");
  const Tensor b = shards_[0]->bias();
  return b.defined() ? b.detach().to(kCPU) : Tensor();
}

}  // namespace tandem::parallel
