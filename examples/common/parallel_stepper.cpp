#include "common/stepper.h"

namespace tandem::examples {

std::unique_ptr<Stepper> make_parallel_stepper(const TrainConfig& cfg) {
  TANDEM_THROW(Value, "training on several devices needs the parallel layer");
}

}  // namespace tandem::examples
