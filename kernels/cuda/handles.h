#pragma once
// cuBLAS and cuDNN handles: one per (device, host thread), created on first use and bound to
// the thread's current stream of the device on every call, so an op issued under a
// StreamGuard runs on that stream.
//
// The caller must have made `d` the current device (DeviceGuard) first: a handle belongs to
// the device that was current when it was created.
//
// Note [handle lifetime]: handles are never destroyed. When a thread exits, its handles go
// back to a per-device pool and the next thread to need one takes it from there, so a program
// that starts and stops worker threads creates only as many handles as it has threads alive
// at once. Destroying them at process exit would race with the CUDA runtime's own teardown.
#include <cublas_v2.h>
#include <cudnn.h>

#include "core/device.h"

namespace tandem::gpu {

// cuBLAS handle of d for this thread: stream = current_cuda_stream(d), math mode
// CUBLAS_DEFAULT_MATH (true float32, no TF32), and a workspace of its own for that stream
// (cuBLAS kernels running on two streams at once must not share one).
cublasHandle_t cublas_handle(Device d);

// cuDNN handle of d for this thread: stream = current_cuda_stream(d).
cudnnHandle_t cudnn_handle(Device d);

}  // namespace tandem::gpu
