#pragma once
// Everything in parallel/: the device API, device workers, scatter/gather, communicators
// (naive, ring, NCCL), flat gradient buffers, replicate, parallel_apply, the from-scratch
// trainer, DataParallel and the trace writer.
#include "parallel/comm.h"
#include "parallel/data_parallel.h"
#include "parallel/device_api.h"
#include "parallel/flat_buffer.h"
#include "parallel/parallel_apply.h"
#include "parallel/replicate.h"
#include "parallel/scatter.h"
#include "parallel/trace.h"
#include "parallel/trainer.h"
#include "parallel/workers.h"
