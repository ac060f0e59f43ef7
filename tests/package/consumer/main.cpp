// A program that uses tandem as a package: a Linear layer's forward and backward (BLAS) and a
// gzip-compressed IDX file written and read back (zlib). The package test checks the line.
#include <tandem/tandem.h>  // the package's umbrella header
#include "nn/nn.h"          // the tree's own include style works as well
#include <cstdio>

int main(int argc, char** argv) {
  using namespace tandem;
  nn::Linear layer(3, 2);
  layer.weight().copy_(from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
  layer.bias().fill_(0.5);
  Tensor y = sum(layer(from_vector<float>({1, -1, 2}, {1, 3})));  // (1-2+6) + (4-5+12) + 2 * 0.5
  y.backward();                                                    // dy/dW: x in each row
  const std::string path = std::string(argc > 1 ? argv[1] : ".") + "/labels.idx.gz";
  data::write_idx_labels(path, from_vector<int64_t>({3, 1, 4}, {3}), /*gzip=*/true);
  const std::vector<int64_t> labels = data::read_idx_labels(path).to_vector<int64_t>();
  std::printf("y=%g sum(dW)=%g labels=%lld%lld%lld\n", y.item(), sum(layer.weight().grad()).item(),
              (long long)labels[0], (long long)labels[1], (long long)labels[2]);
}
