#include "nn/sync_batchnorm.h"

#include <algorithm>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/distributed/process_group.h"

namespace tandem::nn {

namespace {

using kernels::binary;
using kernels::sum_to;

// [1, C, 1, 1] (or [1, C]): a per-channel vector broadcast against x.
Shape channel_shape(const Tensor& x) {
  Shape s(static_cast<size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

Tensor k_mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Mul, a, b); }
Tensor k_sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Sub, a, b); }
Tensor k_add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Add, a, b); }
Tensor k_div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Div, a, b); }

// The dtype of the statistics (BatchNorm2d's rule: bfloat16 input, float32 statistics).
DType stats_dtype(const Tensor& x) { return x.dtype() == kBFloat16 ? kFloat32 : x.dtype(); }

struct GlobalStats {
  Tensor mean, invstd;  // [1, C, 1, 1] (channel_shape)
  Tensor count;         // [1]: N, the global number of values per channel
};

// Note [sync batch norm], forward: local triple -> allgather -> global mean and variance, and
// the running statistics. xc is x in the statistics dtype.
GlobalStats gather_stats(const Tensor& xc, const Tensor& running_mean, const Tensor& running_var,
                         double momentum, double eps, ProcessGroup& group) {
  const int64_t c = xc.size(1), w = group.size();
  const Shape cs = channel_shape(xc);
  // This rank's count is known from the shape (no device read); the others' arrive as data.
  const int64_t n = xc.numel() / c;
  const Tensor mean_l = kernels::scalar(ScalarOp::Mul, sum_to(xc, cs), 1.0 / double(std::max<int64_t>(n, 1)));
  const Tensor xm = k_sub(xc, mean_l);
  const Tensor m2_l = sum_to(k_mul(xm, xm), cs);
  Tensor local({2 * c + 1}, xc.dtype(), xc.device());  // [mean_r (C), M2_r (C), n_r]
  local.slice(0, 0, c).copy_(mean_l.reshape({c}));
  local.slice(0, c, 2 * c).copy_(m2_l.reshape({c}));
  local.slice(0, 2 * c, 2 * c + 1).fill_(double(n));
  Tensor all({w * (2 * c + 1)}, xc.dtype(), xc.device());  // [W, 2C + 1] in rank order
  group.allgather(all, local)->wait();
  const Tensor g = all.view({w, 2 * c + 1});
  const Tensor means = g.slice(1, 0, c).contiguous();              // [W, C]
  const Tensor m2s = g.slice(1, c, 2 * c).contiguous();            // [W, C]
  const Tensor counts = g.slice(1, 2 * c, 2 * c + 1).contiguous();  // [W, 1]
  const Tensor total = kernels::sum(counts, {0}, true);            // [1, 1]
  const Tensor mean = k_div(kernels::sum(k_mul(counts, means), {0}, true), total);  // [1, C]
  const Tensor d = k_sub(means, mean);
  const Tensor m2 = kernels::sum(k_add(m2s, k_mul(counts, k_mul(d, d))), {0}, true);  // [1, C]
  const Tensor var = k_div(m2, total);                                            // biased
  const Tensor invstd = kernels::unary(UnaryOp::Reciprocal,
                                       kernels::unary(UnaryOp::Sqrt, kernels::scalar(ScalarOp::Add, var, eps)));
  // running = (1 - momentum) running + momentum batch, with the unbiased variance M2 / (N - 1).
  kernels::axpby_(momentum, mean.reshape({c}), 1.0 - momentum, running_mean);
  const Tensor unbiased = k_div(m2, kernels::scalar(ScalarOp::Add, total, -1.0));
  kernels::axpby_(momentum, unbiased.reshape({c}), 1.0 - momentum, running_var);
  return {mean.reshape(cs), invstd.reshape(cs), total.reshape({1})};
}

void check_args(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                const Tensor& running_var) {
  TANDEM_CHECK(x.defined() && (x.dim() == 2 || x.dim() == 4) && x.size(1) > 0, Shape,
               "sync_batch_norm: expected [N, C] or [N, C, H, W] input with C > 0, got ",
               x.defined() ? x.str() : std::string("an undefined tensor"));
  TANDEM_CHECK(x.dtype() == kFloat32 || x.dtype() == kFloat64 || x.dtype() == kBFloat16, DType,
               "sync_batch_norm: input must be float32, float64 or bfloat16, got ", dtype_name(x.dtype()));
  const DType pd = stats_dtype(x);
  for (const Tensor* t : {&weight, &bias, &running_mean, &running_var}) {
    if (!t->defined()) continue;
    kernels::check_same_device("sync_batch_norm", {&x, t});
    TANDEM_CHECK(t->dtype() == pd && t->dim() == 1 && t->size(0) == x.size(1), Shape,
                 "sync_batch_norm: input ", dtype_name(x.dtype()), " ", shape_str(x.shape()), " needs ",
                 dtype_name(pd), " [", x.size(1), "] per-channel tensors, got ", t->str());
  }
  TANDEM_CHECK(running_mean.defined() && running_var.defined(), Value,
               "sync_batch_norm: running_mean and running_var are required");
}

}  // namespace

Tensor sync_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                       const Tensor& running_var, double momentum, double eps,
                       const std::shared_ptr<ProcessGroup>& process_group) {
  TANDEM_CHECK(process_group != nullptr, Value, "sync_batch_norm: no process group");
  ProcessGroup& group = *process_group;
  check_args(x, weight, bias, running_mean, running_var);
  TANDEM_CHECK(group.device().type == x.device().type, Device, "sync_batch_norm: input on ", x.device().str(),
               " but the ", group.backend(), " group of rank ", group.rank(), " works on ", group.device().str());
  const Shape cs = channel_shape(x);
  const int64_t c = x.size(1);
  const bool bf16 = x.dtype() == kBFloat16;
  const Tensor xc = bf16 ? x.to(kFloat32) : x.detach();  // [N, C, ...] in the statistics dtype
  const GlobalStats st = gather_stats(xc, running_mean, running_var, momentum, eps, group);
  // y = x * scale + shift, scale = gamma invstd, shift = beta - mean scale  (per channel)
  const Tensor scale = weight.defined() ? k_mul(st.invstd, weight.reshape(cs)) : st.invstd;
  Tensor shift = kernels::scalar(ScalarOp::Mul, k_mul(st.mean, scale), -1.0);
  if (bias.defined()) shift = k_add(shift, bias.reshape(cs));
  Tensor y = k_add(k_mul(xc, scale), shift);
  if (bf16) y = y.to(kBFloat16);
  y = y.contiguous(suggest_memory_format(x));  // x's memory format, as BatchNorm2d's output
  if (autograd::any_requires_grad({&x, &weight, &bias})) {
    using autograd::needs_grad;
    const bool nx = needs_grad(x), ng = needs_grad(weight), nb = needs_grad(bias);
    autograd::record(
        "SyncBatchNorm", {x, weight, bias}, {y},
        [nx, ng, nb, bf16, c, cs, group = process_group, xc = autograd::saved(xc), weight = autograd::saved(weight),
         mean = st.mean, invstd = st.invstd, total = st.count](autograd::TensorList&& g) -> autograd::TensorList {
          const Tensor dy = bf16 ? g[0].to(kFloat32) : g[0];
          const Tensor xmu = k_sub(xc, mean);
          const Tensor sum_dy = sum_to(dy, cs), sum_dy_xmu = sum_to(k_mul(dy, xmu), cs);  // this rank's
          Tensor dx, dw, db;
          if (ng) dw = k_mul(sum_dy_xmu, invstd).reshape({c});
          if (nb) db = sum_dy.reshape({c});
          if (nx) {
            Tensor sums({2 * c}, dy.dtype(), dy.device());  // [sum dy (C), sum dy (x - mean) (C)]
            sums.slice(0, 0, c).copy_(sum_dy.reshape({c}));
            sums.slice(0, c, 2 * c).copy_(sum_dy_xmu.reshape({c}));
            group->allreduce(sums, parallel::distributed::ReduceOp::Sum)->wait();
            const Tensor mean_dy = k_div(sums.slice(0, 0, c).reshape(cs), total);
            const Tensor k =
                k_div(k_mul(sums.slice(0, c, 2 * c).reshape(cs), k_mul(invstd, invstd)), total);  // [1, C, 1, 1]
            const Tensor a = weight.defined() ? k_mul(invstd, weight.reshape(cs)) : invstd;
            dx = k_mul(k_sub(k_sub(dy, mean_dy), k_mul(xmu, k)), a);
            if (bf16) dx = dx.to(kBFloat16);
          }
          return {dx, dw, db};
        });
  }
  return y;
}

SyncBatchNorm::SyncBatchNorm(int64_t num_features, double eps, double momentum,
                             std::shared_ptr<ProcessGroup> process_group)
    : BatchNorm2d(num_features, eps, momentum), group_(std::move(process_group)) {}

SyncBatchNorm::SyncBatchNorm(const BatchNorm2d& bn, std::shared_ptr<ProcessGroup> process_group)
    : BatchNorm2d(bn), group_(std::move(process_group)) {}

Tensor SyncBatchNorm::run(const Tensor& x, bool relu, const Tensor& conv_bias, const Tensor& residual) {
  if (!is_training()) return BatchNorm2d::run(x, relu, conv_bias, residual);  // running statistics, no collective
  TANDEM_CHECK(group_ != nullptr, Value, "SyncBatchNorm(", num_features(),
               "): training needs a process group; build it with one, or convert the model with "
               "convert_sync_batchnorm(model, group) once the process group exists");
  if (group_->size() == 1) return BatchNorm2d::run(x, relu, conv_bias, residual);  // exactly BatchNorm2d
  TANDEM_CHECK((x.dim() == 4 || x.dim() == 2) && x.size(1) == num_features(), Shape, "SyncBatchNorm(",
               num_features(), "): input ", shape_str(x.shape()), " is not [N, ", num_features(),
               ", H, W] or [N, ", num_features(), "]");
  const Tensor& count = num_batches_tracked();
  if (!one_.defined() || one_.device() != count.device()) one_ = ones({}, kInt64, count.device());
  kernels::axpby_(1.0, one_, 1.0, count);
  // The conv's bias, the residual join and the ReLU of the fused forms, as separate differentiable ops.
  Tensor z = x;
  if (conv_bias.defined()) {
    Shape cs(static_cast<size_t>(x.dim()), 1);
    cs[1] = x.size(1);
    z = tandem::add(x, tandem::reshape(conv_bias, cs));
  }
  Tensor y = sync_batch_norm(z, weight(), bias(), running_mean(), running_var(), momentum(), eps(), group_);
  if (residual.defined()) return tandem::add_relu(y, residual);
  return relu ? tandem::relu(y) : y;
}

std::shared_ptr<Module> SyncBatchNorm::convert_sync_batchnorm(std::shared_ptr<Module> module,
                                                              std::shared_ptr<ProcessGroup> process_group) {
  TANDEM_CHECK(module != nullptr, Value, "convert_sync_batchnorm: the module is null");
  TANDEM_CHECK(process_group != nullptr, Value,
               "convert_sync_batchnorm: no process group (init_process_group first and pass its group)");
  auto* bn = dynamic_cast<BatchNorm2d*>(module.get());
  if (bn != nullptr && dynamic_cast<SyncBatchNorm*>(bn) == nullptr) {
    return std::make_shared<SyncBatchNorm>(*bn, process_group);
  }
  for (const std::string& name : module->named_children().keys()) {
    const std::shared_ptr<Module> child = module->child(name);
    auto converted = convert_sync_batchnorm(child, process_group);
    if (converted != child) module->replace_module(name, converted);
  }
  return module;
}

}  // namespace tandem::nn
