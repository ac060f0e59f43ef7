#include "nn/serialize_checkpoint.h"

#include <cerrno>
#include <cstdlib>

#include "core/error.h"
#include "core/generator.h"

namespace tandem::nn {

namespace {

constexpr const char* kKind = "training_checkpoint";

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

int64_t metadata_int(const Metadata& m, const std::string& key, const std::string& path) {
  auto it = m.find(key);
  TANDEM_CHECK(it != m.end(), Format, path, ": training checkpoint without '", key, "' in its metadata");
  const std::string& v = it->second;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  TANDEM_CHECK(!v.empty() && errno == 0 && *end == '\0' && n >= 0, Format, path, ": metadata '", key,
               "' is '", v.substr(0, 40), "', not a non-negative integer");
  return n;
}

}  // namespace

TrainingCheckpoint capture_training_state(const Module& module, const optim::Optimizer& optimizer,
                                          const std::vector<Device>& devices) {
  TrainingCheckpoint c;
  c.model = module.state_dict();
  c.optimizer = optimizer.state_dict();
  for (Device d : devices) c.rng_states[d.str()] = default_generator(d).get_state();
  return c;
}

void save_training_checkpoint(const std::string& path, const TrainingCheckpoint& c) {
  TANDEM_CHECK(c.epoch >= 0 && c.epoch_step >= 0 && c.step >= 0, Value,
               "save_training_checkpoint: negative position (epoch ", c.epoch, ", epoch_step ",
               c.epoch_step, ", step ", c.step, ")");
  StateDict all;
  for (const auto& [name, t] : c.model) all.insert("model." + name, t);
  for (const auto& [name, t] : c.optimizer) all.insert("optimizer." + name, t);
  for (const auto& [device, t] : c.rng_states) all.insert("rng_state." + device, t);
  for (const auto& [name, t] : c.extra) all.insert("extra." + name, t);
  Metadata meta;
  for (const auto& [k, v] : c.config) meta["config." + k] = v;
  meta["tandem.kind"] = kKind;
  meta["epoch"] = std::to_string(c.epoch);
  meta["epoch_step"] = std::to_string(c.epoch_step);
  meta["step"] = std::to_string(c.step);
  write_safetensors(path, all, meta);
}

TrainingCheckpoint read_training_checkpoint(const std::string& path) {
  SafetensorsFile file = read_safetensors(path);
  auto kind = file.metadata.find("tandem.kind");
  TANDEM_CHECK(kind != file.metadata.end() && kind->second == kKind, Format, path,
               ": not a training checkpoint (metadata 'tandem.kind' is ",
               kind == file.metadata.end() ? std::string("missing") : "'" + kind->second + "'",
               "; a file of nn::save holds a model only)");
  TrainingCheckpoint c;
  c.epoch = metadata_int(file.metadata, "epoch", path);
  c.epoch_step = metadata_int(file.metadata, "epoch_step", path);
  c.step = metadata_int(file.metadata, "step", path);
  for (const auto& [k, v] : file.metadata)
    if (starts_with(k, "config.")) c.config[k.substr(7)] = v;
  for (const auto& [name, t] : file.tensors) {
    if (starts_with(name, "model.")) {
      c.model.insert(name.substr(6), t);
    } else if (starts_with(name, "optimizer.")) {
      c.optimizer.insert(name.substr(10), t);
    } else if (starts_with(name, "rng_state.")) {
      c.rng_states[name.substr(10)] = t;
    } else if (starts_with(name, "extra.")) {
      c.extra.insert(name.substr(6), t);
    } else {
      TANDEM_THROW(Format, path, ": tensor '", name,
                   "' is not model.*, optimizer.*, rng_state.* or extra.* (Note [training "
                   "checkpoint names])");
    }
  }
  return c;
}

void load_training_state(const TrainingCheckpoint& c, Module& module, optim::Optimizer& optimizer,
                         const std::string& source) {
  load_checked(module, c.model, source, "model.");
  try {
    optimizer.load_state_dict(c.optimizer);
  } catch (const Error& e) {
    // The optimizer names the tensor as its own state_dict does ("state.0.exp_avg"): say
    // where it comes from, keeping the error's type.
    e.rethrow_with_prefix(source + ": the optimizer.* tensors: ");
  }
}

void restore_rng_states(const TrainingCheckpoint& c) {
  for (const auto& [device, state] : c.rng_states) default_generator(Device::parse(device)).set_state(state);
}

}  // namespace tandem::nn
