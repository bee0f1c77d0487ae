// RMSNorm over the last dim of a float32 [rows, hidden] array, forward and backward, as XLA FFI
// handlers for the CPU backend (core/fusions/fused_layer_norm.py builds and registers them):
// y = x * rstd * scale with rstd = 1 / sqrt(mean(x^2) + eps). One pass over each row in each
// direction (the row's sum of squares, then its output), with the scale gradient accumulated
// along the way.
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

int64_t Hidden(const ffi::Buffer<ffi::F32>& x) { return x.dimensions().back(); }

ffi::Error Forward(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                   ffi::ResultBuffer<ffi::F32> rstd, float eps) {
  const int64_t h = Hidden(x), rows = h ? x.element_count() / h : 0;
  const float* xs = x.typed_data();
  const float* g = scale.typed_data();
  float* ys = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xs + r * h;
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < h; ++c) sq += xr[c] * xr[c];
    const float rs = 1.f / std::sqrt(sq / h + eps);
    float* yr = ys + r * h;
#pragma omp simd
    for (int64_t c = 0; c < h; ++c) yr[c] = xr[c] * rs * g[c];
    rstd->typed_data()[r] = rs;
  }
  return ffi::Error::Success();
}

// dx = rstd * (g*dy - xhat * mean(g*dy*xhat)), dscale = sum over rows of dy*xhat, xhat = x*rstd.
ffi::Error Backward(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                    ffi::Buffer<ffi::F32> rstd, ffi::ResultBuffer<ffi::F32> dx,
                    ffi::ResultBuffer<ffi::F32> dscale) {
  const int64_t h = Hidden(x), rows = h ? x.element_count() / h : 0;
  const float* g = scale.typed_data();
  std::vector<float> xhat(h), gdy(h), ds(h, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.typed_data() + r * h;
    const float* dyr = dy.typed_data() + r * h;
    const float rs = rstd.typed_data()[r];
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < h; ++c) {
      xhat[c] = xr[c] * rs;
      gdy[c] = dyr[c] * g[c];
      dot += gdy[c] * xhat[c];
      ds[c] += dyr[c] * xhat[c];
    }
    dot /= h;
    float* dxr = dx->typed_data() + r * h;
#pragma omp simd
    for (int64_t c = 0; c < h; ++c) dxr[c] = rs * (gdy[c] - xhat[c] * dot);
  }
  for (int64_t c = 0; c < h; ++c) dscale->typed_data()[c] = ds[c];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RMSNormForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RMSNormBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
