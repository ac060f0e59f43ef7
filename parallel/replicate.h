#pragma once
// replicate: one copy of a model per device, made once.
//
// Note [why replicas are not re-copied]
// In data-parallel training every replica starts from the same parameters, receives the same
// averaged gradient (the allreduce leaves bit-identical sums on every device) and applies the
// same optimizer update with the same kernels. So the replicas stay identical by construction
// and the parameters never need to be copied again: a step moves only gradients. Re-copying
// the parameters every step (what PyTorch's nn.DataParallel does, because only its main
// module is updated) costs one model-sized broadcast per step. replicas_in_sync() checks the
// invariant in tests; broadcast_parameters() restores it after anything that breaks it (a
// checkpoint loaded into one replica, an update on one replica only).
#include <memory>
#include <vector>

#include "nn/module.h"

namespace tandem::parallel {

class Communicator;

using Replicas = std::vector<std::shared_ptr<nn::Module>>;

// replicas[0] is `module` itself, moved to devices[0] in place (Module::to keeps parameter
// identities, so an optimizer built on it keeps working); replicas[i] is module->clone()
// moved to devices[i]. Throws for an invalid device list or a null module.
Replicas replicate(const std::shared_ptr<nn::Module>& module, const std::vector<Device>& devices);

// The parameters that require grad, in parameters() order: what gets a gradient buffer.
std::vector<Tensor> trainable_parameters(const nn::Module& module);

// Throws ShapeError/ValueError naming the parameter (or buffer) unless every replica has the
// same parameter and buffer names, shapes and dtypes as replicas[0], in the same order.
void check_replicas(const Replicas& replicas);

// Copies replicas[0]'s parameters and buffers into the other replicas (stream-ordered
// device-to-device copies into their existing storage; no host sync, no new tensors), or
// through comm.broadcast when given (one call per tensor).
void broadcast_parameters(const Replicas& replicas, Communicator* comm = nullptr);

// The largest |difference| between any replica's parameter (and, with `buffers`, buffer)
// and replicas[0]'s, relative to max(1, max |replicas[0] value|) per tensor. Synchronizes.
// (BatchNorm running statistics are per replica in ScratchTrainer: pass buffers = false.)
double replicas_max_difference(const Replicas& replicas, bool buffers = true);
// replicas_max_difference(replicas, buffers) <= tol (tol 0: bit-identical values).
bool replicas_in_sync(const Replicas& replicas, double tol = 0.0, bool buffers = true);

// Moves `tensors` (one device, one dtype; ValueError/DeviceError/DTypeError naming the tensor
// otherwise) into one contiguous buffer, in order, and returns it: each tensor keeps its
// TensorImpl (autograd state, .grad, hooks, optimizer references) and its values, but its storage
// becomes its slice of the buffer. A model's parameters so coalesced are copied between devices
// with one copy instead of one per tensor. Returns an undefined tensor for an empty list.
Tensor coalesce(const std::vector<Tensor>& tensors);
// coalesce(tensors) when they share one device and dtype; otherwise an undefined tensor, and
// nothing changes.
Tensor try_coalesce(const std::vector<Tensor>& tensors);
// `tensors` (one device) grouped by dtype, in order of each dtype's first appearance and in
// list order within a group, each group coalesced into one flat tensor: a model's buffers mix
// float running statistics with int64 counters (BatchNorm's num_batches_tracked), and so stay
// one copy or one collective per dtype instead of one per tensor.
struct CoalescedGroups {
  std::vector<std::vector<Tensor>> groups;  // groups[g]: the tensors of one dtype
  std::vector<Tensor> flats;                // flats[g]: groups[g] coalesced
};
CoalescedGroups coalesce_by_dtype(const std::vector<Tensor>& tensors);
// Whether `tensors` are still, in order, the consecutive contiguous slices filling `flat`
// (false once something replaced a tensor's storage, e.g. Module::to). Pointer checks only.
bool is_coalesced(const std::vector<Tensor>& tensors, const Tensor& flat);

// A copy of `module` whose parameters and buffers share the storage of module's: the same
// numbers, written by the same updates, but separate autograd leaves with their own .grad.
// DataParallel runs its device-0 replica through one of these, so gradients of that replica
// can be combined with the others' before they reach the module's own .grad.
std::shared_ptr<nn::Module> shallow_replica(const nn::Module& module);
// Points `shallow`'s parameters and buffers at module's storage again (after module.to(...)
// moved it, say). Cheap when nothing moved: pointer comparisons only.
void reshare_storage(const nn::Module& module, nn::Module& shallow);

}  // namespace tandem::parallel
