// Registers the kernels as torch.ops.speculant.* so they dispatch like built-in operators and
// stay traceable by torch.compile (their fake implementations live in native.py).
#include <torch/library.h>

#include "kernel_path.h"
#include "ops.h"
#include "pool.h"

TORCH_LIBRARY(speculant, m) {
  m.def(
      "packed_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? mins, str qtype, "
      "int out_features) -> Tensor");
  m.def(
      "packed_linear_argmax(Tensor x, Tensor weight, Tensor? scales, Tensor? mins, str qtype, "
      "int out_features) -> (Tensor, Tensor)");
  m.def(
      "packed_embed(Tensor ids, Tensor weight, Tensor? scales, Tensor? mins, str qtype, "
      "int out_features) -> Tensor");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor token_seq, Tensor token_pos, float scale, Tensor? prompt_lens=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("row_argmax(Tensor logits, bool with_prob=False) -> (Tensor, Tensor)");
  m.def(
      "sample_rows(Tensor logits, Tensor uniforms, float temperature, int top_k, float top_p, "
      "float min_p, bool with_prob=False) -> (Tensor, Tensor)");
  m.def(
      "rope_write_kv(Tensor qkv, Tensor? bias, Tensor? q_norm, Tensor? k_norm, float eps, "
      "Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, int num_heads) -> Tensor");
  m.def(
      "decoder_stack_register(Tensor?[] weights, int[] qtypes, int[] out_features) -> int");
  // process-wide kernel path (no tensors, so registered for every dispatch key at once)
  m.def("kernel_path() -> str", &speculant::kernel_path);
  m.def("kernel_paths() -> str[]", &speculant::kernel_paths);
  m.def("set_kernel_path(str path) -> str", &speculant::set_kernel_path);
  m.def("weight_prefetch_blocks() -> int", &speculant::weight_prefetch_blocks);
  m.def("vnni_wide_rows() -> int", &speculant::vnni_wide_rows);
  m.def("prompt_attention() -> str", &speculant::prompt_attention);
  m.def("tile_kv_cache() -> bool", &speculant::tile_kv_cache);
  m.def("kv_attention() -> str", &speculant::kv_attention);
  m.def("set_kv_attention(str mode) -> str", &speculant::set_kv_attention);
  m.def("thread_team() -> str", &speculant::thread_team);
  m.def("pool_warm(Tensor[] tensors) -> bool");
  m.def("set_prompt_attention(str mode) -> str", &speculant::set_prompt_attention);
  m.def("set_weight_prefetch_blocks(int blocks) -> int", &speculant::set_weight_prefetch_blocks);
  m.def("set_vnni_wide_rows(int rows) -> int", &speculant::set_vnni_wide_rows);
  m.def("decoder_stack_release(int stack) -> ()", &speculant::decoder_stack_release);
  m.def(
      "decoder_stack(Tensor(a!) h, int stack, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, "
      "Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, Tensor block_tables, "
      "Tensor token_seq, Tensor token_pos, Tensor final_norm, int[] hidden_layers, "
      "int num_heads, float eps, float scale, Tensor? hidden_rows=None, Tensor? prompt_lens=None) "
      "-> (Tensor, Tensor[])");
  m.def(
      "eagle3_layer(Tensor inputs, Tensor hidden, Tensor?[] weights, int[] qtypes, "
      "int[] out_features, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor token_seq, "
      "Tensor token_pos, Tensor? logits_rows, int num_heads, float eps, float scale, "
      "bool pick=False) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(speculant, CPU, m) {
  m.impl("packed_linear", &speculant::packed_linear);
  m.impl("packed_linear_argmax", &speculant::packed_linear_argmax);
  m.impl("packed_embed", &speculant::packed_embed);
  m.impl("paged_attention", &speculant::paged_attention);
  m.impl("rms_norm", &speculant::rms_norm);
  m.impl("add_rms_norm", &speculant::add_rms_norm);
  m.impl("silu_mul", &speculant::silu_mul);
  m.impl("row_argmax", &speculant::row_argmax);
  m.impl("sample_rows", &speculant::sample_rows);
  m.impl("rope_write_kv", &speculant::rope_write_kv);
  m.impl("decoder_stack_register", &speculant::decoder_stack_register);
  m.impl("decoder_stack", &speculant::decoder_stack);
  m.impl("eagle3_layer", &speculant::eagle3_layer);
  m.impl("pool_warm", &speculant::pool_warm);
}
