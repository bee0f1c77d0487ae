// LayerNorm over the last dim of a float32 [rows, hidden] array, forward and backward, as XLA FFI
// handlers for the CPU backend (core/fusions/fused_layer_norm.py builds and registers them).
// One pass over each row in each direction; XLA's CPU code for the same math makes several
// passes over the whole array.
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

int64_t Hidden(const ffi::Buffer<ffi::F32>& x) { return x.dimensions().back(); }

ffi::Error Forward(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                   ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> mean,
                   ffi::ResultBuffer<ffi::F32> rstd, float eps) {
  const int64_t h = Hidden(x), rows = h ? x.element_count() / h : 0;
  const float* xs = x.typed_data();
  const float* g = scale.typed_data();
  const float* b = bias.typed_data();
  float* ys = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xs + r * h;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < h; ++c) sum += xr[c];
    const float mu = sum / h;
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < h; ++c) sq += (xr[c] - mu) * (xr[c] - mu);
    const float rs = 1.f / std::sqrt(sq / h + eps);
    float* yr = ys + r * h;
    for (int64_t c = 0; c < h; ++c) yr[c] = (xr[c] - mu) * rs * g[c] + b[c];
    mean->typed_data()[r] = mu;
    rstd->typed_data()[r] = rs;
  }
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                    ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd, ffi::ResultBuffer<ffi::F32> dx,
                    ffi::ResultBuffer<ffi::F32> dscale, ffi::ResultBuffer<ffi::F32> dbias) {
  const int64_t h = Hidden(x), rows = h ? x.element_count() / h : 0;
  const float* g = scale.typed_data();
  std::vector<float> xhat(h), gdy(h), ds(h, 0.f), db(h, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.typed_data() + r * h;
    const float* dyr = dy.typed_data() + r * h;
    const float mu = mean.typed_data()[r], rs = rstd.typed_data()[r];
    float a = 0.f, bsum = 0.f;
#pragma omp simd reduction(+ : a, bsum)
    for (int64_t c = 0; c < h; ++c) {
      xhat[c] = (xr[c] - mu) * rs;
      gdy[c] = dyr[c] * g[c];
      a += gdy[c];
      bsum += gdy[c] * xhat[c];
      ds[c] += dyr[c] * xhat[c];
      db[c] += dyr[c];
    }
    a /= h;
    bsum /= h;
    float* dxr = dx->typed_data() + r * h;
    for (int64_t c = 0; c < h; ++c) dxr[c] = rs * (gdy[c] - a - xhat[c] * bsum);
  }
  for (int64_t c = 0; c < h; ++c) {
    dscale->typed_data()[c] = ds[c];
    dbias->typed_data()[c] = db[c];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
