// Which instruction-set path the block-type linear kernels run on, chosen once per process from
// the CPU's features (or forced with SPECULANT_KERNEL_PATH), and switchable at run time so tests
// and benchmarks can compare paths in one process.
//
// Every path gives bit-identical results (see linear.cpp), so the choice only changes speed.
// A path is a row of kKernelPaths; a new one adds an enumerator, a row naming its CPU features,
// and its kernels in linear.cpp's table.
#pragma once

#include <string>
#include <vector>

namespace speculant {

enum class KernelPath : int { kAvx2, kAvx512Vnni, kAmxInt8, kNumPaths };

// The active path: SPECULANT_KERNEL_PATH (auto, or a path name) on first use, else the last
// set_kernel_path. Throws if the variable names an unknown path or one this CPU cannot run.
KernelPath active_kernel_path();

// Whether `path` runs attention's inner loops with 512-bit vectors (attention_wide.h).
bool wide_attention(KernelPath path);

// Operators (registered in ops.cpp): the active path's name; the paths this CPU supports, best
// last; set_kernel_path(name or "auto") -> the previous path's name.
std::string kernel_path();
std::vector<std::string> kernel_paths();
std::string set_kernel_path(const std::string& name);

}  // namespace speculant
