#pragma once
// Stage split: a Sequential cut into P consecutive pieces, piece s moved to devices[s]
// (torchgpipe's `balance`, PyTorch pipelining's manual split into PipelineStages).
//
//   auto model = nn::models::lenet();                                  // 12 layers
//   auto stages = split_by_balance(*model, {6, 6}, {Device::cpu(0), Device::cpu(1)});
//   auto stages = split_by_parameters(*model, parallel::cpu_devices(4));   // balanced by size
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

// The balance of num_stages consecutive pieces, each at least one layer, whose largest
// parameter count (numel) is as small as possible: an exact small dynamic program over the
// cut points, ties broken towards the earlier cut. ValueError for num_stages < 1 or more
// stages than layers.
std::vector<int64_t> balance_by_parameters(const nn::SequentialImpl& model, int num_stages);

// split_by_balance(model, balance_by_parameters(model, devices.size()), devices).
std::vector<Stage> split_by_parameters(const nn::SequentialImpl& model,
                                       const std::vector<Device>& devices);

// "[2, 2, 8]" for messages.
std::string balance_str(const std::vector<int64_t>& balance);

}  // namespace tandem::parallel::pipeline
