#include "nn/init.h"

#include <cmath>
#include <vector>

#include "autograd/grad_mode.h"
#include "core/error.h"

namespace tandem::nn::init {

namespace {

void check_floating(const Tensor& t, const char* op) {
  TANDEM_CHECK(t.defined(), Value, op, ": undefined tensor");
  TANDEM_CHECK(is_floating(t.dtype()), DType, op, ": expected a floating tensor, got ",
               dtype_name(t.dtype()));
}

// Copies host values (row-major) into t, whatever its device and dtype.
void copy_from_host(const Tensor& t, const std::vector<double>& values) {
  NoGradGuard no_grad;
  t.copy_(from_vector<double>(values, t.shape()));
}

int64_t fan(const Tensor& t, FanMode mode) {
  auto [fan_in, fan_out] = fan_in_and_fan_out(t.shape());
  return mode == FanMode::FanIn ? fan_in : fan_out;
}

}  // namespace

double calculate_gain(Nonlinearity nl, double param) {
  switch (nl) {
    case Nonlinearity::Linear:
    case Nonlinearity::Conv:
    case Nonlinearity::Sigmoid:
      return 1.0;
    case Nonlinearity::Tanh:
      return 5.0 / 3.0;
    case Nonlinearity::Relu:
      return std::sqrt(2.0);
    case Nonlinearity::LeakyRelu:
      return std::sqrt(2.0 / (1.0 + param * param));
  }
  TANDEM_THROW(Value, "calculate_gain: unknown nonlinearity");
}

std::pair<int64_t, int64_t> fan_in_and_fan_out(const Shape& shape) {
  TANDEM_CHECK(shape.size() >= 2, Value, "fan_in_and_fan_out: tensor of shape ", shape_str(shape),
               " has fewer than 2 dims");
  int64_t receptive = 1;
  for (size_t i = 2; i < shape.size(); ++i) receptive *= shape[i];
  return {shape[1] * receptive, shape[0] * receptive};
}

void uniform_(const Tensor& t, double lo, double hi, Generator& gen) {
  check_floating(t, "uniform_");
  TANDEM_CHECK(lo <= hi, Value, "uniform_: lo ", lo, " > hi ", hi);
  std::vector<double> v(static_cast<size_t>(t.numel()));
  gen.uniform(v.data(), t.numel(), lo, hi);
  copy_from_host(t, v);
}

void normal_(const Tensor& t, double mean, double stddev, Generator& gen) {
  check_floating(t, "normal_");
  TANDEM_CHECK(stddev >= 0, Value, "normal_: negative stddev ", stddev);
  std::vector<double> v(static_cast<size_t>(t.numel()));
  gen.normal(v.data(), t.numel(), mean, stddev);
  copy_from_host(t, v);
}

void constant_(const Tensor& t, double value) {
  check_floating(t, "constant_");
  NoGradGuard no_grad;
  t.fill_(value);
}

void zeros_(const Tensor& t) {
  constant_(t, 0.0);
}
void ones_(const Tensor& t) {
  constant_(t, 1.0);
}

void xavier_uniform_(const Tensor& t, double gain, Generator& gen) {
  check_floating(t, "xavier_uniform_");
  auto [fan_in, fan_out] = fan_in_and_fan_out(t.shape());
  double a = gain * std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  uniform_(t, -a, a, gen);
}

void xavier_normal_(const Tensor& t, double gain, Generator& gen) {
  check_floating(t, "xavier_normal_");
  auto [fan_in, fan_out] = fan_in_and_fan_out(t.shape());
  normal_(t, 0.0, gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out)), gen);
}

void kaiming_uniform_(const Tensor& t, double a, FanMode mode, Nonlinearity nl, Generator& gen) {
  check_floating(t, "kaiming_uniform_");
  double bound = calculate_gain(nl, a) * std::sqrt(3.0 / static_cast<double>(fan(t, mode)));
  uniform_(t, -bound, bound, gen);
}

void kaiming_normal_(const Tensor& t, double a, FanMode mode, Nonlinearity nl, Generator& gen) {
  check_floating(t, "kaiming_normal_");
  normal_(t, 0.0, calculate_gain(nl, a) / std::sqrt(static_cast<double>(fan(t, mode))), gen);
}

namespace {
thread_local bool t_skip_default_init = false;
}  // namespace

SkipDefaultInitGuard::SkipDefaultInitGuard() : previous_(t_skip_default_init) {
  t_skip_default_init = true;
}
SkipDefaultInitGuard::~SkipDefaultInitGuard() { t_skip_default_init = previous_; }
bool SkipDefaultInitGuard::active() { return t_skip_default_init; }

void default_layer_init_(const Tensor& weight, const Tensor& bias, Generator& gen) {
  if (t_skip_default_init) return;  // Note [drawing the initialization once]
  kaiming_uniform_(weight, std::sqrt(5.0), FanMode::FanIn, Nonlinearity::LeakyRelu, gen);
  if (bias.defined()) {
    int64_t fan_in = fan_in_and_fan_out(weight.shape()).first;
    double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    uniform_(bias, -bound, bound, gen);
  }
}

}  // namespace tandem::nn::init
