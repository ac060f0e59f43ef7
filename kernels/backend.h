#pragma once
// The kernel interface: one abstract Backend, implemented once for the CPU
// (kernels/cpu/, the reference) and once for CUDA (kernels/cuda/).
//
// Backends do no allocation and no shape inference: kernels/ops.cpp checks every argument,
// allocates outputs on the right device and then calls backend_for(device).op(...). A backend
// may assume what is documented for each method (shapes already compatible, same device, same
// dtype, contiguity where stated). CUDA methods enqueue on current_stream(device) and never
// synchronize the host.
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace tandem {

enum class UnaryOp : uint8_t { Neg, Exp, Log, Sigmoid, Relu, Tanh, Sqrt, Abs, Square, Reciprocal };

// Binary ops; AddRelu(a, b) = relu(a + b) (the sum rounded to the dtype first, so it equals
// the two ops bit for bit: a residual join in one pass); the *Backward ones fuse an
// activation's backward:
//   ReluBackward(g, x) = g * (x > 0)             (x = relu input or output: the same mask)
//   SigmoidBackward(g, y) = g * y * (1 - y)      (y = sigmoid output)
//   TanhBackward(g, y) = g * (1 - y * y)         (y = tanh output)
// Eq yields 1 or 0 in the output dtype (same as the inputs).
enum class BinaryOp : uint8_t {
  Add, Sub, Mul, Div, Max, Min, Eq, AddRelu, ReluBackward, SigmoidBackward, TanhBackward
};

// x op s, and RSub = s - x, RDiv = s / x, Pow = x^s.
enum class ScalarOp : uint8_t { Add, Mul, RSub, RDiv, Pow };

// The one reduction enum of tandem: the kernels' reduce() and the process groups' collectives
// (parallel/distributed/process_group.h) both take it. Avg is Mean under PyTorch's collective
// name (torch.distributed.ReduceOp.AVG): the same value, so a switch names only one of them.
enum class ReduceOp : uint8_t { Sum, Mean, Max, Avg = Mean };

enum class PoolMode : uint8_t { Max, Avg };

// The activation a fused linear layer applies to its output (Note [linear + activation]).
enum class Activation : uint8_t { None, Relu, Sigmoid };

struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
};

struct Pool2dParams {
  int64_t kernel_h = 2, kernel_w = 2;
  int64_t stride_h = 2, stride_w = 2;
  int64_t pad_h = 0, pad_w = 0;
  // Avg pooling divides by the full window (padding counts as zeros), as in PyTorch's
  // default count_include_pad=True and cuDNN's CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING.
};

// The optimizer steps' inputs. The host values are kernel arguments; a capturable step
// (Note [capturable optimizer steps] in nn/optim/optimizer.h) passes what changes between steps
// -- the learning rate, Adam's step count -- in device memory instead, so that a step replayed
// from a CUDA graph reads the current values.
struct SgdParams {
  double lr = 0.01, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false;
  bool first_step = true;  // momentum buffer is initialised to the gradient on the first step
  // Defined: float64 [] on the parameter's device, the learning rate the kernel reads instead
  // of `lr`. It is cast to the element type just as `lr` is, so the update is the same bits.
  Tensor lr_tensor;
  // Defined: a tensor of the parameter's numel on its device, of a floating dtype other than
  // the parameter's (bfloat16 for a float32 parameter), contiguous like the parameter or laid
  // out as it; after the update each new parameter value is written there too, cast: the same
  // bits as a cast of the updated parameter (Note [the weight copy written by the update] in
  // nn/optim/optimizer.h).
  Tensor copy_into;
};

struct AdamParams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;  // 1-based, for bias correction
  bool decoupled_weight_decay = false;  // AdamW when true
  // Defined: float64 [3] on the parameter's device as adam_advance_step writes it,
  // {lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t), 1 - lr * weight_decay}; the kernel reads these
  // instead of deriving them from `lr` and `step` (then unused).
  Tensor consts;
  // Defined: where the new parameter values are written too, cast (SgdParams::copy_into).
  Tensor copy_into;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Whether conv2d_* and batch_norm_* take channels-last tensors (Note [memory formats] in
  // core/tensor.h): then the dispatcher passes x, w, y (and dy, dx, dw) all contiguous or all
  // channels-last, and the kernels read the format from the strides. A backend without them
  // gets contiguous tensors only.
  virtual bool supports_channels_last() const { return false; }

  // out[...] = value. out: any strides.
  virtual void fill(const Tensor& out, double value) = 0;
  // dst = src, same device and shape, any strides, converting dtype.
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;
  // Raw bytes between devices or within one (contiguous, nbytes). Stream-ordered; a copy
  // into CPU memory from CUDA synchronizes that stream before returning.
  virtual void memcpy(void* dst, Device dst_device, const void* src, Device src_device,
                      size_t nbytes) = 0;

  // out = op(x). x and out: same shape and dtype, any strides (out may alias x).
  virtual void unary(UnaryOp op, const Tensor& x, const Tensor& out) = 0;
  // out = op(a, b). a and b are already broadcast to out's shape (zero strides allowed);
  // same dtype. out may alias a or b when their strides match out's.
  virtual void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  // out = op(x, s).
  virtual void scalar(ScalarOp op, const Tensor& x, double s, const Tensor& out) = 0;
  // out = alpha * x + beta * out (in place accumulate; same shape, any strides).
  virtual void axpby(double alpha, const Tensor& x, double beta, const Tensor& out) = 0;

  // x: [R, C] contiguous; out: [R] contiguous; reduces each row.
  virtual void reduce_rows(ReduceOp op, const Tensor& x, const Tensor& out) = 0;
  // x: [R, C] contiguous floating; out: [R] int64.
  virtual void argmax_rows(const Tensor& x, const Tensor& out) = 0;

  // c = alpha * op(a) @ op(b) + beta * c. a, b, c 2-D contiguous, floating, same dtype.
  // op(a) is [M, K], op(b) is [K, N], c is [M, N].
  virtual void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                    double beta, const Tensor& c) = 0;

  // Note [linear + activation]: a classifier layer of a small network is a product of a few
  // million multiply-adds followed by a bias add and an activation; as separate ops that is
  // four or five kernels forward (cuBLAS's split-K pair, the bias, the activation) and eight or
  // nine backward (the activation's gradient, two products with their split-K reductions, the
  // bias gradient's copy and sum), each a few microseconds of launch-bound work in a LeNet
  // step. Fused, a layer is one kernel forward and two backward.
  //
  // linear_forward: y [M, N] = act(x [M, K] @ w [N, K]^T + bias [N]) (bias undefined: none),
  // the bias added to the product's sum and the activation applied to that, in the element
  // type. x, w, bias, y contiguous, one floating dtype. Returns false, having done nothing,
  // when the backend has no fused kernel for these sizes or this dtype: the dispatcher then
  // composes gemm, the bias add and the activation (what the CPU, the reference, always does).
  virtual bool linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias,
                              Activation act, const Tensor& y) {
    (void)x, (void)w, (void)bias, (void)act, (void)y;
    return false;
  }
  // The backward of linear_forward from its output y and the output's gradient dy: with
  // dz = dy * act'(y) (ReluBackward / SigmoidBackward of dy and y; dy itself for None),
  // dx [M, K] = dz @ w, dw [N, K] = dz^T @ x and db [N] = the column sums of dz, each
  // computed when defined and overwritten; K = in_features, given even when neither x nor w
  // is (the choice of kernel depends on the layer's size, never on which gradients are
  // asked for, so db has the same bits either way). Returns false as linear_forward does.
  virtual bool linear_backward(const Tensor& dy, const Tensor& y, const Tensor& x,
                               const Tensor& w, Activation act, int64_t in_features,
                               const Tensor& dx, const Tensor& dw, const Tensor& db) {
    (void)dy, (void)y, (void)x, (void)w, (void)act, (void)in_features, (void)dx, (void)dw, (void)db;
    return false;
  }

  // Note [activation + pooling]: in a classic CNN (LeNet) a convolution's output goes through
  // an activation and then a pooling window that tiles it (kernel = stride, no padding). As two
  // ops that is four passes over the activation (the activation, the pool, and backward the
  // pool's gradient and the activation's); fused it is one each way: the forward reads z and
  // writes only the pooled y (the activation is recomputed backward from z, which is saved
  // instead of it), and the backward writes dz from dy and z directly.
  //
  // activation_pool2d_forward: y [N, C, P, Q] = pool(act(z)) for z [N, C, H, W] contiguous,
  // with the pooling ops' rules (the average over the whole window; the first maximum, a NaN
  // winning). activation_pool2d_backward: dz (overwritten) = act'(a) * the pooling gradient of
  // dy at a, a = act(z); dy contiguous. Both return false, having done nothing, where the
  // backend has no fused kernel (windows that overlap or pad, a dtype or a layout it does not
  // take): the dispatcher then composes the activation and pooling ops (what the CPU, the
  // reference, always does). bias, where defined ([C], z's dtype), is a convolution's bias the
  // convolution left out (Note [conv bias in activation + pooling] in kernels/ops.h): a = act(z
  // + bias[c]) in both, the add in z's dtype.
  virtual bool activation_pool2d_forward(const Tensor& z, const Tensor& bias, Activation act, PoolMode mode,
                                         const Pool2dParams& p, const Tensor& y) {
    (void)z, (void)bias, (void)act, (void)mode, (void)p, (void)y;
    return false;
  }
  virtual bool activation_pool2d_backward(const Tensor& dy, const Tensor& z, const Tensor& bias, Activation act,
                                          PoolMode mode, const Pool2dParams& p, const Tensor& dz) {
    (void)dy, (void)z, (void)bias, (void)act, (void)mode, (void)p, (void)dz;
    return false;
  }

  // x [N, C, H, W], w [K, C, R, S], bias [K] or undefined, y [N, K, P, Q]; all contiguous,
  // or all channels-last where supports_channels_last().
  virtual void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias,
                              const Conv2dParams& p, const Tensor& y) = 0;
  // dx [N, C, H, W] = conv-transpose of dy [N, K, P, Q] with w (overwrites dx).
  virtual void conv2d_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                                     const Tensor& dx) = 0;
  // dw [K, C, R, S] = correlation of x with dy (overwrites dw); db [K] (if defined) = sum of dy.
  // For bfloat16 x and dy, dw and db may be float32 (both, when db is defined): the gradient of
  // an autocast weight written into its float32 .grad (kernels::conv2d_backward_weight's
  // dw_into); each sum is then rounded to float32 instead of bfloat16 where the kernel can (CPU;
  // CUDA's one-channel kernels), else computed in bfloat16 and converted.
  virtual void conv2d_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p,
                                      const Tensor& dw, const Tensor& db) = 0;
  // db [K] = sum of dy [N, K, P, Q] over every dim but 1 (overwrites db): the bias gradient that
  // conv2d_backward_weight computes, the same bits (CUDA: but for the layers of Note [direct
  // convolution] and Note [one-input-channel convolution], whose kernels sum it with the weight
  // gradient). dy contiguous, or
  // channels-last where supports_channels_last().
  virtual void conv2d_backward_bias(const Tensor& dy, const Tensor& db) = 0;

  // x [N, C, H, W] -> y [N, C, P, Q]; contiguous.
  virtual void pool2d_forward(PoolMode mode, const Tensor& x, const Pool2dParams& p,
                              const Tensor& y) = 0;
  // dx (overwritten) from dy; max pooling routes each dy to the first maximum of its window in x.
  virtual void pool2d_backward(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                               const Pool2dParams& p, const Tensor& dx) = 0;

  // x [N, C] contiguous -> y [N, C] = log_softmax over C.
  virtual void log_softmax(const Tensor& x, const Tensor& y) = 0;
  // dx = dy - exp(y) * sum(dy) per row (y = log_softmax output).
  virtual void log_softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx) = 0;
  // Fused cross-entropy with mean reduction. logits [N, C], target int64 [N] in [0, C).
  // log_probs [N, C] (output, saved for backward), loss [] (output) = -mean(log_probs[i, t_i]).
  // Out-of-range targets: the CPU throws ValueError; CUDA traps the kernel.
  virtual void cross_entropy_forward(const Tensor& logits, const Tensor& target,
                                     const Tensor& log_probs, const Tensor& loss) = 0;
  // dlogits = (softmax - onehot(target)) * dloss / N, dloss a one-element tensor (no host read).
  virtual void cross_entropy_backward(const Tensor& log_probs, const Tensor& target,
                                      const Tensor& dloss, const Tensor& dlogits) = 0;
  // correct[0] += number of rows i with argmax(logits[i]) == target[i]. correct: int64 [1].
  virtual void count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct) = 0;

  // out[i, ...] = x[index[i], ...]. x contiguous, index int64 [M] contiguous, out [M, ...].
  // Out-of-range indices: the CPU throws ValueError; CUDA traps.
  virtual void index_select(const Tensor& x, const Tensor& index, const Tensor& out) = 0;
  // out[index[i], ...] += src[i, ...] (backward of index_select; out zeroed by the caller).
  virtual void index_add(const Tensor& src, const Tensor& index, const Tensor& out) = 0;

  // Batch normalization per channel over all other dims. x [N, C, H, W] or [N, C],
  // contiguous (or, where supports_channels_last(), x, y, dy and dx channels-last); gamma, beta, running_*, save_* are [C]. Training normalizes with the batch
  // mean and biased variance, writes save_mean and save_invstd = 1/sqrt(var + eps) for
  // backward, and updates running_mean/var in place with the unbiased variance:
  // running = (1 - momentum) * running + momentum * batch.
  // relu: y = relu(batch_norm(x)) in the same pass; the backward then takes that y as
  // relu_out and computes the batch-norm gradient of dy masked by relu_out > 0 (undefined
  // relu_out: no mask).
  // bias [C] (x's dtype; undefined: none): x is then the output z of a convolution run without
  // its bias, and the op is batch norm of z + bias (added as conv2d_forward adds it) without
  // storing z + bias (Note [conv bias in batch norm] in kernels/cuda/batchnorm.cuh); the backward
  // takes the same z and bias, and dx is the gradient with respect to z. dbias [C] (x's dtype;
  // undefined: not wanted) = the per-channel sum of dx, bit for bit what conv2d_backward_bias
  // computes from that dx.
  //
  // Note [batch norm + ReLU]: in a ResNet block, batch norm's output goes only to a ReLU. As
  // two ops that is, per activation, a batch-norm apply pass (read x, write y), a ReLU pass
  // (read y, write relu(y)), and in the backward a ReLU pass (read dy and the output, write
  // the masked dy) before batch norm's two passes over dy and x. Fused, the apply pass takes
  // the ReLU of the value it has just rounded, and the backward's passes read dy and the
  // output and mask as they go: one pass fewer forward, one fewer backward, and two fewer
  // activations written. The arithmetic is that of the two ops -- the ReLU of the rounded
  // batch-norm value, the mask ReluBackward applies -- so the results are the same bits
  // (tests/nn/test_batchnorm_relu.cpp, every device, format and dtype). The CPU, the
  // reference, fuses the forward and masks dy in a pass of its own.
  //
  // residual (x's shape, dtype and layout; undefined: none), with relu: y = relu(batch_norm(x)
  // + residual), the join at the end of a ResNet block (Note [batch norm + residual join] in
  // kernels/cuda/batchnorm.cu). Its backward is batch norm's on the masked gradient, which is
  // also the residual's: the passes of the two ops.
  //
  // num_batches_tracked (an int64 with one element; undefined: none): 1 added to it, in stream
  // order with the running statistics' update.
  virtual void batch_norm_forward_train(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                        const Tensor& beta, const Tensor& running_mean,
                                        const Tensor& running_var, double momentum, double eps,
                                        const Tensor& y, const Tensor& save_mean,
                                        const Tensor& save_invstd, bool relu,
                                        const Tensor& residual, const Tensor& num_batches_tracked) = 0;
  virtual void batch_norm_forward_eval(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                       const Tensor& beta, const Tensor& running_mean,
                                       const Tensor& running_var, double eps, const Tensor& y,
                                       bool relu) = 0;
  // dx, dgamma, dbeta (and dbias) are overwritten. masked_dy (dx's shape, dtype and layout;
  // undefined: not asked for; only with relu_out): also written, dy masked by the ReLU -- what
  // the ReluBackward op gives, the gradient of a joined residual (Note [batch norm + residual
  // join] in kernels/cuda/batchnorm.cu), which the CUDA kernels write in the pass that reads
  // dy and relu_out anyway. dy_part (dy's shape, dtype and layout; undefined: none): a second
  // gradient of the output, the gradient being dy + dy_part as BinaryOp::Add rounds it (Note
  // [gradient parts] in autograd/node.h), added as it is read where the kernels can.
  virtual void batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& bias,
                                   const Tensor& gamma, const Tensor& save_mean,
                                   const Tensor& save_invstd, const Tensor& relu_out,
                                   const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                   const Tensor& dbias, const Tensor& masked_dy, const Tensor& dy_part) = 0;

  // In-place optimizer updates on contiguous tensors of one dtype (and p.copy_into, when
  // defined, of another).
  virtual void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
                        const SgdParams& p) = 0;
  virtual void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                         const Tensor& v, const AdamParams& p) = 0;
  // A capturable Adam step's first kernel: step (float32 [], PyTorch's state["step"]) += 1,
  // then consts (float64 [3]) as AdamParams::consts describes, with t the new count, lr
  // (float64 []) read from memory and beta1, beta2, weight_decay from p. All on one device;
  // one thread's work.
  virtual void adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                                 const AdamParams& p) = 0;
};

// Process-wide speed/precision settings of the CUDA backend, read when a cuDNN convolution
// plan is made (so set them before the first convolution of a shape). No effect on the CPU.
//
// allow_tf32 (default true, as PyTorch's torch.backends.cudnn.allow_tf32): float32
//   convolutions may use TF32 tensor cores, whose inputs keep a 10-bit mantissa, so results
//   differ from the CPU's by about 1e-3 relative. Off: float32 FMA kernels only, within ~1e-5
//   of the CPU (the test suite turns it off). Environment: TANDEM_ALLOW_TF32=0 turns it off.
//   Matrix products (cuBLAS) always run in full float32, as PyTorch's default.
// cudnn_benchmark (default false, as torch.backends.cudnn.benchmark): time cuDNN's candidate
//   engines once per configuration instead of trusting its heuristics' first choice (graph-API
//   engines, Note [measured engine choice] in kernels/cuda/cudnn_graph.h; cudnnFind* on the
//   legacy path), which synchronizes once per configuration: warm up before capturing a CUDA
//   graph. Environment: TANDEM_CUDNN_BENCHMARK=1 turns it on.
// cudnn_benchmark_in_graph (default true): benchmark mode times each graph-API candidate as a
//   replayed CUDA graph runs it, not as eager launches (Note [engines timed in a graph] in
//   kernels/cuda/cudnn_graph.h). Environment: TANDEM_CUDNN_BENCHMARK_GRAPH=0 turns it off.
// cudnn_benchmark_rounds (default 3): how many times benchmark mode times each candidate
//   engine, the rounds interleaved, each candidate keeping its least time (Note [measured engine
//   choice]); 1 times each once, in order. Environment: TANDEM_CUDNN_BENCHMARK_ROUNDS=N (1-100).
// cudnn_benchmark_engines (default 16): at most how many of cuDNN's acceptable engines, in its
//   heuristics' order, benchmark mode times for a configuration (ResNet-18's step on an H100:
//   1.010x images/s with 16 against 8, 41 MB more at the peak for the larger workspaces of
//   some faster engines). Environment: TANDEM_CUDNN_BENCHMARK_ENGINES=N (1-64).
// cudnn_benchmark_log (default false): benchmark mode prints, for each configuration it times,
//   every candidate's engine index and time, the choice in brackets, to stderr. Environment:
//   TANDEM_CUDNN_BENCHMARK_LOG=1 turns it on.
// cudnn_memsets_as_kernels (default true): inside a CUDA graph capture, each graph-API cuDNN
//   call is captured into a small graph of its own whose memset nodes become kernel nodes
//   writing the same bytes, and that graph joins the capture as a child graph (Note [cuDNN's
//   memsets in a captured graph] in kernels/cuda/graph_memset.cu); outside a capture, nothing
//   changes. Environment: TANDEM_CUDNN_MEMSET_KERNELS=0 turns it off.
// programmatic_launch (default true): tandem's kernels on a step's hot path (batch norm's
//   passes, the elementwise maps, LeNet's kernels, SGD) launch while the kernel before them in
//   the stream finishes, and wait for it before they touch memory (Note [programmatic dependent
//   launch] in kernels/cuda/common.cuh; sm_90 on): the same values, the launch and the ramp
//   hidden (ResNet-18 on an H100: +1.7% images/s). Environment: TANDEM_PDL=0 turns it off.
// cudnn_prepare_ahead (default true): inside a CUDA graph capture, a graph-API cuDNN call whose
//   workspace fits the capturing stream's own gets that one, and the nodes that only prepare it
//   (a counter's clearing, cuDNN's workspace initialisation) run as soon as the previous call
//   on that workspace is done instead of just before the convolution (Note [a workspace
//   prepared ahead] in kernels/cuda/graph_memset.cu; ResNet-18 on an H100: +1.0% images/s).
//   Environment: TANDEM_CUDNN_PREPARE_AHEAD=0 turns it off.
// weight_copy_in_update (default true): a training step whose optimizer can write the
//   autocast weight copy (Note [the weight copy written by the update] in nn/optim/optimizer.h)
//   has the update write it instead of refreshing it with a cast at the next step's start
//   (ResNet-18 on an H100: +0.7% images/s). Environment: TANDEM_WEIGHT_COPY_IN_UPDATE=0 turns
//   it off.
// cudnn_graph_api (default true): convolutions run through cuDNN's graph API with execution
//   plans cached per configuration, far cheaper per call on the host than cuDNN's legacy entry
//   points (Note [cuDNN graph vs legacy calls] in kernels/cuda/cudnn_graph.h). Off, or when no
//   graph engine takes a configuration, or in benchmark mode: the legacy calls.
//   Environment: TANDEM_CUDNN_LEGACY=1 turns it off.
// cudnn_deterministic (default true; torch.backends.cudnn.deterministic, whose default is
//   false): only deterministic cuDNN engines, so a run repeats bit for bit
//   (Note [deterministic reductions]). Off: nondeterministic engines (atomic accumulation)
//   may be chosen where cuDNN ranks or times them first. Environment:
//   TANDEM_CUDNN_DETERMINISTIC=0 turns it off.
// direct_conv (default true): convolutions of few input channels at stride 1 (LeNet's, ResNet's
//   first) run tandem's own deterministic forward, input-gradient and weight-gradient kernels
//   instead of cuDNN's engines, in every mode (Note [direct convolution] in
//   kernels/cuda/conv_direct.cu); packed NCHW float32/float64 only. Environment:
//   TANDEM_DIRECT_CONV=0 turns it off.
void set_direct_conv(bool on);
bool direct_conv();
// one_channel_conv (default true): convolutions of one input channel (a first layer on grey
//   images: ResNet-18's stem on Fashion-MNIST), stride 1 or 2, filters up to 7x7, in bfloat16,
//   float32 or float64 with the output in either memory format, run tandem's own deterministic
//   forward and weight-gradient kernels instead of cuDNN's engines, in every mode (Note
//   [one-input-channel convolution] in kernels/cuda/conv_one_channel.cuh); the layers the direct
//   kernels take stay theirs. Environment: TANDEM_ONE_CHANNEL_CONV=0 turns it off.
void set_one_channel_conv(bool on);
bool one_channel_conv();
// direct_wgrad_shape (default {0, 0}: chosen from the shapes): the launch shape of the direct
//   weight-gradient kernel -- images per block and the target of threads per block -- for
//   bench_conv_small's sweep and for the tests of the shapes a default does not reach. A
//   setting, not a speed switch: every shape gives the same sums up to their order.
//   ValueError for a negative value, or threads above 1024.
struct DirectWgradShape {
  int images_per_block = 0;
  int threads = 0;
};
void set_direct_wgrad_shape(DirectWgradShape shape);
DirectWgradShape direct_wgrad_shape();
// row_conv_passes (default "dw"): the passes of a small stride-1 convolution (3- or 5-wide
//   filters, few channels; LeNet's second layer) that tandem's row-window kernels take when
//   direct_conv() is on (Note [row convolution] in kernels/cuda/conv_rows.cu): letters f
//   (forward), d (input gradient), w (weight gradient, where the direct kernel does not take
//   it), or "-" for none. The forward is off by default: measured slower than cuDNN's on an
//   H200. ValueError for another letter. Environment: TANDEM_ROW_CONV.
void set_row_conv_passes(const std::string& passes);
std::string row_conv_passes();
// Whether row_conv_passes() names `pass` ('f', 'd' or 'w'; false for another character).
bool row_conv_pass_on(char pass);
// fuse_bn_relu (default true): Residual blocks, and a Sequential's BatchNorm2d followed by a
//   ReLU, run the batch norm + ReLU as one op (batch_norm_relu; Note [batch norm + ReLU]): the
//   same values and gradients with one pass over the activations fewer forward and backward
//   (ResNet-18 on an H200: +2.5% images/s channels-last bf16, +2.2% float32). Environment:
//   TANDEM_FUSE_BN_RELU=0 turns it off.
void set_fuse_bn_relu(bool on);
bool fuse_bn_relu();
// fuse_bn_add_relu (default true): Residual blocks run their second batch norm and the join after
//   it, relu(bn2(...) + shortcut), as one op (batch_norm_add_relu; Note [batch norm + residual
//   join] in kernels/cuda/batchnorm.cu): the same values and gradients without writing and
//   reading the batch norm's output. Environment: TANDEM_FUSE_BN_ADD_RELU=0 turns it off.
void set_fuse_bn_add_relu(bool on);
bool fuse_bn_add_relu();
// fuse_conv_bias (default true): Residual blocks, and a Sequential's Conv2d
//   followed by a BatchNorm2d, run the convolution without its bias and add the bias inside
//   the batch norm's passes (batch_norm_bias; Note [conv bias in batch norm] in
//   kernels/cuda/batchnorm.cuh): the same values and gradients without the bias-add pass
//   forward and the bias-gradient pass backward. Only for a convolution with a bias whose
//   output goes to nothing but the batch norm. ResNet-18 on an H200: +2.9% images/s channels-last
//   bf16, +3.4% float32. Likewise a Sequential's Conv2d followed by an activation and a pooling
//   module fused by fuse_activation_pool(): the activation + pooling op adds the bias as it
//   reads the conv's output (Note [conv bias in activation + pooling] in kernels/ops.h; LeNet's
//   second convolution, whose forward is cuDNN's). Environment: TANDEM_FUSE_CONV_BIAS=0 turns
//   both off.
void set_fuse_conv_bias(bool on);
bool fuse_conv_bias();
// fuse_linear_activation (default true): a Sequential's Linear followed by a ReLU or a Sigmoid
//   runs as one linear op with the activation applied to its output (Note [linear +
//   activation]): the same values and gradients, the activation module skipped. On the CUDA
//   backend a small layer (LeNet's classifier) is then one kernel forward and two backward.
//   Environment: TANDEM_FUSE_LINEAR_ACT=0 turns it off.
void set_fuse_linear_activation(bool on);
bool fuse_linear_activation();
// fuse_activation_pool (default true): a Sequential's ReLU or Sigmoid followed by an
//   AvgPool2d or MaxPool2d runs as one op (activation_pool2d; Note [activation + pooling]): the
//   same values and gradients, the pooling module skipped. Environment: TANDEM_FUSE_ACT_POOL=0
//   turns it off.
void set_fuse_activation_pool(bool on);
bool fuse_activation_pool();
void set_cudnn_graph_api(bool on);
bool cudnn_graph_api();
void set_cudnn_deterministic(bool on);
bool cudnn_deterministic();
void set_allow_tf32(bool on);
bool allow_tf32();
void set_cudnn_benchmark(bool on);
bool cudnn_benchmark();
void set_cudnn_benchmark_in_graph(bool on);
bool cudnn_benchmark_in_graph();
void set_cudnn_benchmark_rounds(int rounds);
int cudnn_benchmark_rounds();
void set_cudnn_benchmark_engines(int engines);
int cudnn_benchmark_engines();
void set_cudnn_benchmark_log(bool on);
bool cudnn_benchmark_log();
void set_cudnn_memsets_as_kernels(bool on);
bool cudnn_memsets_as_kernels();
void set_programmatic_launch(bool on);
bool programmatic_launch();
void set_cudnn_prepare_ahead(bool on);
bool cudnn_prepare_ahead();
void set_weight_copy_in_update(bool on);
bool weight_copy_in_update();

// Threads OpenBLAS may use for one CPU matrix product (a process-wide setting of OpenBLAS).
// Note [one BLAS thread per virtual device]: when several virtual CPU devices train at once,
// each device is already a host thread; OpenBLAS's own threads would then oversubscribe the
// cores (measured on a 2-core machine: LeNet on cpu:0,cpu:1 ran at 10.6k images/s with
// OpenBLAS's default threads and 24.0k with one thread per product). DeviceWorkers on CPU
// devices therefore sets 1, unless OPENBLAS_NUM_THREADS is set in the environment.
void set_cpu_blas_threads(int n);

Backend& cpu_backend();
// Throws DeviceError when tandem was built without CUDA.
Backend& cuda_backend();
Backend& backend_for(Device d);

}  // namespace tandem
