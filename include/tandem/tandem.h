#pragma once
// tandem in one include: the public headers of every layer, for programs that use tandem as
// a package (`find_package(tandem)` or `add_subdirectory`, then `#include <tandem/tandem.h>`).
// The headers it names can be included one by one as well, in the style of the tree itself:
// `#include "nn/nn.h"`, `#include "core/tensor.h"`.
//
// Left out: what only the CUDA build or tandem's own sources include (core/cuda_check.h,
// core/cuda_stream.h, kernels/cuda/, kernels/cpu/, autograd/function.h, parallel/nccl_types.h,
// the store's wire protocol).

// core: tensors, devices, dtypes, streams, generators, errors
#include "core/bfloat16.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/generator.h"
#include "core/stream.h"
#include "core/tensor.h"

// kernels: non-differentiable ops and backend settings
#include "kernels/backend.h"
#include "kernels/ops.h"

// autograd: differentiable ops, grad mode, autocast, the engine, the weight-gradient stream, gradcheck
#include "autograd/anomaly.h"
#include "autograd/autocast.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/grad_stream.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"

// nn: modules, losses, init, optimizers, schedulers, models, checkpoints
#include "nn/nn.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/sync_batchnorm.h"

// data: datasets, loaders, samplers, IDX files
#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/distributed_sampler.h"
#include "data/fashion_mnist.h"
#include "data/idx.h"

// parallel: several devices in one process, then one process per device
#include "parallel/distributed/ddp.h"
#include "parallel/distributed/env.h"
#include "parallel/distributed/launch.h"
#include "parallel/distributed/process_group.h"
#include "parallel/distributed/store.h"
#include "parallel/parallel.h"
#include "parallel/pipeline/pipeline.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/split.h"
#include "parallel/sharded/fsdp.h"
#include "parallel/sharded/zero_optimizer.h"
#include "parallel/tensor_parallel.h"
