#pragma once
// The backends' factories, for process_group.cpp's new_process_group. Each is defined in its
// own file and throws DistError when its engine is not in this build.
#include <memory>
#include <string>

#include "parallel/distributed/process_group.h"

namespace tandem::parallel::distributed {

// CPU tensors over Gloo's TCP transport (process_group_gloo.cpp). master_addr picks the
// address Gloo's pairs listen on (loopback for a job on loopback).
std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options, const std::string& master_addr);
// This rank's GPU (the current CUDA device) over NCCL (process_group_nccl.cpp).
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options);

}  // namespace tandem::parallel::distributed
