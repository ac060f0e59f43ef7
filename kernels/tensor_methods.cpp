// The Tensor members and factories that move or fill data (copy_, fill_, contiguous, clone,
// to, item, to_vector; empty, zeros, arange, rand, from_vector, from_blob, ...): they need a
// backend, so they live here rather than in core/tensor.cpp (core never depends on kernels).
#include <cstring>

#include "core/generator.h"
#include "core/tensor.h"
#include "kernels/backend.h"

namespace tandem {

namespace {

Backend& memcpy_backend(Device a, Device b) {
  return (a.is_cuda() || b.is_cuda()) ? cuda_backend() : cpu_backend();
}

// Copies the bytes of a contiguous tensor to a contiguous tensor of the same dtype and
// shape on another device. Note [cross-device ordering]: the copy runs on the destination
// device's current stream after waiting for the source's current stream, and the source's
// stream then waits for the copy, so neither the producer of src nor a later cudaFreeAsync of
// src (on its own stream) can race with the copy. No host synchronization, except into
// CPU memory from a GPU, where the data must be ready when the call returns.
void copy_between_devices(const Tensor& src, const Tensor& dst) {
  Device sd = src.device(), dd = dst.device();
  if (sd.is_cuda() && dd.is_cuda()) {
    Event produced;
    produced.record(current_stream(sd));
    produced.wait(current_stream(dd));
    cuda_backend().memcpy(dst.raw_data(), dd, src.raw_data(), sd, dst.nbytes());
    Event consumed;
    consumed.record(current_stream(dd));
    consumed.wait(current_stream(sd));
    return;
  }
  memcpy_backend(sd, dd).memcpy(dst.raw_data(), dd, src.raw_data(), sd, dst.nbytes());
}

}  // namespace

void Tensor::copy_(const Tensor& src) const {
  TANDEM_CHECK(defined() && src.defined(), Value, "copy_: undefined tensor");
  Tensor s = src.shape() == shape() ? src : src.expand(shape());
  if (numel() == 0) return;
  if (s.device() == device()) {
    backend_for(device()).copy(s, *this);
    return;
  }
  if (dtype() == s.dtype() && s.strides() == strides() && is_non_overlapping_and_dense()) {
    copy_between_devices(s, *this);  // the same dense layout on both sides (channels-last too)
    return;
  }
  Tensor sc = s.contiguous();  // on the source device
  if (is_contiguous() && dtype() == sc.dtype()) {
    copy_between_devices(sc, *this);
    return;
  }
  Tensor staged(shape(), sc.dtype(), device());
  copy_between_devices(sc, staged);
  backend_for(device()).copy(staged, *this);
}

void Tensor::fill_(double value) const {
  TANDEM_CHECK(defined(), Value, "fill_: undefined tensor");
  if (numel() > 0) backend_for(device()).fill(*this, value);
}

Tensor Tensor::contiguous() const { return contiguous(MemoryFormat::Contiguous); }

Tensor Tensor::contiguous(MemoryFormat format) const {
  return is_contiguous(format) ? *this : restrided(*this, format);
}

Tensor Tensor::clone() const {
  Tensor out(shape(), dtype(), device(), suggest_memory_format(*this));
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(Device d) const { return to(d, dtype()); }
Tensor Tensor::to(DType t) const { return to(device(), t); }

Tensor Tensor::to(Device d, DType t) const {
  if (d == device() && t == dtype()) return *this;
  check_device_exists(d);
  Tensor out(shape(), t, d, suggest_memory_format(*this));
  out.copy_(*this);
  return out;
}

double Tensor::item() const {
  TANDEM_CHECK(numel() == 1, Shape, "item: expected a one-element tensor, got ", shape_str(shape()));
  return to_vector<double>()[0];
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  Tensor host = to(kCPU, dtype_of<T>::value).contiguous();
  const T* p = host.data<T>();
  return std::vector<T>(p, p + host.numel());
}

template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;

// ---- factories ------------------------------------------------------------------------

Tensor empty(const Shape& shape, DType dtype, Device device, MemoryFormat format) {
  check_device_exists(device);
  return Tensor(shape, dtype, device, format);
}

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }
Tensor restrided(const Tensor& t, MemoryFormat format) {
  if (t.strides() == strides_for(t.shape(), format)) return t;
  Tensor out(t.shape(), t.dtype(), t.device(), format);
  out.copy_(t);
  return out;
}

Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device(), suggest_memory_format(t)); }
Tensor zeros_like(const Tensor& t) {
  Tensor z = empty_like(t);
  z.zero_();
  return z;
}

Tensor arange(int64_t start, int64_t end, int64_t step, DType dtype, Device device) {
  TANDEM_CHECK(step != 0, Value, "arange: step must not be 0");
  int64_t n = std::max<int64_t>(0, (end - start + step - (step > 0 ? 1 : -1)) / step);
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = start + i * step;
  return from_vector(v, {n}, device).to(dtype);
}

namespace {
template <typename Fill>
Tensor random_tensor(const Shape& shape, DType dtype, Device device, Generator* gen, Fill fill) {
  TANDEM_CHECK(is_floating(dtype), DType, "random tensors must be float32 or float64, got ", dtype_name(dtype));
  check_device_exists(device);
  Generator& g = gen ? *gen : default_generator(device);
  Tensor host(shape, kFloat64, kCPU);
  fill(g, host.data<double>(), host.numel());
  return host.to(device, dtype);
}
}  // namespace

Tensor uniform(const Shape& shape, double lo, double hi, DType dtype, Device device, Generator* gen) {
  return random_tensor(shape, dtype, device, gen,
                       [&](Generator& g, double* p, int64_t n) { g.uniform(p, n, lo, hi); });
}
Tensor normal(const Shape& shape, double mean, double stddev, DType dtype, Device device, Generator* gen) {
  return random_tensor(shape, dtype, device, gen,
                       [&](Generator& g, double* p, int64_t n) { g.normal(p, n, mean, stddev); });
}
Tensor rand(const Shape& shape, DType dtype, Device device, Generator* gen) {
  return uniform(shape, 0.0, 1.0, dtype, device, gen);
}
Tensor randn(const Shape& shape, DType dtype, Device device, Generator* gen) {
  return normal(shape, 0.0, 1.0, dtype, device, gen);
}

template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  TANDEM_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), Shape, "from_vector: ",
               values.size(), " values for shape ", shape_str(shape));
  Tensor host(shape, dtype_of<T>::value, kCPU);
  if (!values.empty()) std::memcpy(host.raw_data(), values.data(), values.size() * sizeof(T));
  return device.is_cpu() && device.index == 0 ? host : host.to(device);
}

template Tensor from_vector<float>(const std::vector<float>&, const Shape&, Device);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&, Device);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&, Device);
template Tensor from_vector<uint8_t>(const std::vector<uint8_t>&, const Shape&, Device);

Tensor from_blob(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner) {
  auto impl = std::make_shared<TensorImpl>();
  size_t nbytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  DataPtr ptr(data, [owner](void*) {});
  impl->storage = std::make_shared<Storage>(kCPU, nbytes, std::move(ptr));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

}  // namespace tandem
