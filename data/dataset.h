#pragma once
// TensorDataset: samples stored as the rows (dim 0) of two tensors, read in batches.
#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::data {

// One minibatch: inputs x [B, ...] and targets y [B, ...], on the dataset's device.
struct Batch {
  Tensor x;
  Tensor y;
};

class TensorDataset {
 public:
  TensorDataset() = default;
  // images [N, ...] and labels [N, ...] on one device; both keep their dtype.
  TensorDataset(Tensor images, Tensor labels)
      : images_(std::move(images)), labels_(std::move(labels)) {
    TANDEM_CHECK(images_.defined() && labels_.defined(), Value,
                 "TensorDataset: images and labels must be defined tensors");
    TANDEM_CHECK(images_.dim() >= 1 && labels_.dim() >= 1, Shape, "TensorDataset: images ",
                 shape_str(images_.shape()), " and labels ", shape_str(labels_.shape()),
                 " need a sample dimension");
    TANDEM_CHECK(images_.size(0) == labels_.size(0), Shape, "TensorDataset: ", images_.size(0),
                 " images ", shape_str(images_.shape()), " but ", labels_.size(0), " labels ",
                 shape_str(labels_.shape()));
    TANDEM_CHECK(images_.device() == labels_.device(), Device, "TensorDataset: images on ",
                 images_.device().str(), " but labels on ", labels_.device().str());
    // Gathers read rows of contiguous memory.
    images_ = images_.contiguous();
    labels_ = labels_.contiguous();
  }

  int64_t size() const { return images_.defined() ? images_.size(0) : 0; }
  const Tensor& images() const { return images_; }
  const Tensor& labels() const { return labels_; }
  Device device() const { return images_.device(); }

  // The samples at `index` (int64 [B] on the dataset's device), gathered on that device
  // without a host synchronization; B = 0 gives 0 rows of the right shape and dtype without
  // launching a gather over nothing (a rank's empty shard of a short last batch).
  Batch get(const Tensor& index) const {
    if (index.defined() && index.dim() == 1 && index.size(0) == 0) {
      Shape xs = images_.shape(), ys = labels_.shape();
      xs[0] = ys[0] = 0;
      return {Tensor(xs, images_.dtype(), device()), Tensor(ys, labels_.dtype(), device())};
    }
    return {kernels::index_select(images_, index), kernels::index_select(labels_, index)};
  }

  // The same samples on another device (this dataset itself when already there).
  TensorDataset to(Device device) const {
    if (device == this->device()) return *this;
    return TensorDataset(images_.to(device), labels_.to(device));
  }

 private:
  Tensor images_;  // [N, ...]
  Tensor labels_;  // [N, ...]
};

}  // namespace tandem::data
