/* The vector unit the CPU kernels are written for: one `vec` is one of the target's vector registers,
 * chosen by the compiler's predefined macros (that is, by -march), so the same source builds for every
 * ISA: AVX-512 (16 floats, 32 registers), AVX/AVX2 (8 floats, 16 registers), Arm NEON (4 floats, 32
 * registers; also on SVE machines, whose SVE units have NEON's peak rate on Graviton 3 and Grace), and
 * 4 floats with 16 registers anywhere else (SSE on x86-64-v1/v2). Only GCC/Clang vector extensions are
 * used, no intrinsics and no ISA-specific asm.
 */
#ifndef VLM_SERVE_SIMD_H
#define VLM_SERVE_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define REGISTERS 32
#define ISA "AVX-512"
#elif defined(__AVX2__)
#define LANES 8
#define REGISTERS 16
#define ISA "AVX2"
#elif defined(__AVX__)
#define LANES 8
#define REGISTERS 16
#define ISA "AVX"
#elif defined(__aarch64__)
#define LANES 4
#define REGISTERS 32
#define ISA "NEON"
#elif defined(__x86_64__)
#define LANES 4
#define REGISTERS 16
#define ISA "SSE"
#else
#define LANES 4
#define REGISTERS 16
#define ISA "generic"
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* Keeps a vector in a register from here on (an empty asm the compiler cannot see through), so that a
 * value loaded once feeds every multiply-add that uses it instead of being loaded again for each. */
#if defined(__x86_64__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* (an initializer is one broadcast; `(vec){0} + s` would add 0.0 first, and a loop makes inserts) */
#define S4(s) s, s, s, s
#if LANES == 16
static inline vec splat(float s) { return (vec){S4(s), S4(s), S4(s), S4(s)}; }
#elif LANES == 8
static inline vec splat(float s) { return (vec){S4(s), S4(s)}; }
#else
static inline vec splat(float s) { return (vec){S4(s)}; }
#endif

/* {0, 1, ..., LANES - 1} */
static inline vec lane_index(void) {
    static const float index[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return load(index);
}

/* where mask (a comparison's result) holds, a; elsewhere b */
static inline vec vselect(ivec mask, vec a, vec b) {
    ivec ia, ib;
    memcpy(&ia, &a, sizeof a);
    memcpy(&ib, &b, sizeof b);
    ia = (ia & mask) | (ib & ~mask);
    memcpy(&a, &ia, sizeof a);
    return a;
}

static inline vec vmax(vec a, vec b) { return vselect(a > b, a, b); }

/* v with its halves swapped, then its quarters, ...: the steps of a horizontal reduction */
#if LANES == 16
#define FOLD(v, f) \
    v = f(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)); \
    v = f(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)); \
    v = f(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)); \
    v = f(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))
#elif LANES == 8
#define FOLD(v, f) \
    v = f(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3)); \
    v = f(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5)); \
    v = f(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))
#else
#define FOLD(v, f) \
    v = f(v, __builtin_shufflevector(v, v, 2, 3, 0, 1)); \
    v = f(v, __builtin_shufflevector(v, v, 1, 0, 3, 2))
#endif

static inline vec vadd(vec a, vec b) { return a + b; }

static inline float hsum(vec v) {
    FOLD(v, vadd);
    return v[0];
}

static inline float hmax(vec v) {
    FOLD(v, vmax);
    return v[0];
}

/* e^x for a vector, to about 2 ulp; 0 at or below -87 (float e^x underflows there), masked scores too */
static inline vec vexp(vec x) {
    const vec lo = splat(-87.0f), round = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const ivec under = x <= lo;
    x = vselect(under, lo, x);
    const vec n = (x * 1.44269504088896341f + round) - round;
    vec r = x - n * 0.693359375f; /* x - n ln 2, with ln 2 in two parts so that the reduction is exact */
    r = r + n * 2.12194440e-4f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23; /* 2^n */
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return vselect(under, splat(0.0f), p * scale);
}

/* What the Python side asks every kernel library: the ISA it was built for, its vector width, and
 * whether this CPU can run it (a build for another -march than this machine's, or a cache shared with
 * other machines). These are compiled for the baseline ISA (BASELINE), so that they run anywhere. */
#if defined(__x86_64__)
#define BASELINE __attribute__((target("arch=x86-64")))
#else
#define BASELINE
#endif

BASELINE const char *kernel_isa(void) { return ISA; }

BASELINE int kernel_lanes(void) { return LANES; }

#if defined(__x86_64__)
BASELINE int kernel_runs_here(void) {
    __builtin_cpu_init();
#if defined(__AVX512F__)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
#if defined(__AVX512BF16__) && defined(VLM_SERVE_BF16_DOT)
           && __builtin_cpu_supports("avx512bf16")
#endif
        ;
#elif defined(__AVX2__)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
#elif defined(__AVX__)
    return __builtin_cpu_supports("avx");
#elif defined(__SSE4_2__)
    return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt");
#else
    return 1;
#endif
}
#else
int kernel_runs_here(void) { return 1; } /* NEON is part of every aarch64 CPU */
#endif

#endif
