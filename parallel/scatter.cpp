#include "parallel/scatter.h"

#include "autograd/ops.h"
#include "core/error.h"

namespace tandem::parallel {

std::vector<int64_t> split_sizes(int64_t batch, size_t n) {
  TANDEM_CHECK(n > 0, Value, "split_sizes: no devices to split a batch of ", batch, " over");
  const auto parts = static_cast<int64_t>(n);
  TANDEM_CHECK(batch >= parts, Value, "split_sizes: batch of ", batch, " is smaller than the ",
               n, " devices; every device needs at least one row");
  std::vector<int64_t> sizes(n, batch / parts);
  for (int64_t i = 0; i < batch % parts; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

std::vector<Tensor> scatter(const Tensor& x, const std::vector<Device>& devices) {
  TANDEM_CHECK(x.defined() && x.dim() >= 1, Shape, "scatter: need a tensor with a batch dim, got ",
               x.defined() ? x.str() : "an undefined tensor");
  return scatter(x, split_sizes(x.size(0), devices.size()), devices);
}

std::vector<Tensor> scatter(const Tensor& x, const std::vector<int64_t>& sizes,
                            const std::vector<Device>& devices) {
  TANDEM_CHECK(x.defined() && x.dim() >= 1, Shape, "scatter: need a tensor with a batch dim, got ",
               x.defined() ? x.str() : "an undefined tensor");
  TANDEM_CHECK(sizes.size() == devices.size(), Value, "scatter: ", sizes.size(),
               " shard sizes for ", devices.size(), " devices");
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  TANDEM_CHECK(total == x.size(0), Shape, "scatter: shard sizes add up to ", total,
               " but the batch has ", x.size(0), " rows");
  if (devices.size() == 1 && x.device() == devices[0]) return {x};

  std::vector<Tensor> shards;
  int64_t start = 0;
  for (size_t i = 0; i < devices.size(); ++i) {
    Tensor shard = slice(x, 0, start, start + sizes[i]);
    start += sizes[i];
    shards.push_back(shard.device() == devices[i] ? shard : to_device(shard, devices[i]));
  }
  return shards;
}

Tensor gather(const std::vector<Tensor>& outputs, Device device) {
  TANDEM_CHECK(!outputs.empty(), Value, "gather: no outputs");
  std::vector<Tensor> moved;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& o = outputs[i];
    TANDEM_CHECK(o.defined(), Value, "gather: output ", i, " is undefined");
    moved.push_back(o.device() == device ? o : to_device(o, device));
  }
  return moved.size() == 1 ? moved[0] : cat(moved, 0);
}

}  // namespace tandem::parallel
