#include "parallel/distributed/collective_graph.h"

#include "core/error.h"

namespace tandem::parallel::distributed {

CollectiveGraph::CollectiveGraph(std::vector<std::shared_ptr<ProcessGroup>> groups, std::unique_ptr<CUDAGraph> graph)
    : groups_(std::move(groups)), graph_(graph ? std::move(graph) : std::make_unique<CUDAGraph>()) {
  for (const auto& g : groups_) TANDEM_CHECK(g != nullptr, Value, "CollectiveGraph: a process group is null");
}

std::string CollectiveGraph::why_not(Device device) const {
  if (!graph_->can_capture(device)) return "work on " + device.str() + " cannot be captured into a CUDA graph";
  for (const auto& g : groups_) {
    if (!g->supports_capture())
      return "the " + g->backend() + " process group runs its collectives on a host thread, which a CUDA graph "
             "cannot hold";
    if (g->device() != device)
      return "the process group works on " + g->device().str() + ", the step on " + device.str();
  }
  return "";
}

bool CollectiveGraph::can_capture(Device device) const { return why_not(device).empty(); }

void CollectiveGraph::capture_begin(Device device) {
  begin_seq_.clear();
  counts_.clear();
  fresh_ = false;
  for (const auto& g : groups_) begin_seq_.push_back(g->sequence_number());
  graph_->capture_begin(device);
}

void CollectiveGraph::capture_end() {
  graph_->capture_end();  // throws on a failed or refused capture: nothing to launch then
  for (size_t i = 0; i < groups_.size(); ++i) counts_.push_back(groups_[i]->sequence_number() - begin_seq_[i]);
  fresh_ = true;
}

void CollectiveGraph::capture_abort() noexcept {
  graph_->capture_abort();
  counts_.clear();
  fresh_ = false;
}

void CollectiveGraph::check_groups() const {
  for (const auto& g : groups_) g->check_healthy();  // a failed group replays nothing
}

void CollectiveGraph::launched() const {
  const bool numbered = fresh_;
  fresh_ = false;
  for (size_t i = 0; i < groups_.size(); ++i) groups_[i]->graph_launched(counts_[i], numbered);
}

void CollectiveGraph::replay() const {
  check_groups();
  graph_->replay();
  launched();
}

void CollectiveGraph::replay_from(const std::vector<const void*>& sources) {
  check_groups();
  graph_->replay_from(sources);
  launched();
}

void CollectiveGraph::reset() noexcept {
  graph_->reset();
  counts_.clear();
  fresh_ = false;
}

}  // namespace tandem::parallel::distributed
