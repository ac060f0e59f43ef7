#pragma once
// Reducer: the bucketing policy of a gradient allreduce, apart from what moves the bytes.
//
// Allreducing each gradient on its own pays a collective's fixed cost dozens of times per step;
// allreducing one flat buffer after backward (FlatBuffer, the in-process trainer) pays it once
// but waits for the whole backward first. The Reducer takes the middle road that PyTorch's
// DistributedDataParallel takes (flashlight's CoalescingReducer is the same idea):
//
//   1. assign_buckets: parameters go into buckets in *reverse* registration order — backward
//      produces the last layer's gradients first — each bucket up to a byte cap (25 MB; the
//      first bucket 1 MB, so the first allreduce starts early);
//   2. each bucket is one flat tensor and each parameter's .grad is a view into it, so
//      backward accumulates straight into the buckets (no copy); where the buckets allow, they
//      are slices of one buffer holding every gradient in parameter order, so the optimizer
//      can update the whole model at once (Note [gradients in parameter order]);
//   3. a gradient hook per parameter counts the bucket down; the moment a bucket's last
//      gradient is final, its reduction is launched — while backward goes on computing the
//      earlier layers' gradients (overlap);
//   4. buckets are launched strictly in bucket order, on every rank the same (a bucket that is
//      ready early waits for the ones before it), which is what collective engines require;
//   5. only a backward armed by prepare_for_backward is reduced (Note [the forward arms the
//      reducer]); others accumulate locally;
//   6. at the end of backward (autograd::queue_callback) what is left is launched and every
//      reduction is waited for — stream-ordered on GPUs, so the optimizer step that follows
//      runs after the reductions without the host ever waiting.
//
// How a bucket is reduced is the caller's: `launch(bucket, flat)` starts it and returns a
// function that makes later work wait for it. DistributedDataParallel launches an allreduce
// (average) on a process group; the same policy could drive an in-process Communicator.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::parallel {

// Buckets of indices into `params`, in the order they are filled and launched. Walking params
// from last to first, a bucket is closed before a parameter that would take it past its cap
// (a parameter larger than the cap gets a bucket of its own) or that differs in dtype or
// device. The first bucket's cap is first_cap_bytes, the others' cap_bytes. ValueError for a
// cap < 1 or an undefined parameter.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<Tensor>& params, int64_t cap_bytes,
                                                int64_t first_cap_bytes);

class Reducer {
 public:
  using Wait = std::function<void()>;
  // Starts reducing `flat` (bucket `bucket`) in place; returns what orders later work after it.
  using Launch = std::function<Wait(size_t bucket, const Tensor& flat)>;

  struct Options {
    bool find_unused_parameters = false;  // a parameter without a gradient is then zero, not an error
    bool overlap = true;  // false: launch every bucket after backward (for measuring the overlap)
  };

  // params: the trainable parameters (one device per bucket); names: for messages, one per
  // parameter; buckets from assign_buckets. The parameters' .grad become bucket views.
  Reducer(std::vector<Tensor> params, std::vector<std::string> names, std::vector<std::vector<size_t>> buckets,
          Launch launch, Options options);
  ~Reducer();  // removes the hooks
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Note [the forward arms the reducer]: a backward is reduced only when it was armed, as in
  // PyTorch (DDP's forward calls its Reducer's prepare_for_backward under grad mode and outside
  // no_sync). A backward that no prepare_for_backward armed -- through the module itself, or
  // after a forward inside no_sync -- accumulates into the buckets and reduces nothing, so one
  // rank can never start collectives that the others do not. Arming lasts until the end of
  // the next backward that produces a gradient for one of the parameters; it does not stack:
  // two prepare_for_backward calls before one backward arm that backward once, and a second
  // backward (retain_graph, or the other forward's graph) is local again.
  //
  // prepare_for_backward: arms the next backward, and attaches the bucket views as .grad again
  // where something (zero_grad) cleared them, zeroing them -- one fill per bucket when the whole
  // bucket was cleared.
  void prepare_for_backward();
  // Only the attaching of prepare_for_backward, without arming (a forward inside no_sync):
  // the unarmed backward then accumulates straight into the buckets.
  void attach_grads();
  // Whether the next backward will be reduced.
  bool armed() const { return armed_; }

  size_t num_buckets() const { return buckets_.size(); }
  const std::vector<size_t>& bucket_params(size_t b) const { return buckets_.at(b).params; }
  const Tensor& bucket_flat(size_t b) const { return buckets_.at(b).flat; }
  // Every gradient in one buffer in parameter order, the buckets its slices (Note [gradients
  // in parameter order] in reducer.cpp), or undefined when the buckets do not allow it.
  const Tensor& flat_gradients() const { return flat_; }
  // How many backward passes have been reduced (for tests and traces).
  int64_t reductions() const { return reductions_; }
  // Called with (bucket, launched = true) before each launch and (bucket, false) after each
  // wait — the trace hangs its spans here.
  void set_observer(std::function<void(size_t bucket, bool launched)> fn) { observer_ = std::move(fn); }

 private:
  struct Bucket {
    std::vector<size_t> params;
    Tensor flat;                // [total] of the bucket's dtype, on its device
    std::vector<Tensor> views;  // views[k]: params[k]'s gradient
    size_t pending = 0;         // gradients not yet final in this backward
    Wait wait;
  };
  void on_gradient(size_t param, const Tensor& grad);
  void mark_ready(size_t param);
  void launch_ready();
  void finish_backward();

  static std::vector<int64_t> parameter_order_offsets(const std::vector<Tensor>& params,
                                                      const std::vector<std::vector<size_t>>& buckets);

  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  Tensor flat_;  // all buckets, in parameter order, when the layout allows (else undefined)
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_, slot_of_;  // per parameter
  std::vector<char> ready_;                  // per parameter, this backward
  std::vector<int> hook_ids_;
  Launch launch_;
  Options options_;
  bool armed_ = false;        // Note [the forward arms the reducer]
  bool in_backward_ = false;  // an armed backward is under way
  size_t next_bucket_ = 0;  // the next bucket to launch
  int64_t reductions_ = 0;
  std::function<void(size_t, bool)> observer_;
};

}  // namespace tandem::parallel
