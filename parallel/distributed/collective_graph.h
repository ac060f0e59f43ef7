#pragma once
// A CUDA graph that holds collectives of process groups: a DDP rank's whole step -- forward,
// backward with its bucket allreduces, the optimizer -- captured once and replayed with one
// launch, as one device's step is (core/cuda_graph.h).
//
// Note [collectives in a CUDA graph]: NCCL's collectives are kernels on the group's
// communication stream, ordered after the caller's work by an event; a capture on the caller's
// stream follows that event onto the communication stream and back, so the graph holds them
// like any kernel, and NCCL lets the same communicator run captured and eager collectives in
// stream order. What a graph does not replay is the host side of a collective: its sequence
// number (the fingerprints, the progress a rank publishes, the "did not arrive" of a failure
// message all count collectives), and its place on the list of collectives in flight that the
// monitor checks against the deadline. Without that a replay would be invisible to the group:
// a peer that died would leave this rank's replay waiting forever inside NCCL, which is the one
// thing a process group must never do. So CollectiveGraph tells each group about every launch
// (ProcessGroup::graph_launched): the group numbers the graph's collectives as if issued one by
// one (except on the launch right after the capture, which is the step whose issuing numbered
// them), and puts one entry for the whole replay on its in-flight list -- an event after the
// launch, with the group's deadline. A timeout or an engine error then fails the group as for
// an eager collective ("the 2 collectives #41..#42 replayed from a CUDA graph on rank 0 of 2:
// timed out after 30 s; rank 1 is gone"), the abort ends the kernels the replay is running,
// and the next launch throws the group's error instead of replaying.
//
// The ranks need not agree on which steps replay: a replay issues exactly the collectives the
// captured step issued, in the same order and sizes, so a rank running a step eagerly (its
// capture was refused, its last batch has another shape) pairs with a rank replaying it, and
// the sequence numbers stay equal. Only backends whose collectives can be captured qualify
// (supports_capture: NCCL); with any other, can_capture is false and StepGraph runs eagerly.
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_graph.h"
#include "parallel/distributed/process_group.h"

namespace tandem::parallel::distributed {

class CollectiveGraph final : public CUDAGraph {
 public:
  // The groups whose collectives the captured work issues. `graph`: the capture itself (a
  // test's stand-in; default CUDAGraph's).
  explicit CollectiveGraph(std::vector<std::shared_ptr<ProcessGroup>> groups, std::unique_ptr<CUDAGraph> graph = nullptr);

  // A CUDA device that every group runs on, with backends that support capture.
  bool can_capture(Device device) const override;
  // Why can_capture(device) is false ("" when it is true), for the one line that says the
  // step runs eagerly.
  std::string why_not(Device device) const;

  void capture_begin(Device device) override;
  void capture_end() override;
  void capture_abort() noexcept override;
  // Checks every group, launches, then tells every group (Note [collectives in a CUDA graph]).
  void replay() const override;
  // The same, with the step's inputs copied inside the graph (Note [input copies inside the
  // graph] in core/cuda_graph.h): the wrapped capture finds and points its copies.
  bool copies_inside(Device device) const override { return graph_->copies_inside(device); }
  bool bind_copies(const std::vector<std::pair<void*, size_t>>& dsts) override { return graph_->bind_copies(dsts); }
  void replay_from(const std::vector<const void*>& sources) override;
  void reset() noexcept override;
  bool captured() const override { return graph_->captured(); }
  size_t num_nodes() const override { return graph_->num_nodes(); }
  size_t unbacked_bytes() const override { return graph_->unbacked_bytes(); }

  // Collectives of groups[i] in the captured graph.
  const std::vector<uint64_t>& collectives() const { return counts_; }

 private:
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
  std::unique_ptr<CUDAGraph> graph_;
  std::vector<uint64_t> begin_seq_;  // each group's sequence number when the capture began
  std::vector<uint64_t> counts_;
  mutable bool fresh_ = false;  // captured, not launched yet: the capture numbered its collectives
  void check_groups() const;
  void launched() const;
};

}  // namespace tandem::parallel::distributed
