#pragma once
// scatter / gather: cutting a minibatch into per-device shards and putting outputs back
// together. Both are differentiable (built from slice, to_device and cat in autograd/ops.h),
// so a loss computed on the gathered output sends gradients back through them.
//
// Copies are stream-ordered (Note [cross-device ordering] in kernels/tensor_methods.cpp): the
// copy of shard i runs on device i's current stream after the producer of x on x's device,
// with no host synchronization (except from a GPU into CPU memory, which must be ready).
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace tandem::parallel {

// Shard sizes for `batch` rows over n devices, as even as possible, the larger shards first:
// 255 over 2 -> {128, 127}, 13 over 3 -> {5, 4, 4}. ValueError naming both numbers when
// batch < n (a device would get no rows) or n == 0.
std::vector<int64_t> split_sizes(int64_t batch, size_t n);

// Cuts x along dim 0 into shards of split_sizes(x.size(0), devices.size()) rows and puts
// shard i on devices[i]. Shards are views when already on the right device.
std::vector<Tensor> scatter(const Tensor& x, const std::vector<Device>& devices);
// Same with explicit shard sizes (they must add up to x.size(0); ShapeError otherwise).
std::vector<Tensor> scatter(const Tensor& x, const std::vector<int64_t>& sizes,
                            const std::vector<Device>& devices);

// Copies every output to `device` and concatenates them along dim 0. The gradient of the
// result is sliced and copied back to each output's device.
Tensor gather(const std::vector<Tensor>& outputs, Device device);

}  // namespace tandem::parallel
