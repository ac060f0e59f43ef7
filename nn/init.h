#pragma once
// Parameter initialization (torch.nn.init).
//
// Values are drawn on the host from a Generator (the default CPU generator unless given) in
// row-major order and copied into the tensor with Tensor::copy_, so a seed gives the same
// values whatever device or dtype the tensor has. None of these record autograd history.
//
// Fans are computed as PyTorch does: for a weight [out, in, k...], receptive = prod(k...),
// fan_in = in * receptive and fan_out = out * receptive (Linear [out, in]: in and out;
// Conv2d [K, C, R, S]: C*R*S and K*R*S).
#include <cstdint>
#include <utility>

#include "core/generator.h"
#include "core/tensor.h"

namespace tandem::nn::init {

enum class FanMode : uint8_t { FanIn, FanOut };
enum class Nonlinearity : uint8_t { Linear, Conv, Sigmoid, Tanh, Relu, LeakyRelu };

// The recommended gain of a nonlinearity (torch.nn.init.calculate_gain); `param` is the
// negative slope of LeakyRelu.
double calculate_gain(Nonlinearity nl, double param = 0.01);
// {fan_in, fan_out}; ValueError for a tensor with fewer than 2 dims.
std::pair<int64_t, int64_t> fan_in_and_fan_out(const Shape& shape);

void uniform_(const Tensor& t, double lo = 0.0, double hi = 1.0,
              Generator& gen = default_generator());
void normal_(const Tensor& t, double mean = 0.0, double stddev = 1.0,
             Generator& gen = default_generator());
void constant_(const Tensor& t, double value);
void zeros_(const Tensor& t);
void ones_(const Tensor& t);

// U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)).
void xavier_uniform_(const Tensor& t, double gain = 1.0, Generator& gen = default_generator());
// N(0, std), std = gain * sqrt(2 / (fan_in + fan_out)).
void xavier_normal_(const Tensor& t, double gain = 1.0, Generator& gen = default_generator());
// U(-b, b), b = gain * sqrt(3 / fan), gain = calculate_gain(nl, a).
void kaiming_uniform_(const Tensor& t, double a = 0.0, FanMode mode = FanMode::FanIn,
                      Nonlinearity nl = Nonlinearity::LeakyRelu,
                      Generator& gen = default_generator());
// N(0, std), std = gain / sqrt(fan).
void kaiming_normal_(const Tensor& t, double a = 0.0, FanMode mode = FanMode::FanIn,
                     Nonlinearity nl = Nonlinearity::LeakyRelu,
                     Generator& gen = default_generator());

// PyTorch's default for Linear and Conv2d: weight kaiming_uniform_(a = sqrt(5)), i.e.
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), then bias (if defined) from the same range. A no-op,
// drawing nothing, while a SkipDefaultInitGuard is alive on this thread.
void default_layer_init_(const Tensor& weight, const Tensor& bias,
                         Generator& gen = default_generator());

// Note [drawing the initialization once]: a model that overwrites every layer's default
// initialization (models::init_cnn) builds its layers under this guard, so each weight is
// drawn once, from the distribution it keeps, instead of drawn by default_layer_init_ and
// then redrawn (what torch.nn.utils.skip_init does for one module). The layers' weights and
// biases are left uninitialized until the caller fills them. Thread-local and nestable, like
// NoGradGuard.
class SkipDefaultInitGuard {
 public:
  SkipDefaultInitGuard();
  ~SkipDefaultInitGuard();
  SkipDefaultInitGuard(const SkipDefaultInitGuard&) = delete;
  SkipDefaultInitGuard& operator=(const SkipDefaultInitGuard&) = delete;
  static bool active();

 private:
  bool previous_;
};

}  // namespace tandem::nn::init
