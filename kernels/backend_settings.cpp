#include <atomic>
#include <cstdlib>
#include <string>

#include "core/error.h"

#include "kernels/backend.h"

namespace tandem {

namespace {
bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return fallback;
  return v[0] == '1';
}
// Function-local statics: initialized on first use, so a setter called during another
// translation unit's static initialization is never overwritten afterwards.
std::atomic<bool>& tf32_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_ALLOW_TF32", true)};
  return flag;
}
std::atomic<bool>& benchmark_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_CUDNN_BENCHMARK", false)};
  return flag;
}
std::atomic<bool>& benchmark_graph_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_CUDNN_BENCHMARK_GRAPH", true)};
  return flag;
}
// The whole number from 1 to `most` in the environment variable `name`, or `fallback` when it
// is unset or empty.
int env_count(const char* name, int fallback, int most) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  TANDEM_CHECK(*end == '\0' && n >= 1 && n <= most, Value, name, "=", v, ": expected a whole number from 1 to ",
               most);
  return static_cast<int>(n);
}
constexpr int kMaxBenchmarkRounds = 100, kMaxBenchmarkEngines = 64;
std::atomic<int>& benchmark_rounds_setting() {
  static std::atomic<int> rounds{env_count("TANDEM_CUDNN_BENCHMARK_ROUNDS", 3, kMaxBenchmarkRounds)};
  return rounds;
}
std::atomic<int>& benchmark_engines_setting() {
  static std::atomic<int> engines{env_count("TANDEM_CUDNN_BENCHMARK_ENGINES", 16, kMaxBenchmarkEngines)};
  return engines;
}
std::atomic<bool>& benchmark_log_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_CUDNN_BENCHMARK_LOG", false)};
  return flag;
}
std::atomic<bool>& memset_kernels_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_CUDNN_MEMSET_KERNELS", true)};
  return flag;
}
std::atomic<bool>& programmatic_launch_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_PDL", true)};
  return flag;
}
std::atomic<bool>& prepare_ahead_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_CUDNN_PREPARE_AHEAD", true)};
  return flag;
}
std::atomic<bool>& weight_copy_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_WEIGHT_COPY_IN_UPDATE", true)};
  return flag;
}
std::atomic<bool>& graph_flag() {
  static std::atomic<bool> flag{!env_flag("TANDEM_CUDNN_LEGACY", false)};
  return flag;
}
std::atomic<bool>& deterministic_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_CUDNN_DETERMINISTIC", true)};
  return flag;
}
std::atomic<bool>& direct_conv_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_DIRECT_CONV", true)};
  return flag;
}
std::atomic<bool>& one_channel_conv_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_ONE_CHANNEL_CONV", true)};
  return flag;
}
std::atomic<bool>& fuse_bn_relu_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_FUSE_BN_RELU", true)};
  return flag;
}
std::atomic<bool>& fuse_bn_add_relu_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_FUSE_BN_ADD_RELU", true)};
  return flag;
}
std::atomic<bool>& fuse_conv_bias_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_FUSE_CONV_BIAS", true)};
  return flag;
}
std::atomic<bool>& fuse_linear_activation_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_FUSE_LINEAR_ACT", true)};
  return flag;
}
std::atomic<bool>& fuse_activation_pool_flag() {
  static std::atomic<bool> flag{env_flag("TANDEM_FUSE_ACT_POOL", true)};
  return flag;
}
constexpr const char* kRowPassesExpected =
    ": expected letters among f, d, w (forward, input gradient, weight gradient), or - for none";
int row_pass_bit(char pass) { return pass == 'f' ? 1 : pass == 'd' ? 2 : pass == 'w' ? 4 : -1; }
// A set of convolution passes as bits: f (forward) 1, d (input gradient) 2, w (weight
// gradient) 4; "-" is none. -1 for a string with any other character.
int parse_row_passes(const std::string& s) {
  if (s == "-") return 0;
  int bits = 0;
  for (char c : s) {
    const int bit = row_pass_bit(c);
    if (bit < 0) return -1;
    bits |= bit;
  }
  return s.empty() ? -1 : bits;
}
std::atomic<int>& row_conv_flag() {
  static std::atomic<int> flag{[] {
    const char* v = std::getenv("TANDEM_ROW_CONV");
    if (v == nullptr || v[0] == '\0') return parse_row_passes("dw");
    const int bits = parse_row_passes(v);
    TANDEM_CHECK(bits >= 0, Value, "TANDEM_ROW_CONV=", v, kRowPassesExpected);
    return bits;
  }()};
  return flag;
}
}  // namespace

void set_row_conv_passes(const std::string& passes) {
  const int bits = parse_row_passes(passes);
  TANDEM_CHECK(bits >= 0, Value, "set_row_conv_passes(\"", passes, "\")", kRowPassesExpected);
  row_conv_flag() = bits;
}
bool row_conv_pass_on(char pass) {
  const int bit = row_pass_bit(pass);
  return bit > 0 && (row_conv_flag() & bit) != 0;
}
std::string row_conv_passes() {
  const int bits = row_conv_flag();
  std::string s;
  if (bits & 1) s += 'f';
  if (bits & 2) s += 'd';
  if (bits & 4) s += 'w';
  return s.empty() ? "-" : s;
}
void set_fuse_activation_pool(bool on) { fuse_activation_pool_flag() = on; }
bool fuse_activation_pool() { return fuse_activation_pool_flag(); }
void set_fuse_linear_activation(bool on) { fuse_linear_activation_flag() = on; }
bool fuse_linear_activation() { return fuse_linear_activation_flag(); }
void set_fuse_bn_relu(bool on) { fuse_bn_relu_flag() = on; }
bool fuse_bn_relu() { return fuse_bn_relu_flag(); }
void set_fuse_bn_add_relu(bool on) { fuse_bn_add_relu_flag() = on; }
bool fuse_bn_add_relu() { return fuse_bn_add_relu_flag(); }
void set_fuse_conv_bias(bool on) { fuse_conv_bias_flag() = on; }
bool fuse_conv_bias() { return fuse_conv_bias_flag(); }
void set_direct_conv(bool on) { direct_conv_flag() = on; }
bool direct_conv() { return direct_conv_flag(); }
void set_one_channel_conv(bool on) { one_channel_conv_flag() = on; }
bool one_channel_conv() { return one_channel_conv_flag(); }
namespace {
DirectWgradShape& direct_wgrad_shape_setting() {
  static DirectWgradShape shape;
  return shape;
}
}  // namespace
void set_direct_wgrad_shape(DirectWgradShape shape) {
  TANDEM_CHECK(shape.images_per_block >= 0 && shape.threads >= 0 && shape.threads <= 1024, Value,
               "set_direct_wgrad_shape: images per block and threads must be >= 0 and threads <= 1024, got ",
               shape.images_per_block, " and ", shape.threads);
  direct_wgrad_shape_setting() = shape;
}
DirectWgradShape direct_wgrad_shape() { return direct_wgrad_shape_setting(); }
void set_cudnn_deterministic(bool on) { deterministic_flag() = on; }
bool cudnn_deterministic() { return deterministic_flag(); }
void set_cudnn_graph_api(bool on) { graph_flag() = on; }
bool cudnn_graph_api() { return graph_flag(); }
void set_allow_tf32(bool on) { tf32_flag() = on; }
bool allow_tf32() { return tf32_flag(); }
void set_cudnn_benchmark(bool on) { benchmark_flag() = on; }
bool cudnn_benchmark() { return benchmark_flag(); }
void set_cudnn_benchmark_in_graph(bool on) { benchmark_graph_flag() = on; }
bool cudnn_benchmark_in_graph() { return benchmark_graph_flag(); }
void set_cudnn_benchmark_rounds(int rounds) {
  TANDEM_CHECK(rounds >= 1 && rounds <= kMaxBenchmarkRounds, Value, "set_cudnn_benchmark_rounds: expected 1 to ",
               kMaxBenchmarkRounds, " rounds, got ", rounds);
  benchmark_rounds_setting() = rounds;
}
int cudnn_benchmark_rounds() { return benchmark_rounds_setting(); }
void set_cudnn_benchmark_engines(int engines) {
  TANDEM_CHECK(engines >= 1 && engines <= kMaxBenchmarkEngines, Value,
               "set_cudnn_benchmark_engines: expected 1 to ", kMaxBenchmarkEngines, " engines, got ", engines);
  benchmark_engines_setting() = engines;
}
int cudnn_benchmark_engines() { return benchmark_engines_setting(); }
void set_cudnn_benchmark_log(bool on) { benchmark_log_flag() = on; }
bool cudnn_benchmark_log() { return benchmark_log_flag(); }
void set_cudnn_memsets_as_kernels(bool on) { memset_kernels_flag() = on; }
bool cudnn_memsets_as_kernels() { return memset_kernels_flag(); }
void set_programmatic_launch(bool on) { programmatic_launch_flag() = on; }
bool programmatic_launch() { return programmatic_launch_flag(); }
void set_cudnn_prepare_ahead(bool on) { prepare_ahead_flag() = on; }
bool cudnn_prepare_ahead() { return prepare_ahead_flag(); }
void set_weight_copy_in_update(bool on) { weight_copy_flag() = on; }
bool weight_copy_in_update() { return weight_copy_flag(); }

}  // namespace tandem
