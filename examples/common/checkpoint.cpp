#include "common/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/generator.h"
#include "parallel/distributed/process_group.h"

namespace tandem::examples {

namespace fs = std::filesystem;

std::string checkpoint_file_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "ckpt-%012lld.safetensors", static_cast<long long>(step));
  return buf;
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    // Exactly ckpt-<12 digits>.safetensors (Note [checkpoint file names]).
    if (name.size() != 5 + 12 + 12 || name.rfind("ckpt-", 0) != 0 ||
        name.compare(17, 12, ".safetensors") != 0)
      continue;
    const std::string digits = name.substr(5, 12);
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
    if (!e.is_regular_file(ec)) continue;
    out.emplace_back(std::stoll(digits), e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void check_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error("--checkpoint " + dir + ": cannot create the folder: " + ec.message());
  if (!fs::is_directory(dir, ec)) throw std::runtime_error("--checkpoint " + dir + ": not a folder");
  const std::string probe = (fs::path(dir) / (".probe." + std::to_string(::getpid()))).string();
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (f == nullptr)
    throw std::runtime_error("--checkpoint " + dir + ": the folder does not take files: " + std::strerror(errno));
  std::fclose(f);
  std::remove(probe.c_str());
}

bool read_resume_checkpoint(const TrainConfig& cfg, nn::TrainingCheckpoint& out, std::string& path) {
  if (!cfg.resume_file.empty()) {
    path = cfg.resume_file;
    out = nn::read_training_checkpoint(path);
    return true;
  }
  const auto all = list_checkpoints(cfg.checkpoint_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      out = nn::read_training_checkpoint(it->second);
      path = it->second;
      return true;
    } catch (const Error& e) {
      if (reports(cfg)) std::fprintf(stderr, "skipping %s: %s\n", it->second.c_str(), e.what());
    }
  }
  return false;
}

nn::Metadata run_config(const TrainConfig& cfg) {
  std::string devices;
  for (Device d : cfg.devices) devices += (devices.empty() ? "" : ",") + d.str();
  auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  return {{"model", cfg.model_name},
          {"optimizer", cfg.optimizer},
          {"lr", num(cfg.lr)},
          {"lr_schedule", cfg.lr_schedule},
          {"momentum", num(cfg.momentum)},
          {"weight_decay", num(cfg.weight_decay)},
          {"epochs", std::to_string(cfg.epochs)},
          {"batch_size", std::to_string(cfg.batch_size)},
          {"seed", std::to_string(cfg.seed)},
          {"train_limit", std::to_string(cfg.train_limit)},
          {"drop_last", cfg.drop_last ? "true" : "false"},
          {"devices", devices},
          {"parallel", cfg.group ? "ddp" : cfg.devices.size() > 1 ? cfg.parallel : "none"},
          {"world_size", std::to_string(cfg.group ? cfg.group->size() : 1)}};
}

void check_same_run(const nn::TrainingCheckpoint& ckpt, const TrainConfig& cfg, const std::string& path) {
  const nn::Metadata now = run_config(cfg);
  for (const char* key : {"batch_size", "seed", "train_limit", "drop_last"}) {
    auto it = ckpt.config.find(key);
    if (it == ckpt.config.end()) continue;  // a file written by another program
    TANDEM_CHECK(it->second == now.at(key), Value, path, ": written by a run with ", key, " ", it->second,
                 ", but this run has ", now.at(key), " (its batches would differ; give the same flags)");
  }
}

std::string first_non_finite(const nn::Module& model) {
  for (const auto& [name, t] : model.state_dict()) {
    if (!is_floating(t.dtype())) continue;
    for (double x : t.to_vector<double>())
      if (!std::isfinite(x)) return name;
  }
  return "";
}

std::string write_checkpoint(const TrainConfig& cfg, Stepper& stepper, int64_t epoch, int64_t epoch_step,
                             int64_t step, const nn::StateDict& extra) {
  const std::string path = (fs::path(cfg.checkpoint_dir) / checkpoint_file_name(step)).string();
  nn::TrainingCheckpoint c;
  stepper.capture_state(c);  // every rank: a sharded state is gathered to rank 0
  if (reports(cfg)) {
    for (Device d : cfg.devices) c.rng_states[d.str()] = default_generator(d).get_state();
    c.extra = extra;
    c.epoch = epoch;
    c.epoch_step = epoch_step;
    c.step = step;
    c.config = run_config(cfg);
    nn::save_training_checkpoint(path, c);
    if (cfg.keep > 0) {
      const auto all = list_checkpoints(cfg.checkpoint_dir);
      for (size_t i = 0; i + static_cast<size_t>(cfg.keep) < all.size(); ++i) std::remove(all[i].second.c_str());
    }
  }
  if (cfg.group) cfg.group->barrier();  // the others continue once the file is there
  return path;
}

namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) {
  if (g_stop_signal.load() != 0) {  // asked twice: stop now
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal.store(sig);
}

}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_stop_signal.load(); }

}  // namespace tandem::examples
