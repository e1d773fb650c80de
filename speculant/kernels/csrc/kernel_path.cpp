// Run-time choice of the kernel path (see kernel_path.h). Compiled with the common AVX2 flags:
// it only asks the CPU (through libgcc's cpuid tables, which also check that the OS saves the
// AVX-512 registers) and never runs the code of a path the CPU lacks.
#include "kernel_path.h"

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <iterator>
#include <string_view>

namespace speculant {
namespace {

struct PathInfo {
  KernelPath path;
  const char* name;
  const char* features;  // what the path needs, as lscpu / /proc/cpuinfo spell it
  bool (*supported)();
  bool wide_attention;  // attention with 512-bit vectors (needs AVX-512F)
};

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool has_avx512_vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// Linux keeps the 8 KB of tile registers out of a process's saved state until it asks for them
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without that permission the first tile
// instruction kills the process with SIGILL. The permission covers every thread of the process,
// those already running included. Asked once; a kernel that refuses makes AMX unsupported here.
bool amx_permitted() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// AMX-TILE and AMX-INT8 are CPUID leaf 7 EDX bits 24 and 25 (asked directly: not every compiler's
// __builtin_cpu_supports knows them); the tile kernels also run the VNNI kernels for few rows.
bool has_amx_int8() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!has_avx512_vnni() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1u, int8 = (edx >> 25) & 1u;
  return tile && int8 && amx_permitted();
}

// AMX-BF16 is CPUID leaf 7 EDX bit 22, AVX512_BF16 leaf 7 subleaf 1 EAX bit 5 (the bf16
// conversions that split prompt-attention operands, avx512/attention_amx.cpp).
bool has_amx_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!has_amx_int8() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile_bf16 = (edx >> 22) & 1u;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return tile_bf16 && ((eax >> 5) & 1u);
}

// AVX512_BF16 is CPUID leaf 7 subleaf 1 EAX bit 5; the dot-product attention also needs
// AVX-512F/BW/VL (every AVX512_BF16 CPU has AVX-512 VNNI too: Cooper Lake on, Zen 4 on).
bool has_avx512_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!has_avx512_vnni() || !__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax >> 5) & 1u;
}

// In increasing order of preference: "auto" picks the last one the CPU supports.
constexpr PathInfo kKernelPaths[] = {
    {KernelPath::kAvx2, "avx2", "avx2 fma f16c", has_avx2, false},
    {KernelPath::kAvx512Vnni, "avx512_vnni", "avx512f avx512bw avx512vl avx512_vnni",
     has_avx512_vnni, true},
    {KernelPath::kAmxInt8, "amx_int8",
     "amx_tile amx_int8 avx512f avx512bw avx512vl avx512_vnni, and the OS's leave to use tiles",
     has_amx_int8, true},
};
static_assert(std::size(kKernelPaths) == static_cast<size_t>(KernelPath::kNumPaths));

const PathInfo& info(KernelPath path) { return kKernelPaths[static_cast<int>(path)]; }

KernelPath best_path() {
  KernelPath best = KernelPath::kAvx2;  // native.py loads the library only on AVX2 CPUs
  for (const PathInfo& p : kKernelPaths) {
    if (p.supported()) best = p.path;
  }
  return best;
}

// `name` as a path this CPU runs; `source` says where the name came from in the error.
KernelPath parse_path(std::string_view name, const char* source) {
  if (name == "auto") return best_path();
  std::string known = "auto";
  for (const PathInfo& p : kKernelPaths) {
    if (name != p.name) {
      known += std::string(", ") + p.name;
      continue;
    }
    TORCH_CHECK(p.supported(), source, "=", name, ": this CPU lacks the ", p.name,
                " kernel path (it needs ", p.features, "); use auto or a supported path");
    return p.path;
  }
  TORCH_CHECK(false, source, "=", name, ": unknown kernel path; expected one of ", known);
}

KernelPath path_from_env() {
  const char* env = std::getenv("SPECULANT_KERNEL_PATH");
  return parse_path(env != nullptr && *env != '\0' ? env : "auto", "SPECULANT_KERNEL_PATH");
}

constexpr int kUnset = -1;
std::atomic<int> active{kUnset};  // a KernelPath, or kUnset until first use

constexpr int64_t kMaxPrefetchBlocks = 64;

// AMD family 19h (Zen 3 and Zen 4; only Zen 4 has AVX-512): CPUID leaf 0's vendor, leaf 1's
// family (base + extended when the base is 0xF).
bool amd_family_19h() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // AuthenticAMD
  if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned base = (eax >> 8) & 0xFu, extended = (eax >> 20) & 0xFFu;
  return (base == 0xFu ? base + extended : base) == 0x19u;
}

// An integer setting the CPU decides unless its environment variable does, read on first use (a
// bad value throws then, and at every later call) and settable in process (tests, A/B runs).
struct IntSetting {
  const char* env;     // its environment variable
  const char* setter;  // its in-process setter, named in that one's error
  const char* unit;    // what it counts, for the errors
  int64_t min, max;
  int64_t (*cpu_default)();
  std::atomic<int64_t> value{kUnset};  // kUnset until first use

  void check(bool ok, int64_t v, const char* text) const {
    if (text != nullptr) {
      TORCH_CHECK(ok, env, "=", text, ": expected a whole number of ", unit, " from ", min,
                  " to ", max);
    } else {
      TORCH_CHECK(ok, setter, "(", v, "): expected a whole number of ", unit, " from ", min,
                  " to ", max);
    }
  }

  int64_t from_env() const {
    const char* text = std::getenv(env);
    if (text == nullptr || *text == '\0') return cpu_default();
    char* end = nullptr;
    const long long v = std::strtoll(text, &end, 10);
    check(end != text && *end == '\0' && v >= min && v <= max, v, text);
    return v;
  }

  int64_t get() {
    int64_t v = value.load(std::memory_order_relaxed);
    if (v == kUnset) {
      int64_t expected = kUnset;
      value.compare_exchange_strong(expected, from_env());
      v = value.load(std::memory_order_relaxed);
    }
    return v;
  }

  int64_t set(int64_t v) {
    check(v >= min && v <= max, v, nullptr);
    const int64_t previous = get();
    value.store(v, std::memory_order_relaxed);
    return previous;
  }
};

IntSetting prefetch_blocks{"SPECULANT_PREFETCH_BLOCKS", "set_weight_prefetch_blocks",
                           "weight blocks", 0, kMaxPrefetchBlocks,
                           [] { return amd_family_19h() ? int64_t{0} : int64_t{4}; }};
IntSetting wide_rows{"SPECULANT_VNNI_WIDE_ROWS", "set_vnni_wide_rows", "rows", 2, 4096,
                     [] { return amd_family_19h() ? int64_t{4096} : int64_t{5}; }};

// SPECULANT_PROMPT_ATTENTION: "auto" (tiles where the CPU has them) or "fp32".
bool prompt_tiles_from_env() {
  const char* env = std::getenv("SPECULANT_PROMPT_ATTENTION");
  const std::string_view mode = env != nullptr && *env != '\0' ? env : "auto";
  TORCH_CHECK(mode == "auto" || mode == "fp32", "SPECULANT_PROMPT_ATTENTION=", mode,
              ": expected auto (AMX-BF16 tiles for prompt positions where the CPU has them) or "
              "fp32");
  return mode == "auto";
}

std::atomic<int> prompt_tiles_wanted{kUnset};  // 0 / 1, kUnset until first use

// SPECULANT_KV_ATTENTION: "auto" (AMX-BF16 tiles where the CPU has them) or "avx512_bf16".
std::atomic<int> kv_tiles_wanted{kUnset};  // 0 / 1, kUnset until first use

bool kv_tiles_from_env() {
  const char* env = std::getenv("SPECULANT_KV_ATTENTION");
  const std::string_view mode = env != nullptr && *env != '\0' ? env : "auto";
  TORCH_CHECK(mode == "auto" || mode == "avx512_bf16", "SPECULANT_KV_ATTENTION=", mode,
              ": expected auto (AMX-BF16 tiles for a bfloat16 KV cache where the CPU has them, "
              "else AVX512_BF16 dot products) or avx512_bf16");
  TORCH_CHECK(mode == "auto" || has_avx512_bf16(), "SPECULANT_KV_ATTENTION=avx512_bf16: this CPU "
              "lacks AVX512_BF16 (and AVX-512 VNNI)");
  return mode == "auto";
}


}  // namespace

KernelPath active_kernel_path() {
  int path = active.load(std::memory_order_relaxed);
  if (path == kUnset) {
    // a bad variable throws here, and again at every later call, never picking a path silently
    int expected = kUnset;
    active.compare_exchange_strong(expected, static_cast<int>(path_from_env()));
    path = active.load(std::memory_order_relaxed);
  }
  return static_cast<KernelPath>(path);
}

bool wide_attention(KernelPath path) { return info(path).wide_attention; }

std::string kernel_path() { return info(active_kernel_path()).name; }

std::vector<std::string> kernel_paths() {
  std::vector<std::string> names;
  for (const PathInfo& p : kKernelPaths) {
    if (p.supported()) names.emplace_back(p.name);
  }
  return names;
}

int64_t weight_prefetch_blocks() { return prefetch_blocks.get(); }

int64_t vnni_wide_rows() { return wide_rows.get(); }

int64_t set_vnni_wide_rows(int64_t rows) { return wide_rows.set(rows); }

int64_t set_weight_prefetch_blocks(int64_t blocks) { return prefetch_blocks.set(blocks); }

bool prompt_attention_tiles() {
  int wanted = prompt_tiles_wanted.load(std::memory_order_relaxed);
  if (wanted == kUnset) {
    int expected = kUnset;  // a bad variable throws here, and at every later call
    prompt_tiles_wanted.compare_exchange_strong(expected, prompt_tiles_from_env() ? 1 : 0);
    wanted = prompt_tiles_wanted.load(std::memory_order_relaxed);
  }
  static const bool available = has_amx_bf16();
  return wanted == 1 && available && active_kernel_path() == KernelPath::kAmxInt8;
}

bool tile_kv_cache() {
  static const bool available = has_avx512_bf16();
  return available;
}

bool kv_attention_tiles() {
  int wanted = kv_tiles_wanted.load(std::memory_order_relaxed);
  if (wanted == kUnset) {
    int expected = kUnset;
    kv_tiles_wanted.compare_exchange_strong(expected, kv_tiles_from_env() ? 1 : 0);
    wanted = kv_tiles_wanted.load(std::memory_order_relaxed);
  }
  static const bool available = has_amx_bf16();
  return wanted == 1 && available;
}

std::string kv_attention() {
  if (!tile_kv_cache()) return "none";
  return kv_attention_tiles() ? "amx_bf16" : "avx512_bf16";
}

std::string set_kv_attention(const std::string& mode) {
  TORCH_CHECK(mode == "auto" || mode == "avx512_bf16", "set_kv_attention(", mode,
              "): expected auto or avx512_bf16");
  TORCH_CHECK(mode == "auto" || tile_kv_cache(), "set_kv_attention(avx512_bf16): this CPU lacks "
              "AVX512_BF16 (and AVX-512 VNNI)");
  kv_attention_tiles();  // reads the variable first, if nothing has yet
  const bool was_auto = kv_tiles_wanted.load(std::memory_order_relaxed) == 1;
  kv_tiles_wanted.store(mode == "auto" ? 1 : 0, std::memory_order_relaxed);
  return was_auto ? "auto" : "avx512_bf16";
}

std::string prompt_attention() { return prompt_attention_tiles() ? "amx_bf16" : "fp32"; }

std::string set_prompt_attention(const std::string& mode) {
  TORCH_CHECK(mode == "auto" || mode == "fp32", "set_prompt_attention(", mode,
              "): expected auto or fp32");
  prompt_attention_tiles();  // reads the variable first, if nothing has yet
  const bool was_auto = prompt_tiles_wanted.load(std::memory_order_relaxed) == 1;
  prompt_tiles_wanted.store(mode == "auto" ? 1 : 0, std::memory_order_relaxed);
  return was_auto ? "auto" : "fp32";
}

std::string set_kernel_path(const std::string& name) {
  const KernelPath path = parse_path(name, "set_kernel_path");
  const KernelPath previous = active_kernel_path();
  active.store(static_cast<int>(path), std::memory_order_relaxed);
  return info(previous).name;
}

}  // namespace speculant
