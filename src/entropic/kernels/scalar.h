// bf16 storage read and rounded one value at a time, exactly as c10::BFloat16 rounds.
// Included inside a namespace (entropic_kernels by common.h, a level's own by level.h), once
// per translation unit, after <cmath>, <cstring> and isa.h.

inline float load(const float* p) { return *p; }
inline float load(const bf16_bits* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to the storage type: round-to-nearest-even for bf16, as c10::BFloat16 does.
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const bf16_bits*) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) {
    u = 0x7fc00000u;
  } else {
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  }
  float r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

inline void store(float* p, float f) { *p = f; }
inline void store(bf16_bits* p, float f) {  // f must already be rounded (round_to)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  *p = bf16_bits(u >> 16);
}
