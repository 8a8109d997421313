// Vector math shared by the AVX-512 kernels (cpu_kernels.cpp, prefill_attention.cpp).
#pragma once
#include <immintrin.h>

// exp(x) for 16 lanes: 2^(x log2 e) split into 2^n (scalef) and a degree-6 polynomial for 2^f, |f| <= 0.5;
// relative error about 2e-7. Inputs below -87 are taken as -87 (exp = 1.6e-38); above 88.7 give inf; NaN
// stays NaN (vmaxps returns its second operand where either is NaN: x goes second), as torch's softmax has it.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));   // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
