// A greedy decode step's inputs read from the decode service's own buffers, and its tokens written back
// there (for greedy_step in cpu_step.cpp; built with cpu_fused.cpp by common/models/cpu_fused.py):
//   step_inputs: each request's pending token from the token buffer at its row, its embedding, the cos and
//     sin of its position (the committed KV length), the slot it writes and the slots it reads (the row of
//     req_to_token up to its new length);
//   stash_tokens: each request's new token into the token buffer at its row.
// The same from Python was ~13 torch ops and their glue between two steps: 0.6-0.8 ms of a batch-1 w8a8
// step of SmolLM2 (~6.5 ms), each op's caches cold after the weights streamed past, each releasing the
// interpreter lock to the scheduler thread that step's end had woken (2-core AMD Zen 4).

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>

#include "cpu_common.h"

namespace disagg_cpu {

namespace {

void check_cpu(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == dim, "greedy_step: ",
              what, " must be a contiguous CPU tensor of ", dim, " dimension(s) and dtype ", dtype);
}

}  // namespace

StepInputs step_inputs(const at::Tensor& token_ids, const at::Tensor& rows, const at::Tensor& req_to_token,
                       const at::Tensor& kv_lens, const at::Tensor& embed, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, int64_t num_slots) {
  check_cpu(token_ids, at::kLong, 1, "token_ids");
  check_cpu(rows, at::kLong, 1, "rows");
  check_cpu(kv_lens, at::kLong, 1, "kv_lens");
  check_cpu(embed, at::kFloat, 2, "embed");
  check_cpu(cos_table, at::kFloat, 2, "cos_table");
  check_cpu(sin_table, at::kFloat, 2, "sin_table");
  TORCH_CHECK(req_to_token.device().is_cpu() && req_to_token.is_contiguous() && req_to_token.dim() == 2 &&
                  (req_to_token.scalar_type() == at::kInt || req_to_token.scalar_type() == at::kLong),
              "greedy_step: req_to_token must be a contiguous CPU int32 or int64 table");
  TORCH_CHECK(cos_table.sizes() == sin_table.sizes(), "greedy_step: cos and sin tables of one shape expected");
  const int64_t b = rows.numel(), hidden = embed.size(1), d = cos_table.size(1);
  const int64_t vocab = embed.size(0), positions = cos_table.size(0), width = req_to_token.size(1);
  TORCH_CHECK(b > 0 && kv_lens.numel() == b, "greedy_step: one kv length per row expected");
  const int64_t *prow = rows.data_ptr<int64_t>(), *plen = kv_lens.data_ptr<int64_t>();
  int64_t* ptok = token_ids.data_ptr<int64_t>();
  int64_t s_max = 0;
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(prow[r] >= 0 && prow[r] < token_ids.numel() && prow[r] < req_to_token.size(0),
                "greedy_step: row out of range");
    TORCH_CHECK(ptok[prow[r]] >= 0 && ptok[prow[r]] < vocab, "greedy_step: pending token out of range");
    TORCH_CHECK(plen[r] >= 0 && plen[r] < positions && plen[r] < width, "greedy_step: position out of range");
    s_max = std::max(s_max, plen[r] + 1);
  }
  const at::TensorOptions f32 = embed.options(), i64 = rows.options();
  StepInputs in{at::empty({b, hidden}, f32), at::empty({b, d}, f32),        at::empty({b, d}, f32),
                at::empty({b}, i64),         at::empty({b, s_max}, i64),    at::empty({b}, i64)};
  float *x = in.x.data_ptr<float>(), *cos = in.cos.data_ptr<float>(), *sin = in.sin.data_ptr<float>();
  int64_t *loc = in.out_loc.data_ptr<int64_t>(), *slots = in.slots.data_ptr<int64_t>();
  int64_t* seq = in.seq_lens.data_ptr<int64_t>();
  const bool wide = req_to_token.scalar_type() == at::kLong;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t pos = plen[r];
    std::memcpy(x + r * hidden, embed.data_ptr<float>() + ptok[prow[r]] * hidden, hidden * sizeof(float));
    std::memcpy(cos + r * d, cos_table.data_ptr<float>() + pos * d, d * sizeof(float));
    std::memcpy(sin + r * d, sin_table.data_ptr<float>() + pos * d, d * sizeof(float));
    int64_t* mine = slots + r * s_max;
    if (wide) {
      const int64_t* src = req_to_token.data_ptr<int64_t>() + prow[r] * width;
      std::copy(src, src + pos + 1, mine);
    } else {
      const int32_t* src = req_to_token.data_ptr<int32_t>() + prow[r] * width;
      std::copy(src, src + pos + 1, mine);
    }
    std::fill(mine + pos + 1, mine + s_max, 0);  // past its length: never read
    for (int64_t s = 0; s <= pos; ++s) TORCH_CHECK(mine[s] >= 0 && mine[s] < num_slots, "greedy_step: slot out of range");
    loc[r] = mine[pos], seq[r] = pos + 1;
  }
  return in;
}

void stash_tokens(const at::Tensor& token_ids, const at::Tensor& rows, const at::Tensor& tokens) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.numel() == rows.numel(), "greedy_step: a token per row");
  const int64_t *prow = rows.data_ptr<int64_t>(), *ptok = tokens.data_ptr<int64_t>();
  int64_t* out = token_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); ++r) out[prow[r]] = ptok[r];
}

}  // namespace disagg_cpu
