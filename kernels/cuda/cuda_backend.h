#pragma once
// The CUDA backend: every Backend method as a kernel launch (own kernels), a cuBLAS call or a
// cuDNN call, one op family per .cu file of this folder (elementwise, reduce, matmul, conv,
// pool, softmax, index, batchnorm, optim) plus memcpy.cpp.
//
// Contract on top of kernels/backend.h:
// - Each method makes the tensors' device current (DeviceGuard) and enqueues on
//   current_cuda_stream(device); nothing synchronizes the host except memcpy into CPU memory.
// - Temporary buffers (cuDNN workspaces, per-row partial results) come from allocate() on the
//   same stream and are released in stream order when the method returns.
// - Invalid class targets (cross_entropy_forward) and out-of-range indices (index_select,
//   index_add) trap the kernel (__trap()): the stream's context is then unusable and the next
//   checked CUDA call throws CudaError. count_correct never traps: an out-of-range target is
//   simply never counted as correct.
// - Numerics: float32 matmul runs in true float32 (cuBLAS CUBLAS_DEFAULT_MATH). float32
//   convolutions may use TF32 tensor cores unless allow_tf32() is off (then cuDNN
//   CUDNN_FMA_MATH, within ~1e-5 of the CPU); see Note [TF32] in conv.cu.
// - Determinism: see Note [deterministic reductions] in common.cuh. Nondeterministic in the
//   order of floating-point additions: index_add (atomicAdd), and the cuDNN convolution
//   backward algorithms only when no deterministic algorithm fits (conv.cu prefers them).
#include "kernels/backend.h"

namespace tandem {

class CudaBackend final : public Backend {
 public:
  bool supports_channels_last() const override { return true; }
  void fill(const Tensor& out, double value) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void memcpy(void* dst, Device dst_device, const void* src, Device src_device,
              size_t nbytes) override;

  void unary(UnaryOp op, const Tensor& x, const Tensor& out) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void scalar(ScalarOp op, const Tensor& x, double s, const Tensor& out) override;
  void axpby(double alpha, const Tensor& x, double beta, const Tensor& out) override;

  void reduce_rows(ReduceOp op, const Tensor& x, const Tensor& out) override;
  void argmax_rows(const Tensor& x, const Tensor& out) override;

  void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
            double beta, const Tensor& c) override;

  // tandem's own kernels for small layers (Note [linear + activation] in kernels/backend.h,
  // kernels/cuda/linear.cu); false for large ones and bfloat16.
  bool linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Activation act,
                      const Tensor& y) override;
  bool linear_backward(const Tensor& dy, const Tensor& y, const Tensor& x, const Tensor& w,
                       Activation act, int64_t in_features, const Tensor& dx,
                       const Tensor& dw, const Tensor& db) override;

  // Own kernels for tiling windows (Note [activation + pooling] in kernels/backend.h, pool.cu).
  bool activation_pool2d_forward(const Tensor& z, const Tensor& bias, Activation act, PoolMode mode,
                                 const Pool2dParams& p, const Tensor& y) override;
  bool activation_pool2d_backward(const Tensor& dy, const Tensor& z, const Tensor& bias, Activation act,
                                  PoolMode mode, const Pool2dParams& p, const Tensor& dz) override;

  void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                      const Tensor& y) override;
  void conv2d_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                             const Tensor& dx) override;
  void conv2d_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p,
                              const Tensor& dw, const Tensor& db) override;
  void conv2d_backward_bias(const Tensor& dy, const Tensor& db) override;

  void pool2d_forward(PoolMode mode, const Tensor& x, const Pool2dParams& p,
                      const Tensor& y) override;
  void pool2d_backward(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                       const Pool2dParams& p, const Tensor& dx) override;

  void log_softmax(const Tensor& x, const Tensor& y) override;
  void log_softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx) override;
  void cross_entropy_forward(const Tensor& logits, const Tensor& target, const Tensor& log_probs,
                             const Tensor& loss) override;
  void cross_entropy_backward(const Tensor& log_probs, const Tensor& target, const Tensor& dloss,
                              const Tensor& dlogits) override;
  void count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct) override;

  void index_select(const Tensor& x, const Tensor& index, const Tensor& out) override;
  void index_add(const Tensor& src, const Tensor& index, const Tensor& out) override;

  void batch_norm_forward_train(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                const Tensor& beta, const Tensor& running_mean,
                                const Tensor& running_var, double momentum, double eps,
                                const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                                bool relu, const Tensor& residual,
                                const Tensor& num_batches_tracked) override;
  void batch_norm_forward_eval(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                               const Tensor& beta, const Tensor& running_mean,
                               const Tensor& running_var, double eps, const Tensor& y,
                               bool relu) override;
  void batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& bias, const Tensor& gamma,
                           const Tensor& save_mean, const Tensor& save_invstd, const Tensor& relu_out,
                           const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                           const Tensor& dbias, const Tensor& masked_dy, const Tensor& dy_part) override;

  void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
                const SgdParams& p) override;
  void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                 const AdamParams& p) override;
  void adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                         const AdamParams& p) override;
};

}  // namespace tandem
