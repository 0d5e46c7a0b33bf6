// A region of a file compiled for extra x86 features (e.g. "avx2"), for code
// called only after a runtime CPU check. setup.py builds every file for the
// x86-64 baseline; torch's own kernels get AVX2 from per-capability builds,
// which a single extension module does not have. GCC takes `#pragma GCC
// target`; clang ignores it and takes `#pragma clang attribute` instead.
// Every header the region uses must be included before D9D_TARGET_BEGIN, so
// that no inline function shared with other files gets a body built for the
// extra features (the linker keeps one copy of each).
#pragma once

#define D9D_PRAGMA(x) _Pragma(#x)

#if defined(__x86_64__) && defined(__clang__)
#define D9D_HAS_TARGET_REGION 1
#define D9D_TARGET_BEGIN(features) \
  D9D_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define D9D_TARGET_END D9D_PRAGMA(clang attribute pop)
#elif defined(__x86_64__) && defined(__GNUC__)
#define D9D_HAS_TARGET_REGION 1
#define D9D_TARGET_BEGIN(features) D9D_PRAGMA(GCC push_options) D9D_PRAGMA(GCC target(features))
#define D9D_TARGET_END D9D_PRAGMA(GCC pop_options)
#endif
