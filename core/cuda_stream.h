#pragma once
// The CUDA side of core/stream.h: the cudaStream_t behind a tandem Stream. Include only from
// code built with TANDEM_WITH_CUDA (it pulls in cuda_runtime.h, which stream.h keeps out of
// every other translation unit).
#include <cuda_runtime.h>

#include "core/stream.h"

namespace tandem {
// The cudaStream_t of the current stream of d on this thread.
inline cudaStream_t current_cuda_stream(Device d) {
  return static_cast<cudaStream_t>(current_stream(d).handle());
}
}  // namespace tandem
