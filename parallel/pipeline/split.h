#pragma once
// Stage split: a Sequential cut into P consecutive pieces, piece s moved to devices[s]
// (torchgpipe's `balance`, PyTorch pipelining's manual split into PipelineStages).
//
//   auto model = nn::models::lenet();                                  // 12 layers
//   auto stages = split_by_balance(*model, {6, 6}, {Device::cpu(0), Device::cpu(1)});
//   auto stages = split_by_parameters(*model, parallel::cpu_devices(4));   // balanced by size
//   auto balance = balance_by_time(*model, sample, 4, /*repeats=*/5);       // by measured time
//
// A stage holds the model's own layers, not copies: after the split the model's parameters
// *are* the stages' parameters (each now on its stage's device), so an optimizer built over
// model.parameters() updates the pipeline, and the model's layers can be read back after
// training. The model as a whole is spread over devices then: call its stages, not the model.
// Only Sequential's public API is used (size(), operator[], to()).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "nn/container.h"

namespace tandem::parallel::pipeline {

struct Stage {
  std::shared_ptr<nn::SequentialImpl> module;  // layers [begin, end) of the model
  Device device;                           // where module now lives
  size_t begin = 0, end = 0;
};

// Stage s gets the next balance[s] layers, moved to devices[s]. ValueError, naming the values,
// when balance and devices differ in length, an entry is < 1, the entries do not add up to
// model.size(), or there are more stages than layers; the device list is checked as
// DeviceWorkers checks it (check_device_list).
std::vector<Stage> split_by_balance(const nn::SequentialImpl& model,
                                    const std::vector<int64_t>& balance,
                                    const std::vector<Device>& devices);

// The balance of num_stages consecutive pieces of `costs` (one per layer), each at least one
// layer, whose largest sum is as small as possible: balance[s] is the number of layers of piece
// s. Exact: a dynamic program over the cut points, O(num_stages * layers^2); ties as Note
// [balance ties] says. ValueError, naming the values, for num_stages < 1, more stages than
// costs, or a cost that is negative or not finite. What balance_by_parameters and
// balance_by_time share.
std::vector<int64_t> balance_min_max(const std::vector<double>& costs, int num_stages);

// balance_min_max over each layer's parameter count (numel): a split by size. ValueError for
// num_stages < 1 or more stages than layers.
std::vector<int64_t> balance_by_parameters(const nn::SequentialImpl& model, int num_stages);

// The forward + backward time, in seconds, of each layer of `model` on `sample` (the model's
// input; moved to the device the model is on): a warm-up pass, then `repeats` timed passes,
// each layer's time the median of its repeats. Each layer runs as a pipeline stage runs it, in
// training mode, on a copy of it, so the model itself is left as it was: its parameters,
// .grad, buffers (BatchNorm's running statistics) and mode (Note [profiling a layer]).
// ValueError for repeats < 1, an undefined sample, an empty model, or a model whose tensors
// are on several devices (profile it before it is split).
std::vector<double> layer_times(const nn::SequentialImpl& model, const Tensor& sample,
                                int repeats);

// torchgpipe's balance_by_time: balance_min_max over measured layer times (layer_times), so
// each stage gets about as much work rather than as many parameters. ValueError for
// num_stages < 1, more stages than times, or a time that is negative or not finite.
std::vector<int64_t> balance_by_time(const std::vector<double>& times, int num_stages);
// balance_by_time(layer_times(model, sample, repeats), num_stages), the stage count checked
// before anything runs. The sample is best one micro-batch: the rows a stage runs at once.
std::vector<int64_t> balance_by_time(const nn::SequentialImpl& model, const Tensor& sample,
                                     int num_stages, int repeats = 5);

// split_by_balance(model, balance_by_parameters(model, devices.size()), devices).
std::vector<Stage> split_by_parameters(const nn::SequentialImpl& model,
                                       const std::vector<Device>& devices);

// "[2, 2, 8]" for messages.
std::string balance_str(const std::vector<int64_t>& balance);

}  // namespace tandem::parallel::pipeline
