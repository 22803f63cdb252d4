// Every layer of a decode step on the cpu in one call from Python: the same kernels, in the same
// order and on the same buffers as chip_child.models.qwen3.forward calls them one by one, so the
// result is the same bits, without the ten or so Python calls, views and allocations a layer costs
// there (about half of a 27M model's batch-1 step). The kernels come as function pointers from
// their own libraries (layer_ops, bf16_linear / bf16_amx, decode_attention), each already built and
// checked on its own; this file only sequences them.
#include <stdint.h>
#include <string.h>

#include <vector>

#include "bf16_packing.h"
#include "layer_ops_split.h"
#include "step_team.h"

extern "C" {

typedef void (*LinearFn)(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                         int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
typedef void (*AddRmsNormFn)(const uint16_t* h, int64_t h_stride, const uint16_t* delta, int64_t d_stride,
                             const uint16_t* weight, float eps, uint16_t* h_out, int64_t ho_stride, uint16_t* x,
                             int64_t x_stride, int64_t T, int64_t n);
typedef void (*BlocksFn)(const uint16_t* x, int64_t ldx, const uint16_t* packed, uint16_t* y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1);
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
  BlocksFn blocks;  // the same kernel on a range of blocks on the calling thread; null: it has none
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
  int team;  // 1: the projections and attention run on step_team.h's team, not OpenMP regions
};

// A greedy decode step's end: the final norm, the packed lm_head and the pick (l3_decode_head).
struct Head {
  const uint16_t* norm;
  Projection lm_head;
  int64_t vocab;
};

}  // extern "C"

namespace {

// One projection on the team: a unit is one packed block of PACK_BLOCK outputs, run by the same
// kernel's block entry on the calling thread.
struct ProjectionJob {
  const Projection* p;
  const uint16_t* x;
  int64_t ldx;
  uint16_t* y;
  int64_t ldy, M, N, K;

  static void run(const void* ctx, int64_t b) {
    const ProjectionJob& j = *(const ProjectionJob*)ctx;
    j.p->blocks(j.x, j.ldx, j.p->packed, j.y, j.ldy, j.M, j.N, j.K, b, b + 1);
  }
};

void team_linear(const Projection& p, const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K, int threads) {
  const ProjectionJob job{&p, x, ldx, y, ldy, M, N, K};
  l3::step_team(threads).run(&ProjectionJob::run, &job, (N + l3::PACK_BLOCK - 1) / l3::PACK_BLOCK);
}

// One layer's decode attention: the new keys and values go into the cache first (q and the new k
// from the rotated heads, the new v from the projection). As one OpenMP region of `threads`, or on
// the team, where a unit is one (row, kv head) pair that the kernel runs on the calling thread
// (its `threads` -1 - pair).
struct AttentionJob {
  const Model* m;
  const Step* s;
  const Layer* L;
  const uint16_t *qk, *qkv;
  uint16_t* attn;

  void attend(int threads) const {
    const int64_t hd = m->head_dim, qk_n = (m->heads + m->kv_heads) * hd, q_n = m->heads * hd;
    m->attention(1, qk, qk_n, L->k_cache, L->v_cache, m->head_stride, m->page_stride, s->block_table,
                 s->table_stride, s->seq_lens, s->rows, m->kv_heads, m->heads / m->kv_heads, hd, m->page_size,
                 m->scale, attn, q_n, qk + q_n, qk_n, qkv + qk_n, qk_n + m->kv_heads * hd, s->slots, threads);
  }
  static void run(const void* ctx, int64_t pair) { ((const AttentionJob*)ctx)->attend((int)(-1 - pair)); }
};

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Whether `a` takes the place of `b` as the largest so far, as argmax sees it: NaN above every
// number and the first of equals kept.
inline bool beats(float a, float b) { return a != a ? b == b : a > b; }

// The lm_head on the team: a unit is the projection's unit, one packed block of PACK_BLOCK
// vocabulary ids, which it also widens to fp32 into the logits and picks the block's largest from
// per row while the block is in L1, so the caller only compares the blocks' picks.
struct HeadJob {
  ProjectionJob proj;  // y [M, N] = x [M, K] @ lm_head^T
  float* logits;
  int64_t ldl, blocks;
  float* best;        // [M, blocks]
  int64_t* best_id;   // [M, blocks]

  static void run(const void* ctx, int64_t b) {
    const HeadJob& j = *(const HeadJob*)ctx;
    const ProjectionJob& p = j.proj;
    ProjectionJob::run(&p, b);
    const int64_t lo = b * l3::PACK_BLOCK, hi = lo + l3::PACK_BLOCK < p.N ? lo + l3::PACK_BLOCK : p.N;
    for (int64_t t = 0; t < p.M; ++t) {
      const uint16_t* y = p.y + t * p.ldy;
      float* out = j.logits + t * j.ldl;
      float top = bf16_to_float(y[lo]);
      int64_t at = lo;
      for (int64_t n = lo; n < hi; ++n) {
        const float f = out[n] = bf16_to_float(y[n]);
        if (beats(f, top)) top = f, at = n;
      }
      j.best[t * j.blocks + b] = top;
      j.best_id[t * j.blocks + b] = at;
    }
  }
};

}  // namespace

extern "C" {

// The sizes the Python side's ctypes structures must agree with (its load-time check).
int64_t l3_decode_layers_abi(int64_t what) {
  return what == 0 ? (int64_t)sizeof(Layer) : what == 1 ? (int64_t)sizeof(Model)
         : what == 2 ? (int64_t)sizeof(Step) : (int64_t)sizeof(Head);
}

// The most rows a step may have to run on the step team: where every layer op stays on one thread.
int64_t l3_decode_layers_team_rows(const Model* m) {
  int64_t widest = m->hidden > m->intermediate ? m->hidden : m->intermediate;
  if ((m->heads + m->kv_heads) * m->head_dim > widest) widest = (m->heads + m->kv_heads) * m->head_dim;
  return l3::PARALLEL_ELEMENTS / widest;
}

// A projection on the step team (the lm_head of a step whose layers ran there); threads as a Step's.
void l3_team_linear(const Projection* p, const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t M,
                    int64_t N, int64_t K, int threads) {
  team_linear(*p, x, ldx, y, ldy, M, N, K, threads);
}

// Tests: hold every team's helpers off (1) or let them work (0); the units they ran since the
// last call.
void l3_step_team_hold(int on) {
  for (int m = 0; m <= l3::TEAM_MAX; ++m)
    if (l3::StepTeam* t = l3::step_teams()[m].load()) t->hold(on != 0);
}
int64_t l3_step_team_helper_units(void) {
  int64_t units = 0;
  for (int m = 0; m <= l3::TEAM_MAX; ++m)
    if (l3::StepTeam* t = l3::step_teams()[m].load()) units += t->take_helper_units();
  return units;
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
  bool team = s->team && s->threads > 1 && l3_decode_layers_team_rows(m) >= T;
  for (int64_t i = 0; team && i < m->num_layers; ++i) {
    const Layer& L = m->layers[i];
    team = L.qkv.blocks && L.o_proj.blocks && L.gate_up.blocks && L.down.blocks;
  }
  // A projection of the step's T rows, on the team or as one OpenMP region.
  const auto linear = [&](const Projection& p, const uint16_t* in, int64_t ld_in, uint16_t* out, int64_t N,
                          int64_t K) {
    if (team)
      team_linear(p, in, ld_in, out, N, T, N, K, s->threads);
    else
      p.run(in, ld_in, p.packed, nullptr, out, N, T, N, K, s->threads);
  };
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const Layer& L = m->layers[i];
    // The residual add is taken with the norm that follows it; layer 0 has nothing to add.
    m->add_rms_norm(h, H, i ? delta : nullptr, H, L.input_norm, m->eps, h, H, x, H, T, H);
    linear(L.qkv, x, H, qkv, qkv_n, H);
    m->qk_norm_rope(qkv, qkv_n, hd, L.qk_norm, hd, m->eps, s->rope, s->positions, s->pos64, qk, T, qk_heads, hd);
    const AttentionJob job{m, s, &L, qk, qkv, attn};
    if (team)
      l3::step_team(s->threads).run(&AttentionJob::run, &job, T * m->kv_heads);
    else
      job.attend(s->threads);
    linear(L.o_proj, attn, q_n, o, H, q_n);
    m->add_rms_norm(h, H, o, H, L.post_norm, m->eps, h, H, x, H, T, H);
    linear(L.gate_up, x, H, gate_up, 2 * I, H);
    m->silu_mul(gate_up, 2 * I, act, T, I);
    linear(L.down, act, I, delta, H, I);
  }
}

// The end of a greedy decode step of `rows` rows after l3_decode_layers, as final_logits and the
// sampler's first_max do it in Python, with the same kernels: hidden = h + delta and x its final
// norm (m's add_rms_norm), y = x @ lm_head^T in bf16 on the step team of `threads`, the fp32
// logits [rows, vocab] (row stride ldl) and each row's argmax into ids. x [rows, hidden] and
// y [rows, vocab] are scratch.
void l3_decode_head(const Model* m, const Head* head, int64_t rows, const uint16_t* h, const uint16_t* delta,
                    uint16_t* hidden, uint16_t* x, uint16_t* y, float* logits, int64_t ldl, int64_t* ids,
                    int threads) {
  const int64_t H = m->hidden, V = head->vocab, blocks = (V + l3::PACK_BLOCK - 1) / l3::PACK_BLOCK;
  m->add_rms_norm(h, H, delta, H, head->norm, m->eps, hidden, H, x, H, rows, H);
  std::vector<float> best(rows * blocks);
  std::vector<int64_t> best_id(rows * blocks);
  const HeadJob job{{&head->lm_head, x, H, y, V, rows, V, H}, logits, ldl, blocks, best.data(), best_id.data()};
  l3::step_team(threads).run(&HeadJob::run, &job, blocks);
  for (int64_t t = 0; t < rows; ++t) {
    int64_t at = 0;
    for (int64_t b = 1; b < blocks; ++b)
      if (beats(best[t * blocks + b], best[t * blocks + at])) at = b;
    ids[t] = best_id[t * blocks + at];
  }
}

}  // extern "C"
