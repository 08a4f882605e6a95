// The ISA level in use: the best level this build holds and this CPU runs, chosen at load;
// a lower one may be forced (kernels/__init__.py: ENTROPIC_ISA, set_isa).
//   isa() -> str              the level in use
//   isa_levels() -> str[]     the levels this build holds and this CPU runs, best first
//   set_isa(str level)        use `level` from now on (one of isa_levels())
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

#include "common.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace entropic_kernels {
namespace {

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and Linux's permission to use
// the tile state, which a process must ask for once (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA; granted on kernels that support AMX, refused elsewhere).
bool amx_usable() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}
#endif

// Whether the CPU (and the OS, which must save the wide registers) runs level i.
bool cpu_runs(int level) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  switch (level) {
    case 0: return avx512 && __builtin_cpu_supports("avx512bf16") && amx_usable();
    case 1: return avx512 && __builtin_cpu_supports("avx512bf16");
    case 2: return avx512;
    case 3: return avx2;
    default: return true;
  }
#else
  return level == kNumLevels - 1;
#endif
}

const Kernels* built(int level) {
  switch (level) {
    case 0: return kernels_amx();
    case 1: return kernels_avx512bf16();
    case 2: return kernels_avx512();
    case 3: return kernels_avx2();
    default: return kernels_generic();
  }
}

const Kernels* available(int level) { return cpu_runs(level) ? built(level) : nullptr; }

const Kernels* best() {
  for (int i = 0; i < kNumLevels; ++i)
    if (const Kernels* k = available(i)) return k;
  return kernels_generic();
}

std::atomic<const Kernels*> g_active{nullptr};

std::string isa() { return active().name; }

std::vector<std::string> isa_levels() {
  std::vector<std::string> out;
  for (int i = 0; i < kNumLevels; ++i)
    if (available(i) != nullptr) out.emplace_back(kLevelNames[i]);
  return out;
}

void set_isa(const std::string& level) {
  for (int i = 0; i < kNumLevels; ++i) {
    if (level == kLevelNames[i]) {
      const Kernels* k = available(i);
      TORCH_CHECK(k != nullptr, "set_isa: this CPU or build has no ", level,
                  " level (available: ", c10::Join(", ", isa_levels()), ")");
      g_active.store(k);
      return;
    }
  }
  TORCH_CHECK(false, "set_isa: unknown level '", level, "' (levels: amx, avx512bf16, avx512, "
              "avx2, generic)");
}

}  // namespace

const Kernels& active() {
  const Kernels* k = g_active.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = best();
    g_active.store(k);
  }
  return *k;
}

}  // namespace entropic_kernels

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("isa() -> str", &entropic_kernels::isa);
  m.def("isa_levels() -> str[]", &entropic_kernels::isa_levels);
  m.def("set_isa(str level) -> ()", &entropic_kernels::set_isa);
}
