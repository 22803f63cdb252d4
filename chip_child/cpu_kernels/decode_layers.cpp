// Every layer of a decode step on the cpu in one call from Python: the same kernels, in the same
// order and on the same buffers as chip_child.models.qwen3.forward calls them one by one, so the
// result is the same bits, without the ten or so Python calls, views and allocations a layer costs
// there (about half of a 27M model's batch-1 step). The kernels come as function pointers from
// their own libraries (layer_ops, bf16_linear / bf16_amx, decode_attention), each already built and
// checked on its own; this file only sequences them.
#include <stdint.h>

extern "C" {

typedef void (*LinearFn)(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                         int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
typedef void (*AddRmsNormFn)(const uint16_t* h, int64_t h_stride, const uint16_t* delta, int64_t d_stride,
                             const uint16_t* weight, float eps, uint16_t* h_out, int64_t ho_stride, uint16_t* x,
                             int64_t x_stride, int64_t T, int64_t n);
typedef void (*QkNormRopeFn)(const uint16_t* qk, int64_t t_stride, int64_t h_stride, const uint16_t* weight,
                             int64_t w_stride, float eps, const uint16_t* rope, const void* positions, int pos64,
                             uint16_t* out, int64_t T, int64_t heads, int64_t hd);
typedef void (*SiluMulFn)(const uint16_t* gate_up, int64_t stride, uint16_t* out, int64_t T, int64_t n);
typedef void (*AttentionFn)(int bf16, const void* q, int64_t q_row_stride, void* k, void* v, int64_t head_stride,
                            int64_t page_stride, const int32_t* block_table, int64_t table_stride,
                            const int32_t* seq_lens, int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                            int64_t page_size, float scale, void* out, int64_t out_row_stride, const void* new_k,
                            int64_t new_k_row_stride, const void* new_v, int64_t new_v_row_stride,
                            const int64_t* new_slots, int threads);

// One packed projection: the kernel that runs it (AMX or AVX-512, chosen per matrix at load).
struct Projection {
  LinearFn run;
  const uint16_t* packed;
};

// One layer's weights and its KV cache (bf16). qk_norm [heads + kv_heads, head_dim]: q_norm's row per
// query head, then k_norm's per kv head; null: no q/k norm (Llama, Qwen2, Mistral).
struct Layer {
  const uint16_t* input_norm;
  Projection qkv;
  const uint16_t* qk_norm;
  Projection o_proj;
  const uint16_t* post_norm;
  Projection gate_up;
  Projection down;
  void* k_cache;
  void* v_cache;
};

// What stays fixed while the model does: shapes, the kernels, the layers.
struct Model {
  AddRmsNormFn add_rms_norm;
  QkNormRopeFn qk_norm_rope;
  SiluMulFn silu_mul;
  AttentionFn attention;
  const Layer* layers;
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
  int64_t head_stride, page_stride, page_size;  // the cache's, in elements
  float eps, scale;
};

// One step: `rows` decode rows, each one token.
struct Step {
  int64_t rows;
  const uint16_t* rope;  // [positions, 2, head_dim]
  const void* positions;
  int pos64;
  const int32_t* block_table;
  int64_t table_stride;
  const int32_t* seq_lens;  // the new token included
  const int64_t* slots;     // where each row's new key and value go
  int threads;
};

// The sizes the Python side's ctypes structures must agree with (its load-time check).
int64_t l3_decode_layers_abi(int64_t what) {
  return what == 0 ? (int64_t)sizeof(Layer) : what == 1 ? (int64_t)sizeof(Model) : (int64_t)sizeof(Step);
}

// Bf16 scratch per row that l3_decode_layers needs (its `work`), in elements.
int64_t l3_decode_layers_work(const Model* m) {
  const int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim, qk = (m->heads + m->kv_heads) * m->head_dim;
  return m->hidden * 2 + qkv + qk + m->heads * m->head_dim + 2 * m->intermediate + m->intermediate;
}

// h [rows, hidden] holds the embeddings and ends as the last layer's residual stream before its MLP
// is added; delta [rows, hidden] ends as that MLP's output (the caller adds them, as forward does).
void l3_decode_layers(const Model* m, const Step* s, uint16_t* h, uint16_t* delta, uint16_t* work) {
  const int64_t T = s->rows, H = m->hidden, hd = m->head_dim, I = m->intermediate;
  const int64_t qkv_n = (m->heads + 2 * m->kv_heads) * hd, qk_heads = m->heads + m->kv_heads;
  const int64_t q_n = m->heads * hd;
  uint16_t* x = work;                      // [T, H] the normed input of a projection
  uint16_t* qkv = x + T * H;               // [T, qkv_n]
  uint16_t* qk = qkv + T * qkv_n;          // [T, qk_heads, hd] q and k normed and rotated
  uint16_t* attn = qk + T * qk_heads * hd; // [T, q_n]
  uint16_t* o = attn + T * q_n;            // [T, H]
  uint16_t* gate_up = o + T * H;           // [T, 2I]
  uint16_t* act = gate_up + T * 2 * I;     // [T, I]
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const Layer& L = m->layers[i];
    // The residual add is taken with the norm that follows it; layer 0 has nothing to add.
    m->add_rms_norm(h, H, i ? delta : nullptr, H, L.input_norm, m->eps, h, H, x, H, T, H);
    L.qkv.run(x, H, L.qkv.packed, nullptr, qkv, qkv_n, T, qkv_n, H, s->threads);
    m->qk_norm_rope(qkv, qkv_n, hd, L.qk_norm, hd, m->eps, s->rope, s->positions, s->pos64, qk, T, qk_heads, hd);
    // q and the new k from the rotated heads, the new v from the projection; the kernel writes k, v first.
    m->attention(1, qk, qk_heads * hd, L.k_cache, L.v_cache, m->head_stride, m->page_stride, s->block_table,
                 s->table_stride, s->seq_lens, T, m->kv_heads, m->heads / m->kv_heads, hd, m->page_size, m->scale,
                 attn, q_n, qk + q_n, qk_heads * hd, qkv + qk_heads * hd, qkv_n, s->slots, s->threads);
    L.o_proj.run(attn, q_n, L.o_proj.packed, nullptr, o, H, T, H, q_n, s->threads);
    m->add_rms_norm(h, H, o, H, L.post_norm, m->eps, h, H, x, H, T, H);
    L.gate_up.run(x, H, L.gate_up.packed, nullptr, gate_up, 2 * I, T, 2 * I, H, s->threads);
    m->silu_mul(gate_up, 2 * I, act, T, I);
    L.down.run(act, I, L.down.packed, nullptr, delta, H, T, H, I, s->threads);
  }
}

}  // extern "C"
